"""SparseLoCo: DiLoCo whose pseudo-gradient is sent as a chunked top-k in 2 bits, an error-feedback
accumulator in place of the outer momentum."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import allreduce_
from ...comm.comm import Comm
from ...compress.compressor import Compressor
from ...compress.demo import Chunks, QuantizedChunkTopK
from ...compress.error_feedback import ErrorFeedback
from ...errors import ConfigError
from ..method import Method
from ..chunks import chunk_buckets, decoded_memories
from .fragment import Fragment
from .loop import OuterLoop, OuterSettings, check_run
from .route import hand_on


@dataclass
class SparseLoCoSettings(OuterSettings):
    """``[strategy]`` keys of ``sparseloco`` (the spec ``sparseloco:period=15,topk=64``): the outer
    loop's keys, the chunks, k, the accumulator's decay β and the outer learning rate α."""
    period: int = 15               # H inner steps per outer step
    chunk: int = 64                # tile side s: a matrix in s×s tiles (4096 elements), else runs of s
    topk: int = 64                 # k values sent per chunk (64 of 4096: 1.56 % of a matrix)
    decay: float = 0.95            # β: the error-feedback accumulator's decay
    outer_lr: float = 1.0          # α: θ ← θ − α·Δ
    aggregate_refusal = ("sparseloco reduces its chunked top-k payloads per bucket itself; a "
                         "robust rule over them is not built: use diloco with compressor = "
                         "\"topk\" (or int8), whose payloads each member decodes")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.at_least(prefix, "chunk", 1)
        self.at_least(prefix, "topk", 1)
        self.within(prefix, "decay", 0, 1)
        self.within(prefix, "outer_lr", 0, float("inf"), low_open=True)
        if self.compressor != "none":
            raise ConfigError.at(prefix, "compressor", "sparseloco compresses its pseudo-gradient "
                                 "itself (chunked top-k, 2-bit values); leave compressor = "
                                 f"\"none\", got {self.compressor!r}")


class SparseLoCo(OuterLoop):
    """SparseLoCo (Sarfi, Thérien, Lidin & Belilovsky 2025, arXiv 2508.15706, Algorithm 1):
    DiLoCo whose outer momentum is replaced by each rank's error-feedback accumulator, which
    sends only the top-k of every chunk, in 2 bits.

    Update, with K ranks, H = ``period``, θ the outer parameters (a float32 CPU copy, equal on
    every rank), e_k rank k's accumulator (zero at first), per outer step:

      1. each rank takes H inner steps of the wrapped optimizer (AdamW in the paper) from θ:
         θ_k ← InnerOpt_H(θ);
      2. pseudo-gradient Δ_k = θ − θ_k;
      3. accumulate: e_k ← β e_k + Δ_k (β = ``decay``);
      4. select and quantise: every parameter is cut into chunks (a matrix into s×s tiles,
         s = ``chunk``; else runs of s: :class:`~lowcomm.compress.demo.Chunks`), and of every
         chunk the k = ``topk`` entries of largest magnitude in e_k are kept; their values are quantised to
         2 bits (the authors' statistical quantiser), their indices sent in ⌈log2(chunk size)⌉
         bits: Δ̂_k = Q(TopK(e_k)) (:class:`~lowcomm.compress.demo.QuantizedChunkTopK`);
      5. e_k ← e_k − Δ̂_k: what was sent leaves the accumulator;
      6. Δ̂ = (1/K) Σ_k Δ̂_k, every rank's (values, indices) all-gathered and summed;
      7. θ ← θ − α Δ̂ (α = ``outer_lr``), θ_k ← θ on every rank; go to 1.

    Steps 3–5 are :class:`~lowcomm.compress.error_feedback.ErrorFeedback` around the codec, its
    memory scaled by β before each outer step (as DeMo's momentum). There is no other outer
    state: with β = 0, k = s² and no quantisation this would be DiLoCo with outer SGD (lr α, no
    momentum). Bytes per rank and outer step: an all-gather of P = Σ_chunks (k·2 bits + k·
    ⌈log2 row⌉ bits) (+ 20 bytes of quantiser table per 2048 values), i.e. ``(K − 1)·P``
    (:meth:`payload_bytes` is P). The all-gather grows like K − 1, as in the paper's setting,
    where every peer fetches every other's sparse pseudo-gradient.

    Args:
        model, optimizer: the user's torch objects (``optimizer`` is the inner optimizer).
        comm: communicator (default: world).
        settings: a validated :class:`SparseLoCoSettings`; otherwise its fields as keyword
            arguments (``period``, ``chunk``, ``topk``, ``decay``, ``outer_lr``, ``warmup_steps``,
            ...), checked once.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        opt = SparseLoCo(model, inner, period=15, topk=64, chunk=64)
        opt = lowcomm.build("sparseloco:period=15", model, inner)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "sparseloco"
    Settings = SparseLoCoSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, **arguments):
        super().__init__(model, optimizer, comm, **arguments)
        s = self.settings
        if self.route.sharded:
            raise ConfigError("policy", "sparseloco over a level that shards the optimizer "
                              f"state ({self._inner.name}): its chunks are whole tensors' tiles; "
                              "use syncdp, tp or pp below")
        self.topk, self.chunk, self.decay, self.outer_lr = s.topk, s.chunk, s.decay, s.outer_lr
        (fragment,) = self.fragments
        self.outer = fragment.pack()                 # θ
        items = [(t.row, b - a, name, t, a, b) for name, p, a, b in fragment.members
                 for t in [Chunks(p.shape, s.chunk)]]          # members: name, chunks, a, b, lo, hi
        self.buckets = chunk_buckets(items, "sparseloco", lambda row: Compressor(
            ErrorFeedback(QuantizedChunkTopK(row, s.topk, 2, packed_indices=True)), "allgather"))

    def _warmup_done(self) -> None:
        self.outer.copy_(self.fragments[0].pack())

    def _outgoing(self, f: Fragment, local: torch.Tensor) -> torch.Tensor:
        return torch.sub(self.outer, local, out=local)          # step 2: Δ_k = θ − θ_k

    def _reduce(self, f: Fragment, flat: torch.Tensor, t: int) -> tuple[torch.Tensor, list[dict]]:
        """Steps 3–6 along the route (inside a per-level policy: by the units' leaders, or by
        rank i of every unit where the level below splits the model, each on its own part)."""
        route = self.route
        route.red.ledger.reset()
        inside = None if route.local is not None else route.inside
        if inside is not None and route.average_inside:
            flat = allreduce_(flat, inside, route.algorithm, op="avg")
        avg = flat
        if inside is None or inside.rank == 0:
            avg = self._exchange(flat, route.red if route.leaders is None else route.leaders)
        return hand_on(inside, avg, flat), route.red.ledger.rows()

    def _exchange(self, flat: torch.Tensor, across: Comm) -> torch.Tensor:
        """Steps 3–6 over ``across``, bucket by bucket (chunks of one size travel together)."""
        avg = torch.empty_like(flat)
        for b in self.buckets:
            x = torch.cat([t.encode(flat[a:z]).reshape(-1) for _, t, a, z, _, _ in b.members])
            b.decay_(self.decay)                                 # step 3: e ← βe (then + Δ)
            got = b.comp.reduce(x, b.key, across, b.segments)
            for _, t, a, z, lo, hi in b.members:
                avg[a:z] = t.decode(got[lo:hi]).reshape(-1)
        return avg

    def _apply(self, f: Fragment, avg: torch.Tensor) -> torch.Tensor:
        self.outer.sub_(avg.to(self.outer.dtype), alpha=self.outer_lr)     # step 7
        return self.outer

    @property
    def accumulators(self) -> dict[str, torch.Tensor]:
        """Each parameter's accumulator e_k (parameter-shaped; zero before the first outer step)."""
        return decoded_memories(self.buckets, lambda m: m[1],
                                lambda m: torch.zeros(m[1].shape, dtype=self.outer.dtype))

    def payload_bytes(self) -> int:
        """P: bytes of one rank's payload per outer step (values, tables, indices)."""
        return sum(b.comp.codec.payload_nbytes(b.numel, self.outer.dtype) for b in self.buckets)

    def _outer_state(self) -> list[torch.Tensor]:
        return [self.outer, *(e for b in self.buckets for e in b.comp.encoder.residuals.values())]

    def _state_dict(self) -> dict:
        state = super()._state_dict()
        state["outer"] = self.outer.clone()
        state["compressors"] = {b.key: b.comp.state_dict() for b in self.buckets}
        return state

    def _load_state_dict(self, state: dict) -> None:
        super()._load_state_dict(state)
        self.outer.copy_(state["outer"])
        for b in self.buckets:
            b.comp.load_state_dict(state["compressors"][b.key])

    def _reshard_extra(self, old: list[dict]) -> dict:
        """θ (equal on every old rank: the average is exact) and each new rank's accumulator,
        the old ranks' mean (so the mean of what the ranks will still send is kept)."""
        from ..reshard import average
        comps = {b.key: b.mean_memory_state([s["compressors"][b.key] for s in old]) for b in self.buckets}
        return {"outer": average([s["outer"] for s in old]), "compressors": comps}

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        out = super().metrics(ctl, final)
        if final:
            out.update(topk=self.topk, chunk=self.chunk, decay=self.decay, outer_lr=self.outer_lr,
                       payload_bytes_per_sync=self.payload_bytes())
        return out


METHOD = Method("sparseloco", SparseLoCoSettings, SparseLoCo.from_settings, "SparseLoCo: DiLoCo "
                "with a chunked top-k 2-bit pseudo-gradient and an error-feedback accumulator for "
                "outer momentum",
                check=check_run, outer=True, level=True, python="SparseLoCo",
                example="sparseloco:period=3,chunk=8,topk=4")
