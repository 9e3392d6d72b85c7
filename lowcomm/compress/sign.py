"""1-bit codecs: scaled signSGD, signSGD with majority vote, error-feedback signSGD, and 1-bit
Adam's momentum codec.

Signs travel bit-packed (8 per byte, :mod:`lowcomm.compress.bits`); a sign bit set means
negative, so ``+0.0`` is sent as +1. One bit cannot say zero, so a parameter whose gradient is
zero would move by the scale (or the vote) every step: sign and sign-mv also send one bit per
parameter (segment) of the bucket, set where that parameter is all zero (``⌈S/8⌉`` bytes for S
parameters), and decode it as zero (:func:`zero_segments`; an unused layer, a dead unit's
layer). sign-mv's vote is ternary (a tie is 0); where the two-phase collective broadcasts it
and ties can happen (even K), it travels as base-3 digits, 5 per byte.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import Codec, Segment, check_finite, pieces, whole
from .scratch import BLOCK, blocks, l1_norm, scratch
from .bits import (SIGNED_INTS, pack_signs, pack_trits, packed_size, trits_size, unpack_bits,
                   unpack_signs, unpack_trits)


def zero_segments(x: torch.Tensor, segments: list[Segment]) -> list[bool]:
    """For each segment, whether flat ``x`` is all zero there (±0). One element decides a
    segment that does not start with a zero; only the others are counted."""
    if not x.numel():
        return [True] * len(segments)
    starts = [s.start if s.stop > s.start else 0 for s in segments]
    first = x[torch.tensor(starts, dtype=torch.long, device=x.device)].tolist()
    return [s.stop <= s.start or (v == 0 and not int(torch.count_nonzero(x[s.start:s.stop])))
            for s, v in zip(segments, first)]


def zero_flags(zero: list[bool], device) -> torch.Tensor:
    """``⌈S/8⌉`` uint8: bit j (least significant first) set when segment j is all zero."""
    return torch.from_numpy(np.packbits(np.array(zero, dtype=bool), bitorder="little")).to(device)


def flagged(flags: torch.Tensor, bounds: tuple) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of the segments whose bit is set in one rank's ``flags``."""
    bits = unpack_bits(flags, len(bounds))
    if not bool(bits.any()):
        return []
    return [bounds[j] for j in bits.nonzero().view(-1).tolist()]


def bounds_of(segments: list[Segment]) -> tuple:
    return tuple((s.start, s.stop) for s in segments)


def chunk_zeros(x: torch.Tensor, key: str, segments, bounds: list[int]):
    """Per chunk ``x[lo:hi]``: its pieces of the segments and, for each, whether the whole
    segment is zero (so a two-phase owner zeroes what the all-gather path zeroes)."""
    segs = segments or whole(key, x)
    zero = zero_segments(x, segs)
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        own = [(z, piece) for z, seg in zip(zero, segs) for piece in pieces([seg], lo, hi)]
        out.append(([piece for _, piece in own], [z for z, _ in own]))
    return out


def scaled_mean(scales: torch.Tensor, packed: torch.Tensor, n: int, dtype: torch.dtype, K: int,
                flags: torch.Tensor | None = None, bounds: tuple = ()) -> torch.Tensor:
    """``(1/K) Σ_k s_k·sign_k`` of K rows of packed signs; rank k's flagged segments count 0."""
    signs = unpack_signs(packed, n, dtype)           # (K, n)
    if flags is not None:
        bits = unpack_bits(flags, len(bounds))       # (K, S)
        for k, j in bits.nonzero().tolist():
            a, b = bounds[j]
            signs[k, a:b] = 0
    return (scales.view(1, K).to(dtype) @ signs).view(-1).div_(K)


