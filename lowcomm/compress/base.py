"""The compressor interface every gradient-compression method implements.

A compressor turns one flat bucket of a gradient into a *payload* (a list of tensors, the only
thing that goes on the wire) and back. The :class:`~lowcomm.reducer.Reducer` hands it whole
buckets together with the :class:`Segment` s (parameter name, shape, slice) they hold, so methods
that work per matrix (PowerSGD) or keep state per parameter (error feedback) can.

``reduce()`` is the whole collective: the default runs

* summable payloads (``summable = True``, e.g. fp16): all-reduce (sum) each payload tensor, then
  ``decompress`` and divide by K;
* otherwise: all-gather every rank's payload, ``decompress`` each, and average.

Methods whose exchange is neither (majority vote, PowerSGD's two all-reduces, compressed
all-reduce with a server-side re-compression) override ``reduce``. State (error-feedback
residuals, PowerSGD's Q, random generators) lives in the object, is keyed by parameter name or
bucket key, and is saved by ``state_dict()``; a compressor never holds a Comm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Comm


@dataclass(frozen=True)
class Segment:
    """One tensor inside a flat bucket: ``flat[start:stop].view(shape)`` is parameter ``name``."""
    name: str
    shape: torch.Size
    start: int
    stop: int


class Compressor:
    """Identity ("none"): the dense average. Subclasses override compress/decompress (and
    ``summable``), or ``reduce`` itself."""

    name = "none"
    summable = True

    def compress(self, x: torch.Tensor, key: str, segments: list[Segment]):
        """``x`` (flat) -> ``(payload, ctx)``; ``payload`` is a list of tensors sent as they are,
        ``ctx`` what the decoder needs that need not travel (shapes, dtype)."""
        return [x], None

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        return payload[0]

    def reduce(self, flat: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        """Return the average over ``comm`` of every rank's ``flat`` (same shape and dtype)."""
        payload, ctx = self.compress(flat, key, segments)
        K = comm.size
        if self.summable:
            for t in payload:
                comm.allreduce_(t)
            return self.decompress(payload, ctx).to(flat.dtype).div_(K)
        gathered = [comm.allgather(t) for t in payload]
        out = torch.zeros_like(flat)
        for k in range(K):
            out.add_(self.decompress([g[k] for g in gathered], ctx).to(flat.dtype))
        return out.div_(K)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
