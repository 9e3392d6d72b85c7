"""Benchmarks that measure lowcomm beside vendor MPI, Horovod and torch.distributed (gloo) in
one run, on the same buffers, and print the figures side by side.

Timing: every iteration starts after a barrier; its time is the slowest rank's; a row reports
the median over iterations (robust on a shared, oversubscribed machine). Bandwidths follow
nccl-tests: ``algbw = bytes / time``, ``busbw = algbw · 2(K-1)/K`` for all-reduce.
"""
from __future__ import annotations

import dataclasses
import socket
import statistics
import time
import typing
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch

from ..comm.collectives import ALGORITHM_NAMES, ALGORITHMS, allreduce_, choose
from ..comm.comm import Comm
from ..comm.ledger import Ledger, busbw_factor
from ..comm.watchdog import default_timeout_s
from .split_step import STEP_SPLIT, split_row

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
BASELINES = ("horovod", "gloo")
#: the memory-bandwidth floor of ``bench allreduce``: every rank at once writes the result
#: (``size`` bytes) from a buffer that already holds it -- one memcpy, the least any all-reduce
#: must do after reading its inputs; ``vs memcpy`` = its time over an algorithm's
MEMCPY = "memcpy"
#: ``shm`` on a buffer registered with the communicator (:meth:`Comm.shared_tensor`): the
#: ranks' inputs already lie in the node's shared window, nothing is staged
REGISTERED = "shm-registered"


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


#: gloo process groups of finished benchmark windows, kept alive to the end (see baseline())
_RETIRED_GROUPS: list = []


@contextmanager
def baseline(name: str, comm: Comm):
    """Start Horovod (``horovod``) or a gloo process group (``gloo``, ``ddp-gloo*``) for one
    benchmark window, yield its module, and shut it down after: their polling threads would
    otherwise slow every later row on a shared, oversubscribed machine. Others yield None."""
    if name == "horovod":
        from ..strategies.sync.horovod import init
        hvd = init(comm)
        try:
            yield hvd
        finally:
            hvd.shutdown()
    elif name == "gloo" or name.startswith("ddp-gloo"):
        dist = init_gloo(comm)
        try:
            yield dist
        finally:
            # The group object outlives the window, to the end of the process (_RETIRED_GROUPS):
            # whoever drops its last reference runs its destructor, which joins gloo's worker
            # threads. Dropped in a worker (a finished work item's Python callback closes over
            # the group, e.g. in torch's PowerSGD hook) the join is of itself: "Resource
            # deadlock avoided", abort (seen once in CI); dropped by the main thread with the
            # GIL held while a worker needs the GIL to free a work item: a deadlock
            # (pytorch/pytorch#56297). Kept here, it goes at exit, its workers long idle.
            _RETIRED_GROUPS.append(dist.group.WORLD)
            dist.destroy_process_group()
    else:
        yield None


@contextmanager
def reducer(name: str, comm: Comm):
    """Yield a callable summing a float32 CPU tensor in place over all ranks with ``name``
    (``auto``: with the topology's communicators when ``$LOWCOMM_TOPOLOGY`` names one)."""
    _check_known(name, [*ALGORITHM_NAMES, *BASELINES])
    with baseline(name, comm) as lib:
        if name == "horovod":
            yield lambda t: lib.allreduce_(t, op=lib.Sum, name="bench")
        elif name == "gloo":
            yield lambda t: lib.all_reduce(t)
        elif name == "hierarchical" or (name == "auto" and _topology_given()):
            from ..comm.topology import Topology     # the topology's communicators, built once
            levels = Topology.from_env(comm).comms(comm)

            def fn(t):
                return allreduce_(t, comm, name, levels=levels)
            fn.levels = levels
            yield fn
        else:
            yield lambda t: allreduce_(t, comm, name)


def _topology_given() -> bool:
    import os
    return bool(os.environ.get("LOWCOMM_TOPOLOGY"))


def _slowest(ctl: Comm, seconds: float) -> float:
    """The largest of the ranks' times (control plane, not charged to any method)."""
    return max(ctl.allgather_object(seconds))