def subtract_scaled_signs_(p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``p ← p − s·sign(p)`` from ``p``'s own sign bits (−0.0 negative, as :func:`pack_signs`
    reads it), so nothing is decoded. s·sign(p) is the bit pattern of ``s`` (finite, ≥ 0) with
    ``p``'s sign bit: an AND and an OR on the integer view into a scratch block (a gather from
    the sign table per packed byte took 1.6× as long)."""
    ints = SIGNED_INTS[p.element_size()]
    s_bits = int(scale.to(p.dtype).view(ints).item())
    mask = -(1 << (8 * p.element_size() - 1))      # the sign bit, as a signed integer
    pi = p.view(ints)
    sent = scratch("sign.sent", min(p.numel(), BLOCK), ints, p.device)
    for lo, hi in blocks(p.numel()):               # block by block: no full-size temporary
        m = sent[:hi - lo]
        torch.bitwise_and(pi[lo:hi], mask, out=m).bitwise_or_(s_bits)
        p[lo:hi].sub_(m.view(p.dtype))
    return p


class ScaledSign(Codec):
    """Scaled signSGD (Bernstein, Wang, Azizzadenesheli & Anandkumar 2018, arXiv 1802.04434):
    one bit per element plus one scale per bucket, the ℓ1 scale of Karimireddy et al. 2019
    (arXiv 1901.09847), ``C(x) = (‖x‖₁ / n) · sign(x)``, zero on a parameter that is all zero.

    Update, per bucket x (n elements, S parameters) on each of K ranks:
      1. ``s = ‖x‖₁ / n`` (float32), ``b = packbits(x < 0)`` (⌈n/8⌉ bytes), ``z`` = one bit per
         parameter, set where x is all zero there (⌈S/8⌉ bytes);
      2. all-gather ``(s, b, z)`` as one message;
      3. the average is ``(1/K) Σ_k s_k · sign_k``, each rank's flagged parameters counting 0
         (so a parameter whose gradient is zero on every rank does not move).

    Without error feedback this is ``sign``; wrapped in
    :class:`~lowcomm.compress.error_feedback.ErrorFeedback` it is ``ef-sign`` (Karimireddy et
    al.'s EF-SignSGD; a flagged parameter keeps its residual, zero). Bytes per rank and bucket:
    an all-gather of ``⌈n/8⌉ + 4 + ⌈S/8⌉`` bytes.

    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`, 1-bit Adam's compressed
    all-reduce, Tang et al. 2021, arXiv 2102.02888): one scale per chunk, one bit per piece of a
    parameter in the chunk; the chunk's owner re-compresses the average, for ef-sign with its
    own (server) error fed back as 1-bit Adam does (plain sign has error feedback at neither
    end); each phase sends ``(K−1)·(⌈c/8⌉ + 4 + ⌈P/8⌉)`` bytes for chunks of c elements and P
    pieces.
    """

    name, summable = "sign", False
    finite_from_reduction = True

    def __init__(self, name: str = "sign"):
        self.name = name

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.float32, (1,)), (torch.uint8, (packed_size(n),)), (torch.uint8, (packed_size(nseg),))]

    def encode(self, x, key, segments, rank=None):
        l1 = l1_norm(x)
        if not bool(torch.isfinite(l1)):           # NaN/Inf in x (or an overflowing sum)
            check_finite(x, key, segments, rank, self.name)
        segments = segments or whole(key, x)
        return self._payload(x, l1, segments, zero_segments(x, segments))

    def _payload(self, x, l1, segments, zero):
        scale = l1.div(x.numel()).float().reshape(1)
        return [scale, pack_signs(x), zero_flags(zero, x.device)], (x.numel(), x.dtype, bounds_of(segments))

    def compress_chunks(self, x, key, segments, bounds, rank=None):
        """Each chunk with its own scale; a piece is flagged where its whole parameter is zero."""
        x = x.detach().reshape(-1)
        check_finite(x, key, segments, rank, self.name)
        return [self._payload(x[lo:hi], l1_norm(x[lo:hi]), own, zero) if hi > lo else ([], None)
                for (own, zero), lo, hi in zip(chunk_zeros(x, key, segments, bounds), bounds, bounds[1:])]

    def decompress(self, payload, ctx):
        scale, packed, flags = payload
        n, dtype, bounds = ctx
        out = unpack_signs(packed, n, dtype, scale)
        for a, b in flagged(flags, bounds):
            out[a:b] = 0
        return out

    def compress_feedback_(self, p, key, segments=None, x=None, e=None, rank=None):
        """Block by block, each block used while in cache: ``p = x + e``, ‖p‖₁ and the packed
        signs; then ``p − s·sign(p)``."""
        n = p.numel()
        if p.device.type != "cpu" or n % 8 or n <= BLOCK:
            return super().compress_feedback_(p, key, segments, x, e, rank)
        p = p.detach().reshape(-1)
        segments = segments or whole(key, p)
        buf = scratch("l1", BLOCK, p.dtype, p.device)
        packed = torch.empty(n // 8, dtype=torch.uint8)
        parts = []
        for lo, hi in blocks(n):               # BLOCK is a multiple of 8: whole bytes per block
            pb = p[lo:hi] if x is None else torch.add(x[lo:hi], e[lo:hi], out=p[lo:hi])
            parts.append(torch.abs(pb, out=buf[:hi - lo]).sum())
            packed[lo // 8:hi // 8].copy_(pack_signs(pb))      # the signs need no scale
        l1 = torch.stack(parts).sum()
        if not bool(torch.isfinite(l1)):
            check_finite(p, key, segments, rank, self.name)
        scale = l1.div(n).float().reshape(1)
        payload = [scale, packed, zero_flags(zero_segments(p, segments), p.device)]
        ctx = (n, p.dtype, bounds_of(segments))
        self.subtract_decoded_(p, payload, ctx)
        return payload, ctx

    def subtract_decoded_(self, p, payload, ctx):
        """``p ← p − s·sign(p)`` (:func:`subtract_scaled_signs_`), which is ``p − D(payload)``
        for the payload that encodes ``p`` (the codec's contract), except on flagged parameters,
        which are zero in p and decode as zero: left as they are."""
        zeros = [(a, b, p[a:b].clone()) for a, b in flagged(payload[2], ctx[2])]
        subtract_scaled_signs_(p, payload[0])
        for a, b, kept in zeros:
            p[a:b] = kept
        return p

    def decompress_mean(self, gathered, ctx, K):
        scales, packed, flags = gathered                # (K, 1), (K, ⌈n/8⌉), (K, ⌈S/8⌉)
        n, dtype, bounds = ctx
        return scaled_mean(scales, packed, n, dtype, K, flags, bounds)


class SignMajorityVote(Codec):
    """signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli & Anandkumar 2019,
    arXiv 1810.05291): every rank sends only its signs; every rank takes the elementwise vote.

    Update, per bucket x (n elements, S parameters) on each of K ≥ 2 ranks:
      1. ``b_k = packbits(x_k < 0)`` (⌈n/8⌉ bytes, no scale), ``z_k`` = one bit per parameter,
         set where x_k is all zero there (⌈S/8⌉ bytes);
      2. all-gather ``(b_k, z_k)`` (every rank acts as the server: no second round);
      3. the result is ``sign(Σ_k sign(x_k))`` ∈ {-1, 0, +1}, and 0 on a parameter flagged by
         every rank (its gradient is zero everywhere: it does not move). **Tie rule** (even K
         only): a coordinate with as many +1 as -1 votes gets 0, i.e. it does not move this step.

    The result has unit magnitude: the learning rate of the wrapped optimizer sets the step
    (Signum: give that optimizer momentum, or apply the vote to momenta yourself).
    Bytes per rank and bucket: an all-gather of ``⌈n/8⌉ + ⌈S/8⌉`` bytes.

    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`; the paper's parameter
    server, sharded over the ranks): rank j receives the packed signs of chunk j from every
    rank (and one bit per piece of a parameter in it: its parameter is all zero), takes the
    vote on it, and all-gathers the voted chunk (:class:`Vote`): 1 bit per element and one per
    piece on odd K (no ties), base-3 digits (⌈c/5⌉ bytes, ties and zeros kept as 0) on even K.
    The result equals the all-gather path's bit for bit. Bytes per rank:
    ``(K−1)·(⌈c/8⌉ + ⌈P/8⌉ + (⌈c/8⌉ + ⌈P/8⌉ or ⌈c/5⌉))``, chunks of c elements and P pieces.
    """

    name, summable = "sign-mv", False

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.uint8, (packed_size(n),)), (torch.uint8, (packed_size(nseg),))]

    def encode(self, x, key, segments, rank=None):
        segments = segments or whole(key, x)
        return self._payload(x, segments, zero_segments(x, segments))

    @staticmethod
    def _payload(x, segments, zero):
        return [pack_signs(x), zero_flags(zero, x.device)], (x.numel(), x.dtype, bounds_of(segments))

    def compress_chunks(self, x, key, segments, bounds, rank=None):
        """Each chunk's signs; a piece is flagged where its whole parameter is zero."""
        x = x.detach().reshape(-1)
        check_finite(x, key, segments, rank, self.name)
        return [self._payload(x[lo:hi], own, zero) if hi > lo else ([], None)
                for (own, zero), lo, hi in zip(chunk_zeros(x, key, segments, bounds), bounds, bounds[1:])]

    def decompress(self, payload, ctx):
        n, dtype, bounds = ctx
        out = unpack_signs(payload[0], n, dtype)
        for a, b in flagged(payload[1], bounds):
            out[a:b] = 0
        return out

    def decompress_mean(self, gathered, ctx, K):
        """The vote ``sign(Σ_k sign_k)`` (int32; ties 0; 0 where every rank flagged the
        parameter), not a mean."""
        n, dtype, bounds = ctx
        votes = unpack_signs(gathered[0], n, torch.int8).sum(0, dtype=torch.int32)
        everywhere = unpack_bits(gathered[1], len(bounds)).all(0)
        for j in everywhere.nonzero().view(-1).tolist():
            a, b = bounds[j]
            votes[a:b] = 0
        return torch.sign(votes)

    def owner(self, K):
        return Vote(K)


