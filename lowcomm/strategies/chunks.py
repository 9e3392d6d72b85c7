"""Chunk buckets: tensors cut into chunks of one size travel together through one compressor
(DeMo's DCT chunks and SparseLoCo's top-k chunks)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..compress.base import Segment
from ..compress.compressor import Compressor


@dataclass
class ChunkBucket:
    """Tensors whose chunks have one size: their chunks travel together, through ``comp`` (error
    feedback around a per-chunk codec). ``members`` are tuples whose first item is the tensor's
    name and whose last two are its ``[lo, hi)`` in the bucket (DeMo's and SparseLoCo's add what
    they need between)."""
    key: str
    members: list[tuple]
    comp: Compressor

    @property
    def numel(self) -> int:
        return self.members[-1][-1]

    @cached_property
    def segments(self) -> list[Segment]:
        """The members' places in the bucket (built once: the members never change)."""
        return [Segment(m[0], torch.Size([m[-1] - m[-2]]), m[-2], m[-1]) for m in self.members]

    def decay_(self, beta: float) -> None:
        """The error-feedback memory ← β · memory (DeMo's momentum, SparseLoCo's accumulator)."""
        for e in self.comp.encoder.residuals.values():
            e.mul_(beta)

    def memory(self, name: str) -> torch.Tensor | None:
        """Member ``name``'s error-feedback memory, flat in chunk order (None before the first step)."""
        return self.comp.encoder.residuals.get(name)

    def mean_memory_state(self, olds: list[dict]) -> dict:
        """A compressor state whose memories are the mean of the old ranks' (``olds``: their
        compressor states): what each new rank starts from when the rank count changes."""
        from .reshard import average
        names = olds[0].get("encoder", {}).get("residuals", {})
        residuals = {n: average([o["encoder"]["residuals"][n] for o in olds]) for n in names}
        return {"encoder": {"residuals": residuals, "codec": {}}} if residuals else {}


def chunk_buckets(items, prefix: str, compressor) -> list[ChunkBucket]:
    """``items`` ``(row, numel, *member)`` grouped by chunk size ``row`` (ascending), each group
    one :class:`ChunkBucket` ``f"{prefix}{row}"`` whose members are ``(*member, lo, hi)`` in
    order, with ``compressor(row)``."""
    by_row: dict[int, list] = {}
    for row, numel, *member in items:
        by_row.setdefault(row, []).append((numel, member))
    out = []
    for row, group in sorted(by_row.items()):
        members, at = [], 0
        for numel, member in group:
            members.append((*member, at, at + numel))
            at += numel
        out.append(ChunkBucket(f"{prefix}{row}", members, compressor(row)))
    return out


def decoded_memories(buckets: list[ChunkBucket], chunking, empty) -> dict[str, torch.Tensor]:
    """Every member's error-feedback memory decoded to its tensor's shape by ``chunking(member)``
    (its chunk transform), by name; ``empty(member)`` before the first step (DeMo's momentum,
    SparseLoCo's accumulators)."""
    out = {}
    for b in buckets:
        for m in b.members:
            e, t = b.memory(m[0]), chunking(m)
            out[m[0]] = t.decode(e.view(t.rows, t.row)) if e is not None else empty(m)
    return out


__all__ = ["ChunkBucket", "chunk_buckets", "decoded_memories"]