def bench_allreduce(comm: Comm, sizes: list[int], algorithms: list[str], iters: int = 20,
                    warmup: int = 3) -> list[dict]:
    """Time each algorithm on each float32 size; count wrong elements against the exact sum.

    lowcomm's algorithms (``auto`` included) take turns iteration by iteration (the order
    rotating), so a load that comes and goes on a shared machine falls on all of them alike
    and their ratios hold; Horovod and gloo run in windows of their own (their threads would
    slow the others)."""
    ctl = comm.dup(Ledger(), "control")
    bench = comm.dup(Ledger())
    bench.validate = False
    for alg in algorithms:   # fail on a bad name before measuring anything
        _check_known(alg, [*ALGORITHM_NAMES, *BASELINES, MEMCPY, REGISTERED])
    own = [a for a in algorithms if a not in BASELINES]   # memcpy takes turns with them
    rows = []
    with ExitStack() as stack:
        fns = {a: MEMCPY if a == MEMCPY else
               stack.enter_context(reducer("shm" if a == REGISTERED else a, bench)) for a in own}
        for size in sizes:
            rows += _time_size(ctl, bench, fns, size, iters, warmup)
    for alg in [a for a in algorithms if a in BASELINES]:
        with reducer(alg, bench) as fn:
            for size in sizes:
                rows += _time_size(ctl, bench, {alg: fn}, size, iters, warmup)
    return sorted(rows, key=lambda row: (row["size"], algorithms.index(row["algorithm"])))


def _time_size(ctl: Comm, bench: Comm, fns: dict, size: int, iters: int, warmup: int) -> list[dict]:
    """One row per algorithm in ``fns`` at ``size`` bytes, the algorithms taking turns."""
    K, n = bench.size, size // 4
    base = (torch.arange(n, dtype=torch.float32) % 7) + bench.rank      # exact in float32
    expected = (torch.arange(n, dtype=torch.float32) % 7) * K + K * (K - 1) / 2
    bufs = {a: bench.shared_tensor(n) if a == REGISTERED else torch.empty(n, dtype=torch.float32)
            for a in fns}
    times: dict[str, list[float]] = {a: [] for a in fns}
    wrong = dict.fromkeys(fns, 0)
    names = list(fns)
    for i in range(warmup + iters):
        for alg in names[i % len(names):] + names[:i % len(names)]:
            buf = bufs[alg]
            buf.copy_(base)
            ctl.barrier()
            fn = (lambda b: b.copy_(expected)) if fns[alg] == MEMCPY else fns[alg]
            t0 = time.perf_counter()
            fn(buf)
            dt = _slowest(ctl, time.perf_counter() - t0)
            if i >= warmup:
                times[alg].append(dt)
            # checked after every call, outside the timed region: a race (shm's double
            # buffering, a segment reused too early) may show in one call of many
            wrong[alg] = max(wrong[alg], int((buf != expected).sum()))
    rows = []
    for alg in names:
        t = statistics.median(times[alg])
        algbw = size / t / 1e9 if t > 0 else 0.0
        row = {"size": size, "count": n, "dtype": "float32", "algorithm": alg,
               "ranks": K, "time_us": t * 1e6, "algbw_GBps": algbw,
               "busbw_GBps": algbw * busbw_factor("allreduce", K), "wrong": wrong[alg]}
        if alg == "auto":
            row["chose"] = choose(bench, size, getattr(fns[alg], "levels", None))
        rows.append(row)
    return rows


def format_allreduce(rows: list[dict]) -> str:
    """An nccl-tests style table with each row's busbw as a ratio of vendor MPI's and its time
    as a fraction of the memory-bandwidth floor's (``vs memcpy``: the memcpy row's time over
    this row's, 1 = the floor); an ``auto`` row also says what it ran and ``best/auto``: the
    fastest other lowcomm row's time (of the same size, same run) over auto's (>= 1: auto was at
    least as fast)."""
    ref = {r["size"]: r["busbw_GBps"] for r in rows if r["algorithm"] == "mpi"}
    floor = {r["size"]: r["time_us"] for r in rows if r["algorithm"] == MEMCPY}
    best = {}
    for r in rows:
        if r["algorithm"] in ALGORITHMS:
            best[r["size"]] = min(best.get(r["size"], float("inf")), r["time_us"])
    lines = [f"{'size':>10} {'algorithm':>13} {'time(us)':>11} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'vs mpi':>7} {'vs memcpy':>10} {'#wrong':>7} {'best/auto':>10}"]
    for r in rows:
        ratio = f"{r['busbw_GBps'] / ref[r['size']]:.2f}" if ref.get(r["size"]) else "-"
        name = f"auto={r['chose']}" if "chose" in r else r["algorithm"]
        vs = f"{best[r['size']] / r['time_us']:.2f}" if "chose" in r and r["size"] in best else ""
        mem = f"{floor[r['size']] / r['time_us']:.2f}" if r["size"] in floor and r["time_us"] else "-"
        lines.append(f"{r['size']:>10} {name:>13} {r['time_us']:>11.1f} {r['algbw_GBps']:>12.3f} "
                     f"{r['busbw_GBps']:>12.3f} {ratio:>7} {mem:>10} {r['wrong']:>7} {vs:>10}")
    return "\n".join(lines)