class Vote(Codec):
    """sign-mv's voted chunks in the two-phase exchange: values in {-1, 0, +1} sent exactly, as
    packed signs plus one bit per piece (set where the vote is all zero: a parameter flagged by
    every rank) on odd K, where nothing else can tie, and as base-3 digits (5 per byte) on even
    K. Decoded with the workers' ctx ``(n, dtype, pieces)`` of that chunk."""

    name, summable = "sign-mv", False

    def __init__(self, K: int):
        self.K = K

    def payload_layout(self, n, dtype, nseg=1):
        if self.K % 2:
            return [(torch.uint8, (packed_size(n),)), (torch.uint8, (packed_size(nseg),))]
        return [(torch.uint8, (trits_size(n),))]

    def encode(self, x, key, segments, rank=None):
        segments = segments or whole(key, x)
        ctx = (x.numel(), x.dtype, bounds_of(segments))
        if self.K % 2:
            return [pack_signs(x.to(torch.float32)), zero_flags(zero_segments(x, segments), x.device)], ctx
        return [pack_trits(x)], ctx

    def decompress(self, payload, ctx):
        n, dtype, bounds = ctx
        if self.K % 2 == 0:
            return unpack_trits(payload[0], n, dtype)
        out = unpack_signs(payload[0], n, dtype)
        for a, b in flagged(payload[1], bounds):
            out[a:b] = 0
        return out


