"""The compressor interface every gradient-compression method implements.

A compressor turns one flat bucket of a gradient into a *payload* (a list of tensors, the only
thing that goes on the wire) and back. The :class:`~lowcomm.strategies.reducer.Reducer` hands it whole
buckets together with the :class:`Segment` s (parameter name, shape, slice) they hold, so methods
that work per matrix (PowerSGD) or keep state per parameter (error feedback) can.

``reduce(flat, key, comm, segments)`` is the whole collective and the Reducer's entry point. It
is ``compress`` followed by ``exchange``:

* summable payloads (``summable = True``, e.g. fp16): all-reduce (sum) each payload tensor, then
  ``decompress`` and divide by K;
* otherwise: all-gather every rank's payload (all payload tensors of a rank travel as one byte
  message, so a method costs one collective per bucket), ``decompress`` each, and average.

Methods whose exchange is neither (majority vote) override ``exchange``; PowerSGD, whose two
all-reduces interleave with its computation, overrides ``reduce``. The split lets the
:class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapper sit between the two halves.

A non-summable method with ``two_phase = True`` has a second collective whose bytes per rank do
not grow with K (:func:`~lowcomm.compress.twophase.two_phase_reduce`: compressed all-to-all of
chunks, the owner reduces and re-compresses its chunk, all-gather); ``collective`` ("auto",
"allgather", "two-phase") picks, "auto" by the α–β model. Its hooks: ``payload_nbytes`` /
``server_nbytes`` (bytes, for the model), ``compress_chunks`` (step 1), ``server_reduce`` (the
owner's reduce and re-compression, with server error feedback kept in ``server_error`` where
the method has worker error feedback), ``server_template`` and ``server_decompress`` (decoding
the owners' chunks).

``compress`` refuses NaN/Inf (a :class:`~lowcomm.errors.NonFiniteError` naming the parameters
and the rank): nothing non-finite is ever encoded, whoever calls it.

State (error-feedback residuals, PowerSGD's Q, random generators) lives in the object, is keyed
by parameter name or bucket key, and is saved by ``state_dict()``; a compressor never holds a
Comm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.comm import Comm, world_rank
from ..errors import NonFiniteError


@dataclass(frozen=True)
class Segment:
    """One tensor inside a flat bucket: ``flat[start:stop].view(shape)`` is parameter ``name``."""
    name: str
    shape: torch.Size
    start: int
    stop: int


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` overlap (a cheap aliasing test)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (a.numel() - 1) * max(a.stride() or (1,)) * a.element_size() + a.element_size() \
        if a.dim() else a0 + a.element_size()
    b1 = b0 + (b.numel() - 1) * max(b.stride() or (1,)) * b.element_size() + b.element_size() \
        if b.dim() else b0 + b.element_size()
    return a0 < b1 and b0 < a1


def whole(key: str, x: torch.Tensor) -> list[Segment]:
    """The segment list of a flat tensor that carries no parameter names: one segment, ``key``."""
    return [Segment(key, torch.Size([x.numel()]), 0, x.numel())]


def nonfinite_segments(x: torch.Tensor, segments: list[Segment]) -> list[Segment]:
    """The segments of flat ``x`` holding NaN/Inf. One sum decides the common case (NaN/Inf
    propagate into it); only then are segments inspected (a finite sum can overflow: then none)."""
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return []
    return [s for s in segments if not bool(torch.isfinite(x[s.start:s.stop]).all())]


def check_finite(x: torch.Tensor, key: str, segments: list[Segment] | None, rank: int | None,
                 who: str) -> None:
    """Raise :class:`NonFiniteError` naming the parameters of ``x`` that hold NaN/Inf."""
    bad = [s.name for s in nonfinite_segments(x, segments or whole(key, x))]
    if bad:
        raise NonFiniteError(world_rank() if rank is None else rank,
                             ", ".join(repr(n) for n in bad) + f" (input of compressor {who!r}, {key})")


def allgather_payload(comm: Comm, payload: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather a rank's payload tensors as one byte message; returns one ``(K, *shape)``
    tensor per payload tensor (the bytes on the wire are exactly the payload's)."""
    if len(payload) == 1:
        return [comm.allgather(payload[0].contiguous())]
    raw = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])
    g = comm.allgather(raw)
    out, off = [], 0
    for t in payload:
        nb = t.numel() * t.element_size()
        out.append(g[:, off:off + nb].clone(memory_format=torch.contiguous_format).view(t.dtype).view(comm.size, *t.shape))
        off += nb
    return out


