"""Benchmarks that measure lowcomm beside vendor MPI, Horovod and torch.distributed (gloo) in
one run, on the same buffers, and print the figures side by side.

Timing: every iteration starts after a barrier; its time is the slowest rank's; a row reports
the median over iterations (robust on a shared, oversubscribed machine). Bandwidths follow
nccl-tests: ``algbw = bytes / time``, ``busbw = algbw · 2(K-1)/K`` for all-reduce.
"""
from __future__ import annotations

import dataclasses
import gc
import socket
import statistics
import time
from contextlib import contextmanager
from datetime import timedelta

import torch

from .collectives import ALGORITHMS, allreduce_
from .comm import Comm, mpi
from .ledger import Ledger, busbw_factor
from .watchdog import default_timeout_s

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
BASELINES = ("horovod", "gloo")


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16777216 (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in SIZE_UNITS else ""
    number = t[:-1] if unit else t
    try:
        value = int(float(number) * SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"cannot read size {text!r}; use e.g. 4K, 1M, 16M") from None
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return value


def init_gloo(comm: Comm):
    """A torch.distributed gloo process group over the same ranks (rendezvous on rank 0)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        addr = port = None
        if comm.rank == 0:
            addr = socket.gethostbyname(socket.gethostname())
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        addr, port = comm.bcast_object((addr, port))
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                                world_size=comm.size, timeout=timedelta(seconds=comm.watchdog.timeout_s or default_timeout_s()))
    return dist


def _check_known(name: str, known, what: str = "algorithm") -> None:
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")


@contextmanager
def baseline(name: str, comm: Comm):
    """Start Horovod (``horovod``) or a gloo process group (``gloo``, ``ddp-gloo``) for one
    benchmark window, yield its module, and shut it down after: their polling threads would
    otherwise slow every later row on a shared, oversubscribed machine. Others yield None."""
    if name == "horovod":
        from .backends.horovod import init
        hvd = init(comm)
        try:
            yield hvd
        finally:
            hvd.shutdown()
    elif name in ("gloo", "ddp-gloo"):
        dist = init_gloo(comm)
        try:
            yield dist
        finally:
            # Free what still holds the group (a DDP reducer in a reference cycle) first: the
            # last reference dropped after destroy_process_group() would run the group's
            # destructor with the GIL held, joining gloo workers that need the GIL to free a
            # finished work item — a deadlock (pytorch/pytorch#56297).
            gc.collect()
            dist.destroy_process_group()
    else:
        yield None


@contextmanager
def reducer(name: str, comm: Comm):
    """Yield a callable summing a float32 CPU tensor in place over all ranks with ``name``."""
    _check_known(name, [*ALGORITHMS, *BASELINES])
    with baseline(name, comm) as lib:
        if name == "horovod":
            yield lambda t: lib.allreduce_(t, op=lib.Sum, name="bench")
        elif name == "gloo":
            yield lambda t: lib.all_reduce(t)
        elif name == "hierarchical":     # the topology's communicators, built once (collective)
            from .topology import Topology
            levels = Topology.from_env(comm).comms(comm)
            yield lambda t: allreduce_(t, comm, name, levels=levels)
        else:
            yield lambda t: allreduce_(t, comm, name)


def _slowest(ctl: Comm, seconds: float) -> float:
    """The largest of the ranks' times (control plane, not charged to any method)."""
    return ctl.mpi.allreduce(seconds, op=mpi().MAX)


def bench_allreduce(comm: Comm, sizes: list[int], algorithms: list[str], iters: int = 20,
                    warmup: int = 3) -> list[dict]:
    """Time each algorithm on each float32 size; count wrong elements against the exact sum."""
    ctl = comm.dup(Ledger(), "control")
    bench = comm.dup(Ledger())
    bench.validate = False
    K = comm.size
    for alg in algorithms:   # fail on a bad name before measuring anything
        _check_known(alg, [*ALGORITHMS, *BASELINES])
    rows = []
    for alg in algorithms:
        with reducer(alg, bench) as reduce_:
            for size in sizes:
                n = size // 4
                base = (torch.arange(n, dtype=torch.float32) % 7) + comm.rank      # exact in float32
                expected = (torch.arange(n, dtype=torch.float32) % 7) * K + K * (K - 1) / 2
                buf = torch.empty(n, dtype=torch.float32)
                times = []
                for i in range(warmup + iters):
                    buf.copy_(base)
                    ctl.barrier()
                    t0 = time.perf_counter()
                    reduce_(buf)
                    dt = _slowest(ctl, time.perf_counter() - t0)
                    if i >= warmup:
                        times.append(dt)
                wrong = int((buf != expected).sum())
                t = statistics.median(times)
                algbw = size / t / 1e9 if t > 0 else 0.0
                rows.append({"size": size, "count": n, "dtype": "float32", "algorithm": alg,
                             "ranks": K, "time_us": t * 1e6, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * busbw_factor("allreduce", K), "wrong": wrong})
    return sorted(rows, key=lambda row: (row["size"], algorithms.index(row["algorithm"])))


def format_allreduce(rows: list[dict]) -> str:
    """An nccl-tests style table with each row's busbw as a ratio of vendor MPI's."""
    ref = {r["size"]: r["busbw_GBps"] for r in rows if r["algorithm"] == "mpi"}
    lines = [f"{'size':>10} {'algorithm':>13} {'time(us)':>11} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'vs mpi':>7} {'#wrong':>7}"]
    for r in rows:
        ratio = f"{r['busbw_GBps'] / ref[r['size']]:.2f}" if ref.get(r["size"]) else "-"
        lines.append(f"{r['size']:>10} {r['algorithm']:>13} {r['time_us']:>11.1f} "
                     f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f} {ratio:>7} {r['wrong']:>7}")
    return "\n".join(lines)


STEP_STRATEGIES = ("syncdp", *[f"syncdp-{a}" for a in ALGORITHMS if a != "mpi"], "horovod", "ddp-gloo")


def bench_step(comm: Comm, cfg, strategies: list[str], steps: int = 20, warmup: int = 5) -> list[dict]:
    """Median training-step time of ``cfg``'s model under each data-parallel implementation."""
    from .backends.horovod import HorovodDP
    from .loop import build_optimizer
    from .strategies.syncdp import SyncDP, SyncDPSettings
    from .tasks import load_task

    ctl = comm.dup(Ledger(), "control")
    task = load_task(cfg.task.name)
    s = SyncDPSettings.from_options({k: v for k, v in cfg.strategy.items()
                                     if k in SyncDPSettings.fields()}, "strategy.")
    for name in strategies:   # fail on a bad name before measuring anything
        _check_known(name, STEP_STRATEGIES, "strategy")
    rows = []
    for name in strategies:
        torch.manual_seed(cfg.seed)
        model = task.model(cfg)
        params = sum(p.numel() for p in model.parameters())
        opt = build_optimizer(cfg, model.parameters())
        run = comm.dup(Ledger())
        run.validate = False
        with baseline(name, comm):
            if name == "ddp-gloo":
                from torch.nn.parallel import DistributedDataParallel
                ddp = DistributedDataParallel(model, bucket_cap_mb=s.bucket_mb)
                times = _time_steps(ctl, task, cfg, opt, warmup, steps, lambda b: task.loss(ddp, b))
                del ddp     # before baseline() destroys its process group (see there)
            else:
                if name == "horovod":
                    wrapped = HorovodDP(model, opt, run)
                else:
                    algorithm = name.split("-", 1)[1] if name.startswith("syncdp-") else s.algorithm
                    levels = None
                    if algorithm == "hierarchical":
                        from .topology import Topology
                        levels = Topology.from_env(run, cfg.topology).comms(run)
                    wrapped = SyncDP(model, opt, run, algorithm=algorithm, bucket_mb=s.bucket_mb,
                                     overlap=s.overlap, levels=levels)
                times = _time_steps(ctl, task, cfg, wrapped, warmup, steps, lambda b: task.loss(model, b))
                wrapped.close()
        rows.append({"strategy": name, "ranks": comm.size, "params": params,
                     "grad_MB": params * 4 / 1e6, "step_ms": statistics.median(times) * 1e3,
                     "step_ms_mean": statistics.fmean(times) * 1e3})
    return rows


def _time_steps(ctl: Comm, task, cfg, opt, warmup: int, steps: int, loss) -> list[float]:
    """The slowest rank's time of each of ``steps`` training steps after ``warmup`` ones."""
    times = []
    for step in range(1, warmup + steps + 1):
        b = task.batch(step, ctl.rank, ctl.size, cfg)
        ctl.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss(b).backward()
        opt.step()
        dt = _slowest(ctl, time.perf_counter() - t0)
        if step > warmup:
            times.append(dt)
    return times


def format_step(rows: list[dict]) -> str:
    ref = {r["strategy"]: r["step_ms"] for r in rows}
    base = ref.get("syncdp")
    lines = [f"{'strategy':>22} {'params':>10} {'step(ms) median':>16} {'mean':>8} {'vs syncdp':>10}"]
    for r in rows:
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        lines.append(f"{r['strategy']:>22} {r['params']:>10} {r['step_ms']:>16.1f} "
                     f"{r['step_ms_mean']:>8.1f} {ratio:>10}")
    return "\n".join(lines)


def bench_compress(methods: list[str], numel: int = 2048 * 2048, iters: int = 10, warmup: int = 2,
                   cfg=None) -> list[dict]:
    """Single-process compress / decompress throughput of each method on one float32 gradient
    of ``numel`` elements (a square-ish matrix), beside a memcpy of the same bytes timed in the
    same run. GB/s = gradient bytes / median seconds; ``vs memcpy`` = that / memcpy GB/s.
    Method ``pack`` times the bit packing and unpacking alone (sign methods and 1-bit Adam)."""
    from .compress import COMPRESSORS, build_compressor
    from .compress.base import Segment
    from .compress.bits import pack_signs, unpack_signs
    from .config import CompressorConfig

    for m in methods:
        _check_known(m, [*COMPRESSORS, "pack"], "method")
    rows_n = max(1, int(numel ** 0.5))
    while numel % rows_n:
        rows_n -= 1
    shape = (rows_n, numel // rows_n)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    segs = [Segment("grad", torch.Size(shape), 0, numel)]
    nbytes = numel * 4

    def median(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    dst = torch.empty_like(x)
    memcpy = nbytes / median(lambda: dst.copy_(x)) / 1e9
    rows = [{"method": "memcpy", "compress_GBps": memcpy, "decompress_GBps": memcpy,
             "payload_bytes": nbytes}]
    base = cfg or CompressorConfig()
    for m in methods:
        if m == "pack":
            t = median(lambda: pack_signs(x))
            p = pack_signs(x)
            u = median(lambda: unpack_signs(p, numel, torch.float32, 0.5))
            rows.append({"method": "pack/unpack", "compress_GBps": nbytes / t / 1e9,
                         "decompress_GBps": nbytes / u / 1e9, "payload_bytes": p.numel()})
            continue
        c = build_compressor(dataclasses.replace(base, name=m, start_iter=0)) or COMPRESSORS["none"](base)
        t = median(lambda: c.compress(x, "bench", segs))
        payload, ctx = c.compress(x, "bench", segs)
        u = median(lambda: c.decompress(payload, ctx))
        rows.append({"method": m, "compress_GBps": nbytes / t / 1e9, "decompress_GBps": nbytes / u / 1e9,
                     "payload_bytes": sum(p.numel() * p.element_size() for p in payload)})
    for row in rows:
        row["compress_vs_memcpy"] = row["compress_GBps"] / memcpy
        row["decompress_vs_memcpy"] = row["decompress_GBps"] / memcpy
        row["ratio"] = nbytes / row["payload_bytes"]
    return rows


def format_compress(rows: list[dict]) -> str:
    lines = [f"{'method':>12} {'payload(B)':>11} {'ratio':>7} {'compress GB/s':>14} {'vs memcpy':>10} "
             f"{'decompress GB/s':>16} {'vs memcpy':>10}"]
    for r in rows:
        lines.append(f"{r['method']:>12} {r['payload_bytes']:>11} {r['ratio']:>7.1f} "
                     f"{r['compress_GBps']:>14.2f} {r['compress_vs_memcpy']:>10.2f} "
                     f"{r['decompress_GBps']:>16.2f} {r['decompress_vs_memcpy']:>10.2f}")
    return "\n".join(lines)