class MomentumSign(Codec):
    """1-bit Adam's codec (Tang et al. 2021, arXiv 2102.02888, Section 4.2, with DeepSpeed's
    scale ``‖·‖₂/√d``): ``C(x) = (‖x‖₂ / √d) · sign(x)``, d the elements the segments cover
    (padding excluded), packed as :class:`ScaledSign`'s payload.

    In the two-phase exchange the workers' scale is one for the whole momentum, sent with every
    chunk (:meth:`compress_chunks`); the owners re-encode their chunk with its own scale. It
    sends no zero flags: 1-bit Adam masks what has no gradient itself (from its frozen variance).
    """

    name, summable = "onebit-adam", False
    finite_from_reduction = True

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.float32, (1,)), (torch.uint8, (packed_size(n),))]

    def decompress(self, payload, ctx):
        scale, packed = payload
        n, dtype = ctx
        return unpack_signs(packed, n, dtype, scale)

    def decompress_mean(self, gathered, ctx, K):
        scales, packed = gathered
        n, dtype = ctx
        return scaled_mean(scales, packed, n, dtype, K)

    def subtract_decoded_(self, p, payload, ctx):
        return subtract_scaled_signs_(p, payload[0])

    @staticmethod
    def _covered(x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The elements of flat ``x`` the segments cover, in order (a view for a prefix: an
        owner's chunk before 1-bit Adam's padding)."""
        segs = sorted(segments, key=lambda s: s.start)
        if all(a.stop == b.start for a, b in zip(segs, segs[1:])) and (not segs or segs[0].start == 0):
            return x[:segs[-1].stop] if segs else x[:0]
        return torch.cat([x[s.start:s.stop] for s in segs])

    def encode(self, x, key, segments, rank=None):
        covered = self._covered(x, segments)
        d = covered.numel()
        scale = (torch.linalg.vector_norm(covered) / math.sqrt(d)).float().reshape(1) if d else \
            torch.zeros(1, dtype=torch.float32, device=x.device)
        if not bool(torch.isfinite(scale)):
            check_finite(x, key, segments, rank, self.name)
        return [scale, pack_signs(x)], (x.numel(), x.dtype)

    def compress_chunks(self, x, key, segments, bounds, rank=None):
        """One worker scale ``‖x‖₂/√d`` for the whole of x (uncovered elements zero), the signs
        of each chunk (whole bytes: 1-bit Adam pads to a multiple of 8K)."""
        x = x.detach().reshape(-1)
        segments = segments or whole(key, x)
        d = sum(s.stop - s.start for s in segments)
        scale = (torch.linalg.vector_norm(x) / math.sqrt(d)).float().reshape(1)
        if not bool(torch.isfinite(scale)):
            check_finite(x, key, segments, rank, self.name)
        return [([scale, pack_signs(x[lo:hi])], (hi - lo, x.dtype)) if hi > lo else ([], None)
                for lo, hi in zip(bounds, bounds[1:])]


class TensorMomentumSign(MomentumSign):
    """:class:`MomentumSign` with one scale per parameter tensor, as DeepSpeed's 1-bit
    optimizers compress each tensor on its own: ``C(x) = (‖x_s‖₂/√d_s) sign(x)`` on every
    segment s (its d_s elements); an element no segment covers (padding) decodes to 0.

    In the two-phase exchange a chunk's payload holds, for each segment piece in it, its
    tensor's worker scale (float32) and the chunk's packed signs; the owners re-encode every
    piece of their chunk with a scale of its own (DeepSpeed's server scale is per 1/K of a
    tensor; here per piece of a tensor an owner holds). Bytes of a chunk: 4 per piece plus
    ``⌈n/8⌉``."""

    name = "onebit-adam-tensor"

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.float32, (nseg,)), (torch.uint8, (packed_size(n),))]

    @staticmethod
    def _spans(segments: list[Segment] | None, n: int) -> tuple:
        """The segments' ``(start, stop)`` (None: all n elements are one tensor)."""
        return ((0, n),) if segments is None else tuple((s.start, s.stop) for s in segments)

    @staticmethod
    def _per_element(scales: torch.Tensor, n: int, spans: tuple, dtype) -> torch.Tensor:
        """``scales`` (..., pieces) spread over their spans of n elements (0 outside them)."""
        out = torch.zeros(*scales.shape[:-1], n, dtype=dtype, device=scales.device)
        for i, (a, b) in enumerate(spans):
            out[..., a:b] = scales[..., i:i + 1].to(dtype)
        return out

    def _check(self, scales, x, key, segments, rank) -> None:
        if not bool(torch.isfinite(scales).all()):
            check_finite(x, key, segments, rank, self.name)

    def encode(self, x, key, segments, rank=None):
        spans = self._spans(segments, x.numel())
        scales = torch.stack([torch.linalg.vector_norm(x[a:b]) / math.sqrt(b - a) for a, b in spans]) \
            .float() if spans else torch.zeros(0, dtype=torch.float32, device=x.device)
        self._check(scales, x, key, segments, rank)
        return [scales, pack_signs(x)], (x.numel(), x.dtype, spans)

    def decompress(self, payload, ctx):
        scales, packed = payload
        n, dtype, spans = ctx
        return unpack_signs(packed, n, dtype).mul_(self._per_element(scales, n, spans, dtype))

    def decompress_mean(self, gathered, ctx, K):
        scales, packed = gathered                      # (K, pieces), (K, ⌈n/8⌉)
        n, dtype, spans = ctx
        signs = unpack_signs(packed, n, dtype)         # (K, n)
        return signs.mul_(self._per_element(scales, n, spans, dtype)).sum(0).div_(K)

    def subtract_decoded_(self, p, payload, ctx):
        return p.sub_(self.decompress(payload, ctx).to(p.dtype))

    def compress_chunks(self, x, key, segments, bounds, rank=None):
        """Each tensor's worker scale over all of it, sent with every chunk that holds a piece
        of it; each chunk's signs."""
        x = x.detach().reshape(-1)
        segments = segments or whole(key, x)
        whole_scale = {s.name: torch.linalg.vector_norm(x[s.start:s.stop]) / math.sqrt(s.stop - s.start)
                       for s in segments}
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            if hi <= lo:
                out.append(([], None))
                continue
            own = pieces(segments, lo, hi)
            scales = torch.stack([whole_scale[s.name] for s in own]).float().reshape(-1) if own else \
                torch.zeros(0, dtype=torch.float32, device=x.device)
            self._check(scales, x, key, segments, rank)
            out.append(([scales, pack_signs(x[lo:hi])], (hi - lo, x.dtype, self._spans(own, 0))))
        return out
