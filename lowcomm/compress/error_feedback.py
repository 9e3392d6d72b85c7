"""Error feedback: a wrapper that makes any compressor remember what it did not send."""
from __future__ import annotations

import torch

from .base import Segment, overlaps, uncovered_, whole


class ErrorFeedback:
    """Error feedback / error compensation around any codec C (Seide et al. 2014, 1-bit SGD;
    Stich, Cordonnier & Jaggi 2018, arXiv 1809.07599; Karimireddy, Rebjock, Stich & Jaggi 2019,
    arXiv 1901.09847).

    Update, per bucket x on each rank, with residual e (zero at first), per parameter:
      1. ``p = x + e``;
      2. send ``C(p)`` with the compressor's exchange;
      3. ``e ← p − D(C(p))``: the part of p this rank did not send, added back next step.

    Residuals are kept per parameter name (``Segment.name``), zero where no parameter lies, and
    saved in ``state_dict()``. In the two-phase exchange (:mod:`lowcomm.compress.twophase`)
    step 2 encodes p chunk by chunk and step 3 uses the chunks' decoded payloads: this is the
    *worker* error of 1-bit Adam (Tang et al. 2021, arXiv 2102.02888), and the exchange keeps
    the owners' *server* error too where the compressor has error feedback (not for unbiased
    codecs): error feedback at both ends, as 1-bit Adam's error-compensated compressed
    all-reduce.

    It wraps the codec's encoding only (``compress``, ``compress_chunks``): what is sent is
    decoded by ``codec`` itself, so nothing is forwarded.

    Args:
        codec: the codec whose error is fed back.

    Example::

        comp = Compressor(ErrorFeedback(ScaledSign("ef-sign")), "two-phase")
        avg = comp.reduce(flat, "bucket0", comm, segments)
    """

    def __init__(self, codec):
        if isinstance(codec, ErrorFeedback):
            raise ValueError("error feedback is already on for this codec")
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}
        self._flat: dict[str, tuple] = {}     # key -> (e, spare, residual views, layout)

    def compress(self, x: torch.Tensor, key: str, segments: list[Segment] | None = None,
                 rank: int | None = None):
        """Steps 1 and 3 around ``codec.compress``; returns its ``(payload, ctx)``."""
        def one(p, segments, x, e):
            return self.codec.compress_feedback_(p, key, segments, x, e, rank)
        return self._fed_back(x, key, segments, one)

    def compress_chunks(self, x, key, segments, bounds, rank=None):
        """Steps 1 and 3 around ``codec.compress_chunks`` (the two-phase exchange's step 1)."""
        def chunked(p, segments, x, e):
            torch.add(x, e, out=p)
            chunks = self.codec.compress_chunks(p, key, segments, bounds, rank)
            chunks = [([t.clone() if overlaps(t, p) else t for t in pl], ctx) for pl, ctx in chunks]
            for (pl, ctx), lo, hi in zip(chunks, bounds, bounds[1:]):
                if hi > lo:
                    self.codec.subtract_decoded_(p[lo:hi], pl, ctx)
            return chunks
        return self._fed_back(x, key, segments, chunked)

    def _buffers(self, key: str, x: torch.Tensor, segments: list[Segment]):
        """The bucket's residuals as one flat tensor ``e`` (``residuals[name]`` are its slices)
        and a second flat buffer, swapped with it every step: p = x + e is written into the
        second, becomes the error in place, and is the next step's e (no clone, no copy)."""
        layout = [(s.name, s.start, s.stop) for s in segments]
        st = self._flat.get(key)
        if st is not None:
            e, spare, views, was = st
            if was == layout and e.numel() == x.numel() and e.dtype == x.dtype and \
                    e.device == x.device and all(self.residuals.get(s.name) is v
                                                 for s, v in zip(segments, views)):
                return e, spare
        e = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
        for s in segments:
            r = self.residuals.get(s.name)
            if r is not None:
                if r.numel() != s.stop - s.start:
                    raise ValueError(f"error feedback: parameter {s.name!r} has {s.stop - s.start} "
                                     f"elements, its residual {r.numel()}")
                e[s.start:s.stop] = r.reshape(-1)
        self._keep(key, e, torch.empty_like(e), segments, layout)
        return e, self._flat[key][1]

    def _keep(self, key, e, spare, segments, layout) -> None:
        views = [e[s.start:s.stop] for s in segments]
        for s, v in zip(segments, views):
            self.residuals[s.name] = v
        self._flat[key] = (e, spare, views, layout)

    def _fed_back(self, x: torch.Tensor, key: str, segments: list[Segment] | None, encode):
        """Steps 1–3 by ``encode(p, segments, x, e)``, which writes ``x + e`` into p, returns its
        result and leaves ``p − D(C(p))`` in ``p``; returns the result."""
        x = x.detach().reshape(-1)
        segments = segments or whole(key, x)
        e, p = self._buffers(key, x, segments)
        result = encode(p, segments, x, e)          # 1.–3.; the codec checks p for NaN/Inf
        if sum(s.stop - s.start for s in segments) != x.numel():
            uncovered_(p, segments)                 # bytes no parameter owns keep no error
        self._keep(key, p, e, segments, self._flat[key][3])    # the error is the next e
        return result

    def state_dict(self) -> dict:
        return {"residuals": {n: e.clone() for n, e in self.residuals.items()},
                "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {n: e.clone() for n, e in state.get("residuals", {}).items()}
        self._flat = {}
        self.codec.load_state_dict(state.get("codec", {}))
