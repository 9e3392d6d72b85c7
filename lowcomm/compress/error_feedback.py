"""Error feedback: a wrapper that makes any compressor remember what it did not send."""
from __future__ import annotations

import torch

from .base import Compressor, Segment, whole


class ErrorFeedback(Compressor):
    """Error feedback / error compensation around any compressor C (Seide et al. 2014, 1-bit
    SGD; Stich, Cordonnier & Jaggi 2018, arXiv 1809.07599; Karimireddy, Rebjock, Stich & Jaggi
    2019, arXiv 1901.09847).

    Update, per bucket x on each rank, with residual e (zero at first), per parameter:
      1. ``p = x + e``;
      2. send ``C(p)`` with the inner compressor's exchange;
      3. ``e ← p − D(C(p))``: the part of p this rank did not send, added back next step.
    Residuals are kept per parameter name (``Segment.name``) and saved in ``state_dict()``.

    Args:
        inner: the compressor whose error is fed back (its ``summable`` and exchange are used).

    Example::

        comp = ErrorFeedback(ScaledSign("ef-sign"))
        avg = comp.reduce(flat, "bucket0", comm, segments)
    """

    horovod = False

    def __init__(self, inner: Compressor):
        super().__init__()
        if isinstance(inner, ErrorFeedback):
            raise ValueError("error feedback is already on for this compressor")
        self.inner = inner
        self.name, self.summable = inner.name, inner.summable
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, x: torch.Tensor, key: str, segments: list[Segment] | None = None):
        x = x.detach().reshape(-1)
        self.inner.rank = self.rank
        segments = segments or whole(key, x)
        p = x.clone()
        for s in segments:
            e = self.residuals.get(s.name)
            if e is not None:
                if e.numel() != s.stop - s.start:
                    raise ValueError(f"error feedback: parameter {s.name!r} has {s.stop - s.start} "
                                     f"elements, its residual {e.numel()}")
                p[s.start:s.stop].add_(e)
        payload, ctx = self.inner.compress(p, key, segments)   # checks p (so x) for NaN/Inf
        sent = self.inner.decompress(payload, ctx)
        err = p.sub_(sent.to(p.dtype))
        for s in segments:
            e = self.residuals.get(s.name)
            if e is None:
                self.residuals[s.name] = err[s.start:s.stop].clone()
            else:
                e.copy_(err[s.start:s.stop])
        return payload, ctx

    def decompress(self, payload, ctx):
        return self.inner.decompress(payload, ctx)

    def exchange(self, payload, ctx, comm, like):
        return self.inner.exchange(payload, ctx, comm, like)

    def state_dict(self) -> dict:
        return {"residuals": {n: e.clone() for n, e in self.residuals.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {n: e.clone() for n, e in state["residuals"].items()}
        self.inner.load_state_dict(state["inner"])
