"""``lowcomm bench memory``: parameter, gradient, optimizer-state and activation bytes per rank and
the peak,
for each method at K ranks, beside the ideal 1/K of SyncDP's; and the largest GPT shape each
method trains under a per-rank memory cap.

Each (method, K) runs in its own ``mpirun`` (a process's peak resident set only grows, so
methods measured in one process would hide each other's peaks): one forward, backward and step
of the run's task (activations: the peak of the tensors autograd saves,
:func:`lowcomm.run.memory.saved_activations`), then :func:`lowcomm.run.memory.measure` on every rank (the rows report the
largest rank's). A method is a spec (``zero2:qgz=int8``) or ``POLICY@TOPOLOGY`` for an outer
loop over a sharded level, e.g. ``dc=diloco:period=50;rank=zero2@dc:2,rank:2``, or data parallelism
around a split model, e.g. ``node=syncdp;rank=pp@node:2,rank:2``. A method that splits the model
builds it as ``lowcomm train`` does (``pp``: each rank its stages alone, from the meta device).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..comm.comm import Comm
from ..errors import LowcommError

LOCAL = Path(__file__).resolve().parents[2] / "launchers" / "local.sh"
KINDS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def _device(comm: Comm, name: str):
    """``cpu``, or ``cuda``: this rank's GPU (rank modulo the GPUs this node shows), an error
    naming the rank where torch sees none."""
    import torch
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LowcommError(f"bench memory --device cuda: torch sees no GPU on rank {comm.rank} "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _to(batch, dev):
    """The task's batch (a tensor, or a tuple/list/dict of them) on ``dev``."""
    if isinstance(batch, dict):
        return {k: _to(v, dev) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, dev) for v in batch)
    return batch.to(dev) if hasattr(batch, "to") else batch


def method_config(cfg, method: str):
    """``cfg`` running ``method``: a spec as ``strategy.*`` keys, or ``LEVEL=SPEC;...@TOPOLOGY``
    as the policy and topology (the run's other keys kept)."""
    import dataclasses

    from ..run.registry import parse_spec
    if "@" in method:
        levels, topology = method.split("@", 1)
        spec = dict(item.split("=", 1) for item in levels.split(";"))
        return dataclasses.replace(cfg, policy=spec, topology=topology, strategy={})
    m, opts = parse_spec(method, "--method")
    return dataclasses.replace(cfg, strategy={"name": m.name, **opts})


def measure_one(comm: Comm, cfg, method: str, device: str = "cpu") -> dict:
    """One step of ``cfg``'s task under ``method`` on ``comm`` with the model and batch on
    ``device`` (``cpu`` or ``cuda``); the largest rank's memory. The model is built as
    ``lowcomm train`` builds it (a pipeline's stages alone, on the meta device first)."""
    import torch

    from ..run.api import topology_comms
    from ..run.loop import build_model
    from ..run.memory import check_cap, measure, saved_activations
    from ..run.optimizers import build_optimizer
    from ..run.registry import build_strategy
    from ..strategies.method import Context
    from ..tasks import load_task
    task = load_task(cfg.task.name)
    run = method_config(cfg, method)
    torch.manual_seed(cfg.seed)
    dev = _device(comm, device)
    model = build_model(task, run, dev)
    params = sum(p.numel() for p in model.parameters())
    inner = build_optimizer(cfg, model.parameters())
    ctx = Context(levels=topology_comms(run, comm), criterion=task.criterion_fn, split=task.split_fn)
    opt = build_strategy(run, model, inner, comm, ctx)
    batch = _to(task.batch(1, comm.rank, comm.size, cfg), dev)
    opt.zero_grad()
    with saved_activations(model) as act:
        opt.forward_backward(task.loss, batch)      # (a method that splits the model runs it)
    opt.step()
    mem = dict(measure(model, opt), activation_bytes=act.peak)
    every = comm.allgather_object(mem)
    opt.close()
    row = {"method": method, "ranks": comm.size,
           **{k: max(m[k] for m in every) for k in (*KINDS, "activation_bytes", "peak_bytes")},
           "peak_of": mem["peak_of"], "params": params}
    check_cap(dict(mem, peak_bytes=row["peak_bytes"]), cfg.max_memory_gib, comm.rank, 1)
    return row


@dataclass(frozen=True)
class Rows:
    """What every row's run is given: the ``config`` file and its ``overrides``, the seconds a
    row may take, the ``device`` its model and batches live on."""
    config: str | None
    overrides: tuple[str, ...]
    timeout_s: float
    device: str = "cpu"


