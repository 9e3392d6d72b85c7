"""1-bit codecs: scaled signSGD, signSGD with majority vote, error-feedback signSGD, and 1-bit
Adam's momentum codec.

Signs travel bit-packed (8 per byte, :mod:`lowcomm.compress.bits`); a sign bit set means
negative, so ``+0.0`` is sent as +1. sign-mv's vote is ternary (a tie is 0); where the
two-phase collective broadcasts it and ties can happen (even K), it travels as base-3 digits,
5 per byte.
"""
from __future__ import annotations

import math

import torch

from .base import Codec, Segment, check_finite, whole
from .scratch import BLOCK, blocks, l1_norm, scratch
from .bits import SIGNED_INTS, pack_signs, pack_trits, packed_size, trits_size, unpack_signs, unpack_trits


class ScaledSign(Codec):
    """Scaled signSGD (Bernstein, Wang, Azizzadenesheli & Anandkumar 2018, arXiv 1802.04434):
    one bit per element plus one scale per bucket, the ℓ1 scale of Karimireddy et al. 2019
    (arXiv 1901.09847), ``C(x) = (‖x‖₁ / n) · sign(x)``.

    Update, per bucket x (n elements) on each of K ranks:
      1. ``s = ‖x‖₁ / n`` (float32), ``b = packbits(x < 0)`` (⌈n/8⌉ bytes);
      2. all-gather ``(s, b)`` as one message;
      3. the average is ``(1/K) Σ_k s_k · sign_k``.
    Without error feedback this is ``sign``; wrapped in
    :class:`~lowcomm.compress.error_feedback.ErrorFeedback` it is ``ef-sign`` (Karimireddy et
    al.'s EF-SignSGD). Bytes per rank and bucket: an all-gather of ``⌈n/8⌉ + 4`` bytes.

    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`, 1-bit Adam's compressed
    all-reduce, Tang et al. 2021, arXiv 2102.02888): one scale per chunk; the chunk's owner
    re-compresses the average, for ef-sign with its own (server) error fed back as 1-bit Adam
    does (plain sign has error feedback at neither end); each phase sends
    ``(K−1)·(⌈c/8⌉ + 4)`` bytes for chunks of c elements.
    """

    name, summable = "sign", False
    finite_from_reduction = True

    def __init__(self, name: str = "sign"):
        self.name = name

    def payload_layout(self, n, dtype):
        return [(torch.float32, (1,)), (torch.uint8, (packed_size(n),))]

    def encode(self, x, key, segments, rank=None):
        l1 = l1_norm(x)
        if not bool(torch.isfinite(l1)):           # NaN/Inf in x (or an overflowing sum)
            check_finite(x, key, segments, rank, self.name)
        scale = l1.div(x.numel()).float().reshape(1)
        return [scale, pack_signs(x)], (x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        scale, packed = payload
        n, dtype = ctx
        return unpack_signs(packed, n, dtype, scale)

    def compress_feedback_(self, p, key, segments=None, x=None, e=None, rank=None):
        """Block by block, each block used while in cache: ``p = x + e``, ‖p‖₁ and the packed
        signs; then ``p − s·sign(p)``."""
        n = p.numel()
        if p.device.type != "cpu" or n % 8 or n <= BLOCK:
            return super().compress_feedback_(p, key, segments, x, e, rank)
        p = p.detach().reshape(-1)
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
        self.subtract_decoded_(p, [scale, packed], (n, p.dtype))
        return [scale, packed], (n, p.dtype)

    def subtract_decoded_(self, p, payload, ctx):
        """``p ← p − s·sign(p)``, which is ``p − D(payload)`` for the payload that encodes ``p``
        (the method's contract): each sign is ``p``'s own sign bit (−0.0 negative, as
        :func:`pack_signs` reads it), so nothing is decoded. s·sign(p) is the bit pattern of
        ``s`` (finite, ≥ 0) with ``p``'s sign bit: an AND and an OR on the integer view into a
        scratch block (a gather from the sign table per packed byte took 1.6× as long)."""
        scale = payload[0]
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

    def decompress_mean(self, gathered, ctx, K):
        scales, packed = gathered                       # (K, 1), (K, ⌈n/8⌉)
        n, dtype = ctx
        signs = unpack_signs(packed, n, dtype)           # (K, n)
        return (scales.view(1, K).to(dtype) @ signs).view(-1).div_(K)


class SignMajorityVote(Codec):
    """signSGD with majority vote (Bernstein, Zhao, Azizzadenesheli & Anandkumar 2019,
    arXiv 1810.05291): every rank sends only its signs; every rank takes the elementwise vote.

    Update, per bucket x (n elements) on each of K ≥ 2 ranks:
      1. ``b_k = packbits(x_k < 0)`` (⌈n/8⌉ bytes, no scale);
      2. all-gather the packed signs (every rank acts as the server: no second round);
      3. the result is ``sign(Σ_k sign(x_k))`` ∈ {-1, 0, +1}. **Tie rule** (even K only): a
         coordinate with as many +1 as -1 votes gets 0, i.e. it does not move this step.
    The result has unit magnitude: the learning rate of the wrapped optimizer sets the step
    (Signum: give that optimizer momentum, or apply the vote to momenta yourself).
    Bytes per rank and bucket: an all-gather of ``⌈n/8⌉`` bytes.

    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`; the paper's parameter
    server, sharded over the ranks): rank j receives the packed signs of chunk j from every
    rank, takes the vote on it, and all-gathers the voted chunk: 1 bit per element on odd K
    (no ties), base-3 digits (⌈c/5⌉ bytes, ties kept as 0) on even K. The result equals the
    all-gather path's bit for bit. Bytes per rank: ``(K−1)·(⌈c/8⌉ + ⌈c/8⌉ or ⌈c/5⌉)``.
    """

    name, summable = "sign-mv", False

    def payload_layout(self, n, dtype):
        return [(torch.uint8, (packed_size(n),))]

    def encode(self, x, key, segments, rank=None):
        return [pack_signs(x)], (x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        n, dtype = ctx
        return unpack_signs(payload[0], n, dtype)

    def decompress_mean(self, gathered, ctx, K):
        """The vote ``sign(Σ_k sign_k)`` (int32; ties 0), not a mean."""
        n, dtype = ctx
        votes = unpack_signs(gathered[0], n, torch.int8).sum(0, dtype=torch.int32)
        return torch.sign(votes)

    def owner(self, K):
        return Vote(K)


class Vote(Codec):
    """sign-mv's voted chunks in the two-phase exchange: values in {-1, 0, +1} sent exactly, as
    packed signs on odd K (no ties) and as base-3 digits (5 per byte) on even K. Decoded with
    the workers' ctx ``(n, dtype)``."""

    name, summable = "sign-mv", False

    def __init__(self, K: int):
        self.K = K

    def payload_layout(self, n, dtype):
        return [(torch.uint8, (packed_size(n) if self.K % 2 else trits_size(n),))]

    def encode(self, x, key, segments, rank=None):
        if self.K % 2:
            return [pack_signs(x.to(torch.float32))], (x.numel(), x.dtype)
        return [pack_trits(x)], (x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        n, dtype = ctx
        if self.K % 2:
            return unpack_signs(payload[0], n, dtype)
        return unpack_trits(payload[0], n, dtype)


class MomentumSign(ScaledSign):
    """1-bit Adam's codec (Tang et al. 2021, arXiv 2102.02888, Section 4.2, with DeepSpeed's
    scale ``‖·‖₂/√d``): ``C(x) = (‖x‖₂ / √d) · sign(x)``, d the elements the segments cover
    (padding excluded), packed as :class:`ScaledSign`'s payload.

    In the two-phase exchange the workers' scale is one for the whole momentum, sent with every
    chunk (:meth:`compress_chunks`); the owners re-encode their chunk with its own scale.
    """

    name = "onebit-adam"

    def __init__(self):
        super().__init__("onebit-adam")

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

    compress_feedback_ = Codec.compress_feedback_

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