class Compressor:
    """Identity ("none"): the dense average. Subclasses implement ``_compress``/``decompress``
    (and set ``summable``), or override ``exchange`` or ``reduce`` itself.

    Attributes:
        name: the config name.
        summable: payloads of different ranks can be summed on the wire (all-reduce).
        horovod: Horovod's static ``compression=`` interface can run this method (stateless,
            summable, a dtype Horovod 0.28.1 reduces).
        rank: this rank in the communicator last used by :meth:`reduce` (None before; error
            messages fall back to the MPI world rank).
        two_phase: a non-summable method that can run the two-phase collective.
        unbiased: ``E[D(C(x))] = x`` (QSGD): the two-phase owner keeps no server error even
            under error feedback (re-quantising with fresh randomness stays unbiased).
        collective: "auto" | "allgather" | "two-phase" (``compressor.collective``).
    """

    name = "none"
    #: ``_compress`` reduces x (a norm, a max) before encoding and calls :func:`check_finite`
    #: when that reduction is not finite (NaN/Inf propagate into it), saving a pass over x
    finite_from_reduction = False
    summable = True
    horovod = True
    two_phase = False
    unbiased = False

    def __init__(self) -> None:
        self.rank: int | None = None
        self.collective = "two-phase"
        self.server_error: dict[str, torch.Tensor] = {}

    # the two halves ---------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, key: str, segments: list[Segment] | None = None):
        """``x`` (flat) -> ``(payload, ctx)``; ``payload`` is a list of tensors sent as they are,
        ``ctx`` what the decoder needs that need not travel (sizes, dtype). Raises
        :class:`NonFiniteError` on NaN/Inf in ``x``."""
        x = x.detach().reshape(-1)
        if not self.finite_from_reduction:
            check_finite(x, key, segments, self.rank, self.name)
        return self._compress(x, key, segments or whole(key, x))

    def _compress(self, x: torch.Tensor, key: str, segments: list[Segment]):
        return [x], None

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        return payload[0]

    def compress_feedback_(self, p: torch.Tensor, key: str, segments: list[Segment] | None = None,
                           x: torch.Tensor | None = None, e: torch.Tensor | None = None):
        """``compress(p)``, leaving ``p − D(C(p))`` in ``p`` (error feedback's step 3); returns
        ``(payload, ctx)``. With ``x`` and ``e``, first ``p ← x + e`` (step 1). Methods override
        it to do the steps in fewer passes."""
        if x is not None:
            torch.add(x, e, out=p)
        payload, ctx = self.compress(p, key, segments)
        payload = [t.clone() if overlaps(t, p) else t for t in payload]   # p becomes the error
        self.subtract_decoded_(p, payload, ctx)
        return payload, ctx

    def subtract_decoded_(self, p: torch.Tensor, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        """``p ← p − D(payload)`` in place (flat ``p``, the tensor the payload encodes): the error
        :class:`~lowcomm.compress.error_feedback.ErrorFeedback` keeps. Methods override it where
        the decoded tensor need not be built (top-k: only k entries change)."""
        sent = self.decompress(payload, ctx).reshape(-1)
        if overlaps(sent, p):
            sent = sent.clone()                 # a payload that is p itself (a same-dtype cast)
        return p.sub_(sent.to(p.dtype))

    def exchange(self, payload: list[torch.Tensor], ctx, comm: Comm, like: torch.Tensor) -> torch.Tensor:
        """Combine every rank's payload into the average (shaped and typed like ``like``)."""
        K = comm.size
        if self.summable:
            for t in payload:
                comm.allreduce_(t)
            return self.decompress(payload, ctx).to(like.dtype).div_(K)
        gathered = allgather_payload(comm, payload)
        return self.decompress_mean(gathered, ctx, K).to(like.dtype)

    def decompress_mean(self, gathered: list[torch.Tensor], ctx, K: int) -> torch.Tensor:
        """The mean of K ranks' decoded payloads (``gathered[i][k]``: tensor i of rank k).
        Subclasses replace this loop over ranks with one vectorised decode."""
        out = self.decompress([g[0] for g in gathered], ctx).clone()
        for k in range(1, K):
            out.add_(self.decompress([g[k] for g in gathered], ctx))
        return out.div_(K)

    def reduce(self, flat: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        """Return the average over ``comm`` of every rank's ``flat`` (same shape and dtype), by
        the all-gather exchange or the two-phase collective (``collective``, see
        :func:`~lowcomm.compress.twophase.choose`)."""
        from .twophase import choose, two_phase_reduce
        self.rank = comm.rank
        if choose(self, flat.numel(), flat.dtype, comm) == "two-phase":
            return two_phase_reduce(self, flat, key, comm, segments).view(flat.shape)
        payload, ctx = self.compress(flat, key, segments)
        return self.exchange(payload, ctx, comm, flat)

    # the two-phase collective's hooks (lowcomm.compress.twophase) -------------------------------
    def payload_nbytes(self, n: int, dtype: torch.dtype) -> int:
        """Bytes of the payload of ``n`` elements of ``dtype`` (the α–β model's P(n))."""
        return n * torch.empty(0, dtype=dtype).element_size()

    def server_nbytes(self, n: int, dtype: torch.dtype, K: int) -> int:
        """Bytes of the owner's re-compressed chunk of ``n`` elements on K ranks (S(n))."""
        return self.payload_nbytes(n, dtype)

    def compress_chunks(self, x: torch.Tensor, key: str, segments: list[Segment] | None,
                        bounds: list[int]) -> list[tuple[list[torch.Tensor], object]]:
        """Step 1 of the two-phase collective: ``(payload, ctx)`` of every chunk
        ``x[bounds[j]:bounds[j+1]]``, each compressed on its own (an empty chunk: ``([], None)``).
        Raises :class:`NonFiniteError` on NaN/Inf in ``x``."""
        x = x.detach().reshape(-1)
        check_finite(x, key, segments, self.rank, self.name)
        out = []
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            ck = f"{key}[{j}]"
            out.append(self._compress(x[lo:hi], ck, whole(ck, x[lo:hi])) if hi > lo else ([], None))
        return out

    def server_reduce(self, stacks: list[torch.Tensor], ctx, K: int, key: str,
                      feedback: bool = False):
        """Step 3: the owner's chunk. ``stacks[i][k]`` is payload tensor i of rank k; returns the
        re-compressed average ``(payload, ctx)``. With ``feedback`` (the
        :class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapper asks for it, so a method
        has error feedback at both ends or at neither) the owner's re-compression error is kept
        per ``key`` in ``server_error`` and added back next time."""
        avg = self.decompress_mean(stacks, ctx, K)
        if feedback:
            e = self.server_error.get(key)
            if e is not None and e.shape == avg.shape and e.dtype == avg.dtype:
                avg = avg + e
        payload, ctx2 = self._compress(avg, key, whole(key, avg))
        if feedback:
            self.server_error[key] = avg - self.decompress(payload, ctx2).to(avg.dtype)
        return payload, ctx2

    def server_template(self, payload: list[torch.Tensor], ctx, K: int) -> list[tuple]:
        """``(dtype, shape)`` of each tensor of an owner's re-compressed chunk whose worker
        payload is ``payload`` (the same layout, unless a method says otherwise)."""
        return [(t.dtype, tuple(t.shape)) for t in payload]

    def server_decompress(self, payload: list[torch.Tensor], ctx, K: int) -> torch.Tensor:
        """Step 4: decode an owner's re-compressed chunk."""
        return self.decompress(payload, ctx)

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"server_error": {k: e.clone() for k, e in self.server_error.items()}} \
            if self.server_error else {}

    def load_state_dict(self, state: dict) -> None:
        self.server_error = {k: e.clone() for k, e in state.get("server_error", {}).items()}


class Seeded:
    """A mixin for methods that draw random numbers: one ``torch.Generator`` (created on the
    first tensor's device), seeded from ``seed`` — plus the rank when ``per_rank`` — whose state
    is part of ``state_dict()``, so a resumed run draws exactly the numbers it would have."""

    per_rank = True

    def _init_rng(self, seed: int) -> None:
        self.seed = int(seed)
        self._gen: torch.Generator | None = None
        self._gen_state: torch.Tensor | None = None   # loaded before the device is known

    def generator(self, device: torch.device) -> torch.Generator:
        if self._gen is None or self._gen.device != torch.device(device):
            g = torch.Generator(device=device)
            if self._gen_state is not None:
                g.set_state(self._gen_state)
            else:
                rank = (self.rank if self.rank is not None else world_rank()) if self.per_rank else 0
                g.manual_seed(self.seed * 1_000_003 + rank)
            self._gen, self._gen_state = g, None
        return self._gen

    def rng_state(self) -> dict:
        if self._gen is not None:
            return {"generator": self._gen.get_state()}
        return {"generator": self._gen_state}

    def load_rng_state(self, state: dict) -> None:
        self._gen = None
        self._gen_state = state.get("generator")