def run_one(rows: Rows, np: int, method: str, extra: tuple[str, ...] = ()) -> dict:
    """``lowcomm bench memory --one METHOD`` on ``np`` local ranks (``extra``: overrides after
    ``rows``'): its row, or ``{"error"}``."""
    cmd = [str(LOCAL), "-n", str(np), sys.executable, "-m", "lowcomm.cli", "bench", "memory",
           "--one", method, "--device", rows.device, *(["--config", rows.config] if rows.config else []),
           *[a for o in (*rows.overrides, *extra) for a in ("--set", o)]]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=rows.timeout_s)
    except subprocess.TimeoutExpired:
        return {"method": method, "ranks": np, "error": f"no result in {rows.timeout_s:g} s"}
    found = [json.loads(line[len("ROW "):]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if p.returncode != 0 or not found:
        last = [line for line in (p.stderr + p.stdout).splitlines() if "Error" in line]
        return {"method": method, "ranks": np, "error": last[-1].strip() if last else f"exit {p.returncode}"}
    return found[0]


def table(launch: Rows, methods_at, ranks: list[int]) -> list[dict]:
    """The methods ``methods_at(K)`` at every K; each row gets ``total_bytes`` and
    ``ideal_bytes``: the first row's parameter + gradient + optimizer-state bytes at the
    smallest K, over K."""
    rows = [run_one(launch, K, m) for K in ranks for m in methods_at(K)]
    base = next((r for r in rows if r.get("ranks") == min(ranks) and "error" not in r), None)
    if base is not None:
        full = sum(base[k] for k in KINDS)
        for r in rows:
            if "error" not in r:
                r["total_bytes"] = sum(r[k] for k in KINDS)
                r["ideal_bytes"] = full / r["ranks"]
    return rows


def largest(rows: Rows, methods: list[str], np: int, shapes: list[str], max_gib: float) -> list[dict]:
    """For each method, the shapes (``D_MODEL:N_LAYERS``, smallest first) that train one step
    on ``np`` ranks under ``max_gib`` per rank; the largest that did, the first refused, and
    every row tried (``tried``)."""
    if not max_gib:
        raise LowcommError("--max-memory-gib is needed to find the largest shape under a cap")
    out = []
    for m in methods:
        fits, refused, tried = None, None, []
        for shape in shapes:
            d, layers = shape.split(":")
            heads = max(1, int(d) // 64)
            r = run_one(rows, np, m, (f"model.d_model={d}", f"model.n_layers={layers}",
                                      f"model.n_heads={heads}", f"max_memory_gib={max_gib}"))
            tried.append(dict(r, shape=shape))
            if "error" in r:
                refused = {"shape": shape, "error": r["error"]}
                break
            fits = dict(r, shape=shape)
        out.append({"method": m, "ranks": np, "max_memory_gib": max_gib,
                    "largest": fits, "refused": refused, "tried": tried})
    return out


def _gib(b) -> str:
    return f"{b / (1 << 30):.3f}"


def format_table(rows: list[dict]) -> str:
    lines = ["| method | K | params GiB | grads GiB | optimizer GiB | total GiB | ideal 1/K GiB "
             "| activations GiB | peak GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['ranks']} | failed: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['method']} | {r['ranks']} | {_gib(r['param_bytes'])} | {_gib(r['grad_bytes'])} "
                     f"| {_gib(r['optimizer_state_bytes'])} | {_gib(r['total_bytes'])} "
                     f"| {_gib(r['ideal_bytes'])} | {_gib(r['activation_bytes'])} "
                     f"| {_gib(r['peak_bytes'])} ({r['peak_of']}) |")
    return "\n".join(lines)


def format_largest(rows: list[dict]) -> str:
    lines = ["| method | K | cap GiB | largest shape (d_model:layers) | parameters | peak GiB | first refused |",
             "|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        f = r["largest"]
        lines.append(f"| {r['method']} | {r['ranks']} | {r['max_memory_gib']:g} | "
                     f"{f['shape'] if f else 'none'} | {f['params'] if f else 0:,} | "
                     f"{_gib(f['peak_bytes']) if f else '-'} | "
                     f"{r['refused']['shape'] if r['refused'] else '-'} |")
    return "\n".join(lines)


__all__ = ["Rows", "format_largest", "format_table", "largest", "measure_one", "run_one", "table"]
