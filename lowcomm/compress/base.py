"""The two contracts of gradient compression: a *codec* and an *exchange*.

A :class:`Codec` turns one flat bucket of a gradient into a *payload* (a list of tensors, the
only thing that goes on the wire) and back: ``compress(x, key, segments) -> (payload, ctx)``,
``decompress(payload, ctx)``, and optionally ``decompress_mean`` (the K ranks' payloads decoded
and combined in one vectorised pass: their mean; sign-mv's vote). It is handed whole buckets
with the :class:`Segment` s (parameter name, shape, slice) they hold, so codecs that work per
matrix (PowerSGD) or keep state per parameter can.

An :class:`Exchange` moves payloads between ranks
(:mod:`lowcomm.compress.exchange`): ``Summed`` (a summable codec's payload is all-reduced),
``Gathered`` (every rank's payload all-gathered, then mean-decoded), ``TwoPhase``
(:mod:`lowcomm.compress.twophase`: compressed chunks to their owners, who decode the mean and
re-encode it, then an all-gather; bytes flat in K) and ``Auto`` (the faster of the last two by
the α–β model). A codec whose exchange is interleaved with its computation (PowerSGD's two
all-reduces) names its own (``own_exchange``).

:class:`~lowcomm.compress.compressor.Compressor` composes them: ``Compressor(encoder,
exchange).reduce(flat, key, comm, segments)`` is what strategies call. The encoder is the codec
itself or :class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapped around it (it changes
what is encoded, never how it is decoded, so it forwards nothing).

``compress`` refuses NaN/Inf (a :class:`~lowcomm.errors.NonFiniteError` naming the parameters
and the rank): nothing non-finite is ever encoded, whoever calls it.

State (error-feedback residuals, PowerSGD's Q, random generators, the owners' server error)
lives in the objects, is keyed by parameter name or bucket key, and is saved by
``state_dict()``; none holds a Comm. The rank a call runs on is an argument (``rank``, the
communicator's; None: the MPI world rank), never remembered from an earlier call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.collectives import chunk_bounds
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


def pieces(segments: list[Segment], lo: int, hi: int) -> list[Segment]:
    """The parts of ``segments`` inside ``[lo, hi)``, as segments of the chunk ``x[lo:hi]``."""
    return [Segment(s.name, torch.Size([min(s.stop, hi) - max(s.start, lo)]),
                    max(s.start, lo) - lo, min(s.stop, hi) - lo)
            for s in segments if s.start < hi and s.stop > lo]


def uncovered_(t: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Zero the elements of flat ``t`` that no segment covers (bytes no parameter owns keep no
    error); returns ``t``."""
    at = 0
    for s in sorted(segments, key=lambda s: s.start):
        if s.start > at:
            t[at:s.start].zero_()
        at = max(at, s.stop)
    if at < t.numel():
        t[at:].zero_()
    return t


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


