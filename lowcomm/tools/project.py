"""``lowcomm project``: a measured run's seconds per step and bytes per rank, projected to K ranks.

From each method's ``summary.json`` (a comparison's folder, or one run's) the projection takes
what the run measured on K₀ ranks — its ledger (calls, bytes and op of every collective, rank
0's) and its computation's CPU seconds per step — and models one step on K ranks over a link of
latency α and bandwidth β (Hockney's α–β model, as :class:`~lowcomm.comm.ledger.Link`):

    seconds per step = compute + Σ over ops (calls per step) · (rounds(op, K) · α + bytes(op, K) / β)

Each op's message size S is read back from its bytes at K₀ and re-costed at K by the formula of
its algorithm (Thakur, Rabenseifner & Gropp 2005; bytes are what one rank sends):

=====================================  ============================  ==================
op                                     bytes per call at K           rounds per call
=====================================  ============================  ==================
``allreduce.ring``                     2(K−1)/K · S                  2(K−1)
``allreduce.mpi``, ``.rabenseifner``   2(K−1)/K · S                  2⌈log₂K⌉
``allreduce.tree``, ``.shm``           as measured per call          2⌈log₂K⌉
two-phase exchange (``alltoall.v``     (K−1)/K · S each              K−1 each
and ``allgather.v`` in pairs)
``allgather.v`` alone                  (K−1) · S (every rank's       K−1
                                       block to every other)
``allgather.blocks|ring|shm`` (ZeRO)  (K−1)/K · S                   K−1
``allgather``, ``check`` (small)       (K−1) · S                     ⌈log₂K⌉ (Bruck)
``reduce_scatter.*``                   (K−1)/K · S                   K−1
``bcast``                              S                             ⌈log₂K⌉
``send``, ``recv``, ``sendrecv``       as measured per call          1
=====================================  ============================  ==================

Assumptions, printed with every projection: every rank's traffic crosses the link (a flat world,
as the comparison's modelled column: an upper bound where a topology would keep most traffic
inside a datacenter; runs with per-level traffic are not projected); computation per step per
rank is what was measured (weak scaling: the same batch per rank) — or ``params``/``P₀`` times
it with ``--params P``, which also scales every message by ``P/P₀`` — or ``--step-compute-s``;
no overlap of communication with computation; point-to-point methods (gossip, the parameter
server) keep their measured messages per step (a fixed-degree graph, a fixed number of servers).

With a target eval loss (``--target``) the methods are ranked by modelled time to it:

1. steps to the target: the first step at which the method's measured eval loss reached it
   (linear between its evaluations; the final model's evaluation last);
2. time to the target = those steps × the projected seconds per step at K over the link;
3. methods that never reached it in their measured steps are listed after the ranked ones.

The steps come from the measured run as they are (its ranks, batch per rank, model, data): the
projection re-costs the communication, not the convergence, which changes with K and the model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..comm.ledger import Link, latency_rounds

#: the rank counts projected unless told otherwise
DEFAULT_RANKS = (8, 64, 512, 4096)

ASSUMPTIONS = ("every rank's traffic crosses the link (a flat world: an upper bound where a "
               "topology keeps traffic inside a datacenter); the computation per step per rank "
               "is the measured one (the same batch per rank), scaled by params/P₀ with --params "
               "or given by --step-compute-s; messages scale by params/P₀; no overlap of "
               "communication and computation; point-to-point traffic (gossip, parameter "
               "server) keeps its measured messages per step; the shape checks of comm.validate "
               "(small all-gathers, the 'check' rows) are included: comm.validate = false drops them")


@dataclass(frozen=True)
class Op:
    """One ledger row, per training step: ``calls`` and the message size ``size`` (bytes) that
    its algorithm's formula turns into bytes and rounds at any K."""
    op: str
    calls: float
    size: float
    kind: str

    def bytes_at(self, k: int) -> float:
        """Bytes one rank sends per call on ``k`` ranks."""
        if k <= 1 and self.kind not in ("fixed", "p2p"):
            return 0.0
        return {"allreduce": 2 * (k - 1) / k * self.size, "pair": (k - 1) / k * self.size,
                "gather": (k - 1) * self.size, "gather-small": (k - 1) * self.size,
                "bcast": self.size}.get(self.kind, self.size)

    def rounds_at(self, k: int) -> int:
        """Message rounds per call on ``k`` ranks: the ledger's rule (:func:`latency_rounds`),
        except a small all-gather (the vendor's Bruck algorithm: ⌈log₂K⌉ rounds)."""
        if self.kind == "gather-small":
            return max(1, (k - 1).bit_length()) if k > 1 else 0
        return latency_rounds(self.op, k)


