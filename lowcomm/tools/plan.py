"""``lowcomm plan``: which splits of a large GPT fit a device, and the compute utilisation they
model across datacenters — the model-parallel counterpart of ``lowcomm project`` (which
projects a measured run).

For a GPT shape (L layers of width d, sequence S, vocabulary V: P ≈ 12·L·d² + V·d parameters)
on devices of M GB and F FLOP/s, each composition TP × PP × DP inside a datacenter (ZeRO-1 over
the DP ranks) with DiLoCo between D datacenters is costed per training step of G sequences:

* memory per rank (Megatron-LM's mixed-precision Adam, Korthikanti et al. 2022): parameters and
  gradients in bf16 (2 + 2 bytes), fp32 master weights and Adam's moments (12 bytes) over the
  DP ranks, DiLoCo's fp32 anchor and outer momentum (8 bytes), all for P/(TP·PP) parameters;
  activations of one micro-batch (b = 1) per layer 34·S·d/TP bytes (sequence parallelism,
  selective recomputation), L layers of them in flight on the first stage under 1F1B;
* one step: M = G/(D·DP) micro-batches per pipeline, each stage's forward and backward
  6·(P/PP)·S/TP FLOPs at the device's F × ``efficiency`` plus TP's 4 all-reduces per layer
  (2(TP−1)/TP · 2·S·d bytes each) on the node's link, ``(M + PP − 1)`` of them (1F1B's bubble);
  PP's activations per micro-batch and boundary (2·S·d bytes each way) on the cluster's link,
  exposed where slower than a micro-batch's computation; DP's reduce-scatter and all-gather of
  the gradients (2·2(DP−1)/DP · 2 bytes per parameter of the rank);
* between datacenters: every H steps each rank's share of the pseudo-gradient, quantised to
  ``wan_bytes`` per parameter, all-reduced over the D datacenters (2(D−1)/D of it) through the
  datacenter's WAN link, which all its ranks share; blocking, or overlapped with the next H
  steps (streaming/eager DiLoCo: exposed only where longer than them).

Compute utilisation = the seconds a rank computes model FLOPs / the wall-clock seconds. Every
figure is a model: the assumptions are the settings printed with the table.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A GPT: ``layers`` blocks of width ``d`` (4·d MLP), ``seq`` positions, ``vocab`` tokens."""
    name: str
    layers: int
    d: int
    seq: int = 4096
    vocab: int = 50304

    @property
    def params(self) -> float:
        return 12 * self.layers * self.d ** 2 + self.vocab * self.d


SHAPES = {"10b": Shape("10B", 48, 4096), "70b": Shape("70B", 88, 8192)}


@dataclass(frozen=True)
class Setting:
    """What the model assumes (printed with every plan)."""
    memory_gb: float = 80.0          # per device
    flops: float = 989e12            # dense bf16 per device (an H100 SXM's)
    efficiency: float = 0.5          # of ``flops`` the kernels reach
    node_gbit: float = 3600.0        # the node's link (NVLink): TP inside a node
    cluster_gbit: float = 400.0      # per rank across nodes (InfiniBand): PP and DP
    wan_gbit: float = 1.0            # a datacenter's link to the others, shared by its ranks
    dcs: int = 3
    batch: int = 1536                # sequences per step, all datacenters together (6M tokens)
    period: int = 100                # DiLoCo's H
    wan_bytes: float = 1.0           # per parameter across datacenters (int8)
    headroom: float = 0.9            # of the device's memory usable


@dataclass(frozen=True)
class Split:
    tp: int
    pp: int
    dp: int          # data-parallel ranks inside a datacenter


def memory_gb(shape: Shape, sp: Split, st: Setting) -> float:
    """Bytes per rank (module docstring), in GB."""
    per_rank = shape.params / (sp.tp * sp.pp)
    state = per_rank * (2 + 2 + 12 / sp.dp + 8)
    activations = shape.layers * 34 * shape.seq * shape.d / sp.tp
    return (state + activations) / GB