class Codec:
    """The identity codec ("none"): the payload is x itself. Codecs implement ``encode`` and
    ``decompress`` and describe their payload with ``payload_layout``.

    Attributes:
        name: the config name.
        summable: payloads of different ranks can be summed on the wire (the ``Summed``
            exchange); otherwise they are gathered (``Gathered``, ``TwoPhase``, ``Auto``).
        predivide: (summable codecs) divide the payload by K before the sum, in its own dtype,
            so a 16-bit sum cannot overflow; else the decoded sum is divided afterwards.
        unbiased: ``E[D(C(x))] = x`` (QSGD): the two-phase owners keep no server error even
            under error feedback (re-quantising with fresh randomness stays unbiased).
        finite_from_reduction: ``encode`` reduces x (a norm, a max) before encoding and calls
            :func:`check_finite` when that reduction is not finite (NaN/Inf propagate into it),
            saving ``compress`` a pass over x.
        own_exchange: an :class:`Exchange` subclass the codec needs (PowerSGD's), else None.
        decodes_alone: one rank's payload decodes on its own, with any rank's ``ctx`` (robust
            aggregation gathers the payloads and decodes each, :mod:`~lowcomm.strategies.outer.aggregate`).
    """

    name = "none"
    summable = True
    predivide = False
    unbiased = False
    finite_from_reduction = False
    own_exchange: type | None = None
    decodes_alone = True

    @property
    def codec(self) -> "Codec":
        """The codec that decodes what this encoder encodes: itself (an
        :class:`~lowcomm.compress.error_feedback.ErrorFeedback` names the codec it wraps)."""
        return self

    # one rank: encode and decode ----------------------------------------------------------------
    def compress(self, x: torch.Tensor, key: str, segments: list[Segment] | None = None,
                 rank: int | None = None):
        """``x`` (flat) -> ``(payload, ctx)``; ``payload`` is a list of tensors sent as they are,
        ``ctx`` what the decoder needs that need not travel (sizes, dtype). Raises
        :class:`NonFiniteError` (naming ``rank``) on NaN/Inf in ``x``."""
        x = x.detach().reshape(-1)
        if not self.finite_from_reduction:
            check_finite(x, key, segments, rank, self.name)
        return self.encode(x, key, segments or whole(key, x), rank)

    def encode(self, x: torch.Tensor, key: str, segments: list[Segment], rank: int | None = None):
        """The method itself on flat ``x`` (finite unless ``finite_from_reduction``)."""
        return [x], None

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        return payload[0]

    def decompress_mean(self, gathered: list[torch.Tensor], ctx, K: int) -> torch.Tensor:
        """The K ranks' payloads decoded and combined (``gathered[i][k]``: tensor i of rank k):
        their mean. Codecs replace this loop over ranks with one vectorised decode."""
        out = self.decompress([g[0] for g in gathered], ctx).clone()
        for k in range(1, K):
            out.add_(self.decompress([g[k] for g in gathered], ctx))
        return out.div_(K)

    def payload_layout(self, n: int, dtype: torch.dtype, nseg: int = 1) -> list[tuple[torch.dtype, tuple]]:
        """``(dtype, shape)`` of each payload tensor for ``n`` elements of ``dtype`` holding
        ``nseg`` segments (parameters, or pieces of them in a two-phase chunk)."""
        return [(dtype, (n,))]

    def payload_nbytes(self, n: int, dtype: torch.dtype, nseg: int = 1) -> int:
        """Bytes of the payload of ``n`` elements of ``dtype`` (the α–β model's P(n))."""
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size()
                   for dt, shape in self.payload_layout(n, dtype, nseg))

    # error feedback (lowcomm.compress.error_feedback) -------------------------------------------
    def compress_feedback_(self, p: torch.Tensor, key: str, segments: list[Segment] | None = None,
                           x: torch.Tensor | None = None, e: torch.Tensor | None = None,
                           rank: int | None = None):
        """``compress(p)``, leaving ``p − D(C(p))`` in ``p`` (error feedback's step 3); returns
        ``(payload, ctx)``. With ``x`` and ``e``, first ``p ← x + e`` (step 1). Codecs override
        it to do the steps in fewer passes."""
        if x is not None:
            torch.add(x, e, out=p)
        payload, ctx = self.compress(p, key, segments, rank)
        payload = [t.clone() if overlaps(t, p) else t for t in payload]   # p becomes the error
        self.subtract_decoded_(p, payload, ctx)
        return payload, ctx

    def subtract_decoded_(self, p: torch.Tensor, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        """``p ← p − D(payload)`` in place (flat ``p``, the tensor the payload encodes): the error
        error feedback keeps. Codecs override it where the decoded tensor need not be built
        (top-k: only k entries change)."""
        sent = self.decompress(payload, ctx).reshape(-1)
        if overlaps(sent, p):
            sent = sent.clone()                 # a payload that is p itself (a same-dtype cast)
        return p.sub_(sent.to(p.dtype))

    # the two-phase exchange (lowcomm.compress.twophase) ------------------------------------------
    def compress_chunks(self, x: torch.Tensor, key: str, segments: list[Segment] | None,
                        bounds: list[int], rank: int | None = None) -> list[tuple[list[torch.Tensor], object]]:
        """Its step 1: ``(payload, ctx)`` of every chunk ``x[bounds[j]:bounds[j+1]]``, each
        encoded on its own (an empty chunk: ``([], None)``). Raises :class:`NonFiniteError` on
        NaN/Inf in ``x``."""
        x = x.detach().reshape(-1)
        check_finite(x, key, segments, rank, self.name)
        out = []
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            ck = f"{key}[{j}]"
            out.append(self.encode(x[lo:hi], ck, whole(ck, x[lo:hi]), rank) if hi > lo else ([], None))
        return out

    def bounds(self, n: int, K: int) -> list[int]:
        """Its cut of a bucket of ``n`` elements into K owner chunks (``K + 1`` offsets):
        near-equal chunks; a codec that encodes blocks of elements together cuts between
        blocks."""
        return chunk_bounds(n, K)

    def owner(self, K: int) -> "Codec":
        """The codec of the two-phase owners' re-encoded chunks on K ranks (decoded with the
        workers' ctx of that chunk): this codec, unless the method sends its aggregate
        otherwise (sign-mv's vote)."""
        return self

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Exchange:
    """How the payloads of K ranks become their average (:mod:`lowcomm.compress.exchange`).

    ``reduce(comp, x, key, comm, segments)`` returns the average over ``comm`` of every rank's
    flat ``x`` (same shape and dtype), encoding with ``comp.encoder`` and decoding with
    ``comp.codec`` (``comp`` a :class:`~lowcomm.compress.compressor.Compressor`)."""

    name = "exchange"

    def reduce(self, comp, x: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        raise NotImplementedError

    def posts(self, comp, numel: int, dtype: torch.dtype, comm: Comm) -> bool:
        """Whether :meth:`start` posts a reduction of ``numel`` elements over ``comm`` (the same
        answer on every rank)."""
        return False

    def start(self, comp, x: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> "Pending":
        """:meth:`reduce` posted: encoded and handed to non-blocking MPI calls now, decoded by
        :meth:`Pending.wait`; for exchanges whose :meth:`posts` says so."""
        raise NotImplementedError(f"the {self.name} exchange has no non-blocking form")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Pending:
    """A reduction posted and not yet finished (:meth:`Exchange.start`). :meth:`test` polls its
    requests (MPI moves them on only inside calls) and says whether all are complete;
    :meth:`wait` completes them and returns ``finish()`` (the decoded average)."""

    def __init__(self, requests: list, finish):
        self.requests, self._finish = list(requests), finish

    def test(self) -> bool:
        return all([r.test() for r in self.requests])     # every request polled

    def wait(self):
        for r in self.requests:
            r.wait()
        return self._finish()

    def then(self, fn) -> "Pending":
        """The same requests, finished by ``fn(finish())``."""
        return Pending(self.requests, lambda: fn(self._finish()))


class Seeded:
    """A mixin for methods that draw random numbers: one ``torch.Generator`` (created on the
    first tensor's device), seeded from ``seed`` — plus the rank when ``per_rank`` — whose state
    is part of ``state_dict()``, so a resumed run draws exactly the numbers it would have."""

    per_rank = True

    def _init_rng(self, seed: int) -> None:
        self.seed = int(seed)
        self._gen: torch.Generator | None = None
        self._gen_state: torch.Tensor | None = None   # loaded before the device is known

    def generator(self, device: torch.device, rank: int | None = None) -> torch.Generator:
        """The generator on ``device``; a new one is seeded with ``rank`` (None: the MPI world
        rank) when ``per_rank``."""
        if self._gen is None or self._gen.device != torch.device(device):
            g = torch.Generator(device=device)
            if self._gen_state is not None:
                g.set_state(self._gen_state)
            else:
                rank = (rank if rank is not None else world_rank()) if self.per_rank else 0
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