def ops_of(summary: dict, scale: float = 1.0) -> list[Op]:
    """The per-step ops of a run's ``summary`` (its rank-0 ledger), message sizes times
    ``scale``; a ValueError where the run is one this projection does not model."""
    k0, steps = summary["ranks"], summary.get("steps_done", summary["steps"])
    rows = summary["ledger_rank0"]
    levels = {r["level"] for r in rows}
    if levels - {"world"}:
        raise ValueError(f"its traffic is on the levels {', '.join(sorted(levels))} of a "
                         "topology; the projection models one flat world of ranks")
    if k0 < 2:
        raise ValueError("it ran on one rank: there is no traffic to read message sizes from")
    paired = {r["op"] for r in rows} >= {"alltoall.v", "allgather.v"}
    out = []
    for r in rows:
        op, b = r["op"], r["bytes_sent"] / max(r["calls"], 1)
        family = op.split(".")[0]
        if op in ("allreduce.tree", "allreduce.shm"):
            kind, size = "fixed", b
        elif family == "allreduce":
            kind, size = "allreduce", b * k0 / (2 * (k0 - 1))
        elif op == "alltoall.v" or (op == "allgather.v" and paired) or family == "reduce_scatter" \
                or op in ("allgather.blocks", "allgather.ring", "allgather.shm"):   # ZeRO's blocks
            kind, size = "pair", b * k0 / (k0 - 1)
        elif op in ("allgather", "check"):
            kind, size = "gather-small", b / (k0 - 1)
        elif family in ("allgather", "alltoall"):
            kind, size = "gather", b / (k0 - 1)
        elif family == "bcast":
            kind, size = "bcast", b
        elif family in ("send", "recv", "sendrecv"):
            kind, size = "p2p", b
        else:
            raise ValueError(f"no projection for its op {op!r}")
        out.append(Op(op, r["calls"] / steps, size * scale, kind))
    return out


def project(summary: dict, ranks, links, params: float | None = None,
            step_compute_s: float | None = None) -> dict:
    """One method's projection: ``{"method", "compute_s", "rows": [{"ranks", "link",
    "seconds_per_step", "bytes_per_rank_per_step", "comm_share"}]}``."""
    steps = summary.get("steps_done", summary["steps"])
    scale = params / summary["params"] if params else 1.0
    compute = step_compute_s if step_compute_s is not None else \
        summary["compute_cpu_s"] / steps * scale
    if not (compute >= 0 and math.isfinite(compute)):
        raise ValueError(f"its compute_cpu_s is {summary.get('compute_cpu_s')!r}; rerun it")
    ops = ops_of(summary, scale)
    rows = []
    for link in links:
        for k in ranks:
            comm = sum(o.calls * link.traffic_seconds(o.rounds_at(k), o.bytes_at(k)) for o in ops)
            sent = sum(o.calls * o.bytes_at(k) for o in ops)
            rows.append({"ranks": k, "link": str(link), "seconds_per_step": compute + comm,
                         "bytes_per_rank_per_step": sent,
                         "comm_share": comm / (compute + comm) if compute + comm else 0.0})
    return {"method": summary["method"], "compute_s": compute, "rows": rows}


#: what a projection keeps of a run's summary (with its eval curve, in its --json file)
MEASURED_KEYS = ("method", "ranks", "steps", "steps_done", "params", "compute_cpu_s",
                 "eval_loss", "ledger_rank0")