def step_seconds(shape: Shape, sp: Split, st: Setting) -> tuple[float, float]:
    """(the step's wall-clock seconds inside a datacenter, of which computing model FLOPs)."""
    micro = st.batch / (st.dcs * sp.dp)
    flops = 6 * shape.params / sp.pp * shape.seq / sp.tp
    compute = flops / (st.flops * st.efficiency)
    act = 2 * shape.seq * shape.d
    tp = 4 * shape.layers / sp.pp * 2 * (sp.tp - 1) / sp.tp * act * 8 / (st.node_gbit * 1e9)
    pp = 2 * act * 8 / (st.cluster_gbit * 1e9) if sp.pp > 1 else 0.0
    per_micro = compute + tp + max(0.0, pp - compute)
    dp = 2 * 2 * (sp.dp - 1) / sp.dp * 2 * shape.params / (sp.tp * sp.pp) * 8 / \
        (st.cluster_gbit * 1e9)
    return (micro + sp.pp - 1) * per_micro + dp, micro * compute


def wan_seconds(shape: Shape, sp: Split, st: Setting) -> float:
    """One DiLoCo round between the datacenters through a datacenter's shared WAN link."""
    return 2 * (st.dcs - 1) / st.dcs * shape.params * st.wan_bytes * 8 / (st.wan_gbit * 1e9)


def splits(shape: Shape, ranks_per_dc: int, st: Setting):
    """Every TP (≤ 8, inside a node) × PP (dividing the layers) × DP that fills the datacenter
    and divides the batch."""
    for tp in (1, 2, 4, 8):
        for pp in (p for p in range(1, shape.layers + 1) if shape.layers % p == 0):
            if ranks_per_dc % (tp * pp):
                continue
            dp = ranks_per_dc // (tp * pp)
            if st.batch % (st.dcs * dp) == 0:
                yield Split(tp, pp, dp)


def plan(shape: Shape, ranks: int, st: Setting) -> dict:
    """The compositions of ``ranks`` (all datacenters) that fit, the best by utilisation with
    DiLoCo overlapped and blocking, and SyncDP's memory (TP = PP = 1)."""
    per_dc = ranks // st.dcs
    rows = []
    for sp in splits(shape, per_dc, st):
        mem = memory_gb(shape, sp, st)
        if mem > st.memory_gb * st.headroom:
            continue
        step, busy = step_seconds(shape, sp, st)
        wan = wan_seconds(shape, sp, st)
        period = st.period * step
        rows.append({"split": sp, "memory_gb": mem, "step_s": step,
                     "blocking": st.period * busy / (period + wan),
                     "overlapped": st.period * busy / (period + max(0.0, wan - period))})
    best = max(rows, key=lambda r: r["overlapped"], default=None)
    return {"shape": shape, "ranks": ranks, "fits": len(rows), "best": best,
            "syncdp_gb": memory_gb(shape, Split(1, 1, max(1, per_dc)), st)}


def table(shapes: list[Shape], ranks: list[int], st: Setting) -> str:
    lines = ["| shape | parameters | ranks (per datacenter) | SyncDP GB/rank | compositions that fit "
             "| best TP×PP×DP | GB/rank | step s | utilisation, DiLoCo overlapped | blocking |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for shape in shapes:
        for k in ranks:
            p = plan(shape, k, st)
            b = p["best"]
            head = (f"| {shape.name} | {shape.params / 1e9:.1f} B | {k} ({k // st.dcs}) | "
                    f"{p['syncdp_gb']:.0f} | {p['fits']} | ")
            if b is None:
                lines.append(head + "none | - | - | - | - |")
                continue
            s = b["split"]
            lines.append(head + f"{s.tp}×{s.pp}×{s.dp} | {b['memory_gb']:.1f} | "
                         f"{b['step_s']:.2f} | {b['overlapped']:.1%} | {b['blocking']:.1%} |")
    return "\n".join(lines)


def assumptions(st: Setting) -> str:
    return (f"{st.dcs} datacenters, each linked to the others at {st.wan_gbit:g} Gbit/s "
            f"(shared by its ranks); {st.memory_gb:g} GB devices ({st.headroom:.0%} usable), "
            f"{st.flops / 1e12:g} TFLOP/s at {st.efficiency:.0%}; TP on a {st.node_gbit:g} "
            f"Gbit/s node link, PP and DP at {st.cluster_gbit:g} Gbit/s per rank; {st.batch} "
            f"sequences per step; DiLoCo every {st.period} steps, {st.wan_bytes:g} byte(s) per "
            "parameter across; 1F1B, micro-batch 1, sequence parallelism and selective "
            "recomputation; no overlap inside a datacenter except PP's sends")


__all__ = ["SHAPES", "Setting", "Shape", "Split", "assumptions", "memory_gb", "plan",
           "step_seconds", "table", "wan_seconds"]