def tune_allreduce(comm: Comm, sizes=None, iters: int = 10, warmup: int = 2,
                   path=None) -> tuple[list[dict], str]:
    """``lowcomm bench allreduce --tune``: time every candidate of ``auto`` at ``sizes``
    (default :data:`lowcomm.comm.tuning.TUNE_SIZES`) on this communicator (one node) and write the table
    :mod:`lowcomm.comm.tuning` reads (rank 0 writes; returns the rows and the path)."""
    import os
    import platform
    from pathlib import Path

    from ..comm.tuning import TUNE_SIZES, save_table, table_path
    if not comm.node_local():
        raise ValueError("--tune measures the ranks of one node; these ranks span several "
                         "(their links are the α–β model's business)")
    algs = ["mpi", "ring", "rabenseifner", "tree", "shm"] + (["hierarchical"] if _topology_given() else [])
    rows = bench_allreduce(comm, list(sizes or TUNE_SIZES), algs, iters, warmup)
    bad = [r for r in rows if r["wrong"]]
    if bad:
        raise RuntimeError(f"--tune: {bad[0]['algorithm']} gave {bad[0]['wrong']} wrong elements "
                           f"at {bad[0]['size']} bytes; no table written")
    target = Path(path) if path else table_path(comm.size)
    if comm.rank == 0:
        times: dict[int, dict[str, float]] = {}
        for r in rows:
            times.setdefault(r["size"], {})[r["algorithm"]] = round(r["time_us"], 1)
        save_table(target, comm.size, times, {
            "host": platform.node(), "iters": iters, "dtype": "float32",
            "loadavg": os.getloadavg(), "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "topology": os.environ.get("LOWCOMM_TOPOLOGY", "")})
    return rows, str(target)


#: compressed peers: lowcomm's ``syncdp-<c>`` beside torch DDP's communication hook ``ddp-gloo-<c>``
STEP_COMPRESSORS = ("fp16", "int8", "powersgd")
#: the compressors torch DDP has a hook of (none for int8: ``syncdp-int8`` has no DDP peer)
DDP_HOOKS = ("fp16", "powersgd")
#: PowerSGD's dense steps before compressing, in both implementations (torch needs >= 2 with
#: error feedback); the timed steps come after the warm-up, so all of them are compressed
STEP_POWERSGD_START = 2
#: ``local``: every rank steps on its own gradients, nothing sent -- the floor under every
#: data-parallel row (same model, batches and optimizer; only the communication is missing)
STEP_LOCAL = "local"
#: the sharded rows: their spec (ZeRO's buckets are SyncDP's ``bucket_mb``)
STEP_SHARDED = {"zero1": "zero1", "zero2": "zero2", "zero2-qgz": "zero2:qgz=int8,qwz=int8",
                "zero2-qgz4": "zero2:qgz=int4,qwz=int8"}
STEP_STRATEGIES = ("syncdp", *[f"syncdp-{a}" for a in ALGORITHMS], "horovod", "ddp-gloo",
                   *[f"syncdp-{c}" for c in STEP_COMPRESSORS], *[f"ddp-gloo-{c}" for c in DDP_HOOKS],
                   *STEP_SHARDED, *STEP_SPLIT, STEP_LOCAL)


def _ddp_hook(ddp, name: str, cfg) -> None:
    """torch's own communication hook for compressed peer ``name`` (``ddp-gloo-<c>``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    kind = name.rsplit("-", 1)[1]
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.compressor.approx_rank,
            start_powerSGD_iter=STEP_POWERSGD_START,
            min_compression_rate=cfg.compressor.min_compression_rate,
            use_error_feedback=True, warm_start=True, random_seed=cfg.compressor.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _step_compressor(name: str, cfg):
    """lowcomm's compressor for ``syncdp-<c>`` (the run's [compressor] keys, PowerSGD starting
    at :data:`STEP_POWERSGD_START` like torch's hook)."""
    import dataclasses

    from ..compress import build_compressor
    kind = name.split("-", 1)[1]
    return build_compressor(dataclasses.replace(cfg.compressor, name=kind, start_iter=STEP_POWERSGD_START))


def bench_step(comm: Comm, cfg, strategies: list[str], steps: int = 20, warmup: int = 5) -> list[dict]:
    """Median training-step time of ``cfg``'s model under each data-parallel implementation:
    lowcomm's SyncDP (``syncdp``: the configured algorithm, default ``auto``;
    ``syncdp-<algorithm>``; ``syncdp-fp16`` / ``syncdp-int8`` / ``syncdp-powersgd`` with
    lowcomm's compressor),
    Horovod, torch DDP over gloo (``ddp-gloo``; ``ddp-gloo-fp16`` / ``ddp-gloo-powersgd``
    with torch's ``fp16_compress_hook`` / ``powerSGD_hook``), and ``local`` (no communication:
    the compute floor). Same model, seed, batches and optimizer for every row; DDP's bucket
    size is SyncDP's ``bucket_mb``."""
    from ..strategies.sync.syncdp import SyncDPSettings
    from ..tasks import load_task

    ctl = comm.dup(Ledger(), "control")
    task = load_task(cfg.task.name)
    s = SyncDPSettings.from_options({k: v for k, v in cfg.strategy.items()
                                     if k in SyncDPSettings.fields()}, "strategy.")
    for name in strategies:   # fail on a bad name before measuring anything
        _check_known(name, STEP_STRATEGIES, "strategy")
    names = list(dict.fromkeys(strategies))
    # lowcomm's rows and the floor take turns step by step, so a load that comes and goes falls
    # on all of them alike and their ratios hold; torch DDP and Horovod run in windows of their
    # own (their threads would slow the others)
    together = [n for n in names if n == STEP_LOCAL or n.startswith("syncdp") or n in STEP_SHARDED
                or n in STEP_SPLIT]
    setup = _StepSetup(comm, ctl, task, cfg, s)
    rows = _time_rows(together, setup, warmup, steps) if together else {}
    for name in names:
        if name not in together:
            with baseline(name, comm):
                rows.update(_time_rows([name], setup, warmup, steps))
    return [rows[n] for n in names]


@dataclasses.dataclass
class _StepRow:
    """One row of :func:`bench_step` being timed: what a step calls and what it measured."""
    name: str
    params: int
    opt: object                                # the optimizer (a lowcomm method, or torch's)
    loss: object                               # batch -> loss
    close: object = None                       # called after the last step
    exposed: list | None = None                # SyncDP: the slowest rank's sync_s per step
    times: list = dataclasses.field(default_factory=list)
    run: object = None                         # batch -> forward and backward (default: loss)
    place: tuple | None = None                 # (index, count) of its batch (default: the rank's)
    extra: object = None                       # ctl -> fields the row adds after its last step

    def forward_backward(self, b) -> None:
        if self.run is not None:
            self.run(b)
        else:
            self.loss(b).backward()

    def result(self, ranks: int) -> dict:
        return {"strategy": self.name, "ranks": ranks, "params": self.params,
                "grad_MB": self.params * 4 / 1e6, "step_ms": statistics.median(self.times) * 1e3,
                "step_ms_mean": statistics.fmean(self.times) * 1e3,
                "sync_ms": statistics.median(self.exposed) * 1e3 if self.exposed else None}


class _StepSetup(typing.NamedTuple):
    """What every row of :func:`bench_step` shares: the ranks, a control communicator, the task,
    the run's config and SyncDP's settings of it."""
    comm: Comm
    ctl: Comm
    task: object
    cfg: object
    s: object


def _time_rows(names: list[str], setup: _StepSetup, warmup: int, steps: int) -> dict[str, dict]:
    """Rows ``names`` of :func:`bench_step`, each on its own model and optimizer (same seed),
    taking turns step by step (the order rotating); each step starts after a barrier and its
    time is the slowest rank's."""
    comm, ctl, task, cfg, s = setup
    rows = [_step_row(name, comm, task, cfg, s) for name in names]
    for step in range(1, warmup + steps + 1):
        k = step % len(rows)
        for row in rows[k:] + rows[:k]:
            b = task.batch(step, *(row.place or (ctl.rank, ctl.size)), cfg)
            ctl.barrier()
            t0 = time.perf_counter()
            row.opt.zero_grad()
            row.forward_backward(b)
            row.opt.step()
            dt = _slowest(ctl, time.perf_counter() - t0)
            if step > warmup:
                row.times.append(dt)
                if row.exposed is not None:
                    row.exposed.append(_slowest(ctl, row.opt.sync_s))
    out = {}
    for row in rows:
        if row.close is not None:
            row.close()
        out[row.name] = {**row.result(comm.size), **(row.extra(ctl) if row.extra else {})}
    return out


def _step_row(name: str, comm: Comm, task, cfg, s) -> _StepRow:
    """Row ``name`` of :func:`bench_step`, ready to step (a lowcomm method communicates on a
    duplicate of ``comm`` of its own)."""
    from ..run.schedule import build_optimizer
    from ..strategies.sync.syncdp import SyncDP
    if name in STEP_SPLIT:
        return split_row(name, comm.dup(Ledger()), task, cfg, _StepRow)
    torch.manual_seed(cfg.seed)
    model = task.model(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(cfg, model.parameters())
    if name.startswith("ddp-gloo"):
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, bucket_cap_mb=s.bucket_mb)
        if name != "ddp-gloo":
            _ddp_hook(ddp, name, cfg)
        return _StepRow(name, params, opt, lambda b: task.loss(ddp, b))
    if name == STEP_LOCAL:
        return _StepRow(name, params, opt, lambda b: task.loss(model, b))
    run = comm.dup(Ledger())
    run.validate = False
    wrapped = _step_wrapped(name, run, cfg, s, model, opt)
    return _StepRow(name, params, wrapped, lambda b: task.loss(model, b), wrapped.close,
                    [] if hasattr(wrapped, "sync_s") else None)


def _step_wrapped(name: str, run: Comm, cfg, s, model, opt):
    """The lowcomm method of row ``name``: Horovod, or SyncDP with the row's algorithm or
    compressor."""
    from ..strategies.sync.horovod import HorovodDP
    from ..strategies.sync.syncdp import SyncDP
    if name == "horovod":
        return HorovodDP(model, opt, run)
    if name in STEP_SHARDED:
        from ..run.registry import build
        return build(STEP_SHARDED[name], model, opt, run, bucket_mb=s.bucket_mb, overlap=s.overlap)
    compressed = name.split("-", 1)[-1] in STEP_COMPRESSORS
    algorithm = name.split("-", 1)[1] if name.startswith("syncdp-") and not compressed else s.algorithm
    levels = None
    if algorithm == "hierarchical":
        from ..comm.topology import Topology
        levels = Topology.from_env(run, cfg.topology).comms(run)
    return SyncDP(model, opt, run, algorithm=algorithm, bucket_mb=s.bucket_mb, overlap=s.overlap,
                  levels=levels, compressor=_step_compressor(name, cfg) if compressed else None)


def step_peer(name: str) -> str | None:
    """The torch DDP row a lowcomm row is compared with: ``syncdp``/``syncdp-<algorithm>`` and
    ``local`` -> ``ddp-gloo``, ``syncdp-<c>`` -> ``ddp-gloo-<c>`` for a compressor c torch has a
    hook of; others (``syncdp-int8``): None."""
    if name == STEP_LOCAL:
        return "ddp-gloo"
    if not name.startswith("syncdp"):
        return None
    kind = name.split("-", 1)[1] if "-" in name else ""
    if kind in STEP_COMPRESSORS:
        return f"ddp-gloo-{kind}" if kind in DDP_HOOKS else None
    return "ddp-gloo"


def format_step(rows: list[dict]) -> str:
    """Step times; ``vs syncdp``: this row over plain SyncDP's; ``ours/ddp``: a lowcomm row's
    median over its torch DDP peer's in the same run (< 1: ours is faster; on the ``local`` row
    the floor: no data-parallel step of this model can be below it); ``sync(ms)``: a
    SyncDP row's median wait in ``step()`` for the buckets backward did not finish (plus the
    copies into ``p.grad``): the communication left exposed; ``bubble``: a pipeline row's
    measured idle fraction, beside its schedule's formula."""
    ref = {r["strategy"]: r["step_ms"] for r in rows}
    base = ref.get("syncdp")
    lines = [f"{'strategy':>22} {'params':>10} {'step(ms) median':>16} {'mean':>8} {'vs syncdp':>10} "
             f"{'ours/ddp':>9} {'sync(ms)':>9} {'bubble (formula)':>17}"]
    for r in rows:
        ratio = f"{r['step_ms'] / base:.2f}" if base else "-"
        peer = step_peer(r["strategy"])
        vs = f"{r['step_ms'] / ref[peer]:.2f}" if peer in ref else ""
        sync = f"{r['sync_ms']:.1f}" if r.get("sync_ms") is not None else ""
        bubble = f"{r['pp_bubble']:.2f} ({r['pp_bubble_formula']:.2f})" if "pp_bubble" in r else ""
        lines.append(f"{r['strategy']:>22} {r['params']:>10} {r['step_ms']:>16.1f} "
                     f"{r['step_ms_mean']:>8.1f} {ratio:>10} {vs:>9} {sync:>9} {bubble:>17}")
    return "\n".join(lines)