def eval_curve(run: Path, summary: dict) -> list[tuple[int, float]]:
    """(step, eval loss) at every evaluation of a run (its metrics.jsonl), its final model's
    last."""
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    pts = [(ln["step"], ln["eval_loss"]) for ln in lines
           if math.isfinite(ln.get("eval_loss", math.nan))]
    end, final = summary.get("steps_done", summary["steps"]), summary.get("eval_loss")
    if final is not None and math.isfinite(final) and (not pts or pts[-1][0] <= end):
        pts.append((end, final))
    return pts


def _measured(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {**{k: s[k] for k in MEASURED_KEYS if k in s}, "curve": eval_curve(run, s)}


def summaries(folder: str | Path) -> dict[str, dict]:
    """Method name → summary with its eval curve (``"curve"``: (step, eval loss) pairs): a
    comparison's folder (its results.json's finished methods), one run's folder (its
    summary.json), or the JSON file an earlier projection wrote (``--json``), which keeps what
    it was projected from."""
    folder = Path(folder)
    if folder.is_file():
        try:
            measured = json.loads(folder.read_text()).get("measured")
        except (ValueError, AttributeError):
            measured = None
        if not measured:
            raise FileNotFoundError(f"{folder} is not a projection's JSON file with its "
                                    "measurements (lowcomm project ... --json FILE writes one)")
        return measured
    if (folder / "summary.json").exists():
        s = _measured(folder)
        return {s["method"]: s}
    if not (folder / "results.json").exists():
        raise FileNotFoundError(f"{folder} holds neither a run's summary.json nor a comparison's "
                                "results.json")
    out = {}
    for r in json.loads((folder / "results.json").read_text()):
        path = folder / r["method"] / "summary.json"
        if r.get("status") == "ok" and path.exists():
            out[r["method"]] = _measured(folder / r["method"])
    if not out:
        raise FileNotFoundError(f"{folder}/results.json lists no finished method")
    return out


def projections(folder, ranks=DEFAULT_RANKS, links=(Link(25, 100),), params=None,
                step_compute_s=None, target=None) -> tuple[list[dict], dict[str, str]]:
    """Every method of ``folder`` projected; returns (projections, method → why it was not).
    With ``target`` (an eval loss) each projection also has ``steps_to_target``: the step at
    which its measured eval loss first reached it (linear between evaluations; None if never)."""
    from .compare_report import time_to_target
    done, skipped = [], {}
    for name, s in summaries(folder).items():
        try:
            p = {**project(s, ranks, links, params, step_compute_s), "name": name,
                 "measured_ranks": s["ranks"], "params": params or s["params"]}
        except ValueError as e:
            skipped[name] = str(e)
            continue
        if target is not None:
            curve = [tuple(x) for x in s.get("curve", [])]
            p["steps_to_target"] = time_to_target(curve, target)
            p["measured_steps"] = s.get("steps_done", s["steps"])
            p["best_eval_loss"] = min((e for _, e in curve), default=None)
        done.append(p)
    return done, skipped


TARGET_ASSUMPTIONS = ("the steps a method needs to reach the target are those it needed in the "
                      "measured run (its ranks, batch per rank, model and data): they are not "
                      "re-modelled for another rank count or model size, where they change; "
                      "time to target = those steps × the projected seconds per step")


def ranking(done: list[dict], ranks, links, target: float) -> str:
    """One Markdown table per link and rank count: the methods by modelled time to eval loss
    ``target`` (steps to it as measured × projected seconds per step), then those that never
    reached it in their measured steps, and the assumptions."""
    parts = []
    for link in links:
        for k in ranks:
            rows, never = [], []
            for p in done:
                r = next(r for r in p["rows"] if r["ranks"] == k and r["link"] == str(link))
                if p["steps_to_target"] is None:
                    never.append(p)
                else:
                    rows.append((p["steps_to_target"] * r["seconds_per_step"], p, r))
            lines = ["| # | method | steps to target (measured) | s/step | comm share | "
                     "time to target | sent per rank to target |", "|---" * 7 + "|"]
            for i, (t, p, r) in enumerate(sorted(rows, key=lambda x: x[0]), 1):
                lines.append(f"| {i} | {p['name']} | {p['steps_to_target']:.0f} | "
                             f"{r['seconds_per_step']:.3g} | {r['comm_share']:.0%} | "
                             f"{_duration(t)} | {_size(p['steps_to_target'] * r['bytes_per_rank_per_step'])} |")
            for p in never:
                best = p["best_eval_loss"]
                lines.append(f"| – | {p['name']} | not reached in {p['measured_steps']} "
                             f"(best {best:.4g}) | | | | |" if best is not None else
                             f"| – | {p['name']} | no evaluation measured | | | | |")
            parts.append(f"**K = {k}, {link}**: time to eval loss {target:g}\n\n" + "\n".join(lines))
    parts.append("assumptions: " + TARGET_ASSUMPTIONS + "; " + ASSUMPTIONS + ".")
    return "\n\n".join(parts)


def _duration(seconds: float) -> str:
    for unit, f in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= f:
            return f"{seconds / f:.3g} {unit}"
    return f"{seconds:.3g} s"


#: model shapes whose memory per rank every projection prints (parameters)
MEMORY_SHAPES = (1e9, 10e9)


def state_bytes_per_param(method: str, k: int) -> float:
    """Bytes per parameter one of ``k`` ranks holds under ``method`` (a summary's method name,
    e.g. ``zero2(auto)``), training with Adam in float32: weight 4, gradient 4, two moments 8;
    ZeRO-1 shards the moments, ZeRO-2 the gradients too, FSDP everything; an outer loop with an
    outer optimizer (DiLoCo's family) adds its outer copy and momentum, 8 more. Activations and
    buffers are not counted."""
    name = method.split("(")[0].split("+")[0]
    return {"zero1": 8 + 8 / k, "zero2": 4 + 12 / k, "fsdp": 16 / k,
            "diloco": 24.0, "streaming-diloco": 24.0, "sparta-diloco": 24.0}.get(name, 16.0)


def memory_table(done: list[dict], ranks) -> str:
    """Parameter, gradient and Adam-state bytes per rank of each projected method for the
    :data:`MEMORY_SHAPES`, at each K."""
    head = "| method | model | " + " | ".join(f"K={k}" for k in ranks) + " |"
    rows = [head, "|---" * (len(ranks) + 2) + "|"]
    for p in done:
        for n in MEMORY_SHAPES:
            cells = [f"{state_bytes_per_param(p['method'], k) * n / 2**30:.3g} GiB" for k in ranks]
            rows.append(f"| {p['name']} | {n / 1e9:g} B | " + " | ".join(cells) + " |")
    return ("memory per rank: parameters, gradients and Adam moments in float32 (activations "
            "not counted)\n\n" + "\n".join(rows))


def _size(b: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


def table(done: list[dict], skipped: dict[str, str], ranks, links) -> str:
    """One Markdown table per link: methods × rank counts, seconds per step and bytes per rank
    per step, then the methods not projected and the assumptions."""
    parts = []
    for link in links:
        head = "| method | compute s/step | " + " | ".join(f"K={k}" for k in ranks) + " |"
        rows = [head, "|---" * (len(ranks) + 2) + "|"]
        for p in sorted(done, key=lambda p: next(r["seconds_per_step"] for r in p["rows"]
                                                  if r["link"] == str(link) and r["ranks"] == ranks[-1])):
            cells = [f"{r['seconds_per_step']:.3g} s, {_size(r['bytes_per_rank_per_step'])}"
                     for r in p["rows"] if r["link"] == str(link)]
            rows.append(f"| {p['name']} | {p['compute_s']:.3g} | " + " | ".join(cells) + " |")
        parts.append(f"**{link}**: seconds per step, bytes sent per rank per step\n\n" + "\n".join(rows))
    if done:
        parts.append(memory_table(done, ranks))
    if skipped:
        parts.append("not projected: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()))
    parts.append("assumptions: " + ASSUMPTIONS + ".")
    return "\n\n".join(parts)
