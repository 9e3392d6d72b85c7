"""Quantisation to a few bits per element: blockwise scaled int8/int4 and QSGD (gathered, then
decoded)."""
from __future__ import annotations

import torch

from .base import Codec, Seeded, check_finite
from .bits import pack_uints, uints_size, unpack_uints
from .scratch import BLOCK, blocks, scratch


#: elements sharing one scale in the blockwise quantisers (ZeRO++'s qgZ/qwZ use blocks of a few
#: thousand elements: a scale per 4 MiB bucket rounded every gradient of a tensor 10^4 times
#: smaller than the bucket's largest to zero)
QUANT_BLOCK = 2048


def quantize_blocks(x: torch.Tensor, bits: int, block: int = QUANT_BLOCK):
    """Symmetric blockwise quantisation of flat ``x`` to ``bits`` (8 or 4) per element:
    ``(q, scales)``, one float32 scale ``max|x_b| / L`` (L = 2^(bits−1) − 1) per block of
    ``block`` elements (the last one short) and ``q_i = round(x_i / s_b)`` in [−L, L]: int8 for
    8 bits; for 4 bits ``q + 8`` packed two to a byte (uint8, low nibble first). A block whose
    scale is 0 is all zeros. The error per element is at most ``s_b / 2``."""
    n, levels = x.numel(), (1 << (bits - 1)) - 1
    block = min(block, max(n, 1))          # one block for all: no padding to a larger one
    nb = -(-n // block)
    wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    full = n // block
    amax = torch.empty(nb, dtype=wdt, device=x.device)
    if full:
        torch.amax(x[:full * block].view(full, block).abs(), dim=1, out=amax[:full])
    if nb > full:
        amax[full] = x[full * block:].abs().max()
    scales = (amax / levels).to(torch.float32)
    denom = torch.where(scales > 0, scales, torch.ones_like(scales)).to(wdt)
    q = torch.empty(nb * block, dtype=wdt, device=x.device)
    q[:n].copy_(x)
    q[n:].zero_()
    q = q.view(nb, block).div_(denom[:, None]).round_().clamp_(-levels, levels).view(-1)[:n]
    if bits == 8:
        return q.to(torch.int8), scales
    nib = torch.zeros(n + n % 2, dtype=torch.uint8, device=x.device)
    nib[:n].copy_(q.add_(8))
    return nib[0::2] | (nib[1::2] << 4), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, n: int, bits: int,
                      block: int = QUANT_BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_blocks` for rows: ``q`` (R, bytes) and ``scales`` (R,
    blocks) -> (R, n) in ``dtype``, each row decoded with its own scales."""
    rows = q.shape[0]
    block = min(block, max(n, 1))          # as quantize_blocks: a block never longer than x
    if bits == 4:
        nib = torch.empty(rows, 2 * q.shape[1], dtype=torch.uint8, device=q.device)
        nib[:, 0::2] = q & 15
        nib[:, 1::2] = q >> 4
        q = nib[:, :n].view(torch.int8).sub_(8)
    nb = scales.shape[1]
    out = torch.zeros(rows, nb * block, dtype=dtype, device=q.device)
    out[:, :n].copy_(q[:, :n])
    out.view(rows, nb, block).mul_(scales.to(dtype)[:, :, None])
    return out[:, :n]


class BlockQuant(Codec):
    """Blockwise scaled int8 or int4 (as ZeRO++'s qgZ, Wang et al. 2023, arXiv 2306.10209,
    quantises gradients): one float32 scale per block of ``block`` elements.

    Update, per bucket x (n elements) on each of K ranks, with L = 127 (int8) or 7 (int4):

      1. per block b of ``block`` elements: ``s_b = max|x_b| / L`` (``s_b = 0``: all zeros);
      2. ``q_i = round(x_i / s_b)`` (round half to even) in [−L, L] — int8, or packed two to a
         byte for int4 — so ``|x_i − s_b q_i| ≤ s_b / 2``;
      3. all-gather ``(q, s)``; the average is ``(1/K) Σ_k s_{k,b} q_{k,i}``.

    A scale per block, not per bucket: one scale for a 4 MiB bucket rounded to zero the
    gradients of every tensor in it 10^4 times smaller than its largest (a small BERT
    classifier under the Trainer then hardly learned).

    Bytes per rank and bucket: an all-gather of ``n·bits/8 + 4⌈n/block⌉``; with the two-phase
    collective (:class:`~lowcomm.compress.twophase.TwoPhase`: each chunk quantised on its own,
    the owner re-quantises its chunk's average) about ``2(K−1)/K`` of that.

    Example::

        payload, ctx = BlockQuant(8).compress(x, "w")     # [int8 q, float32 scales]
        avg = Compressor(BlockQuant(4), "two-phase").reduce(flat, "bucket0", comm, segments)
    """

    summable = False
    finite_from_reduction = True

    def __init__(self, bits: int = 8, block: int = QUANT_BLOCK):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        if int(block) < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.bits, self.block = bits, int(block)
        self.name = f"int{bits}"

    def nbytes(self, n: int) -> int:
        """Payload bytes for ``n`` elements."""
        return (n if self.bits == 8 else (n + 1) // 2) + 4 * -(-n // self.block)

    def payload_layout(self, n, dtype, nseg=1):
        q = (torch.int8, (n,)) if self.bits == 8 else (torch.uint8, ((n + 1) // 2,))
        return [q, (torch.float32, (-(-n // self.block),))]

    def encode(self, x, key, segments, rank=None):
        q, scales = quantize_blocks(x, self.bits, self.block)
        if not bool(torch.isfinite(scales).all()):     # NaN/Inf in x
            check_finite(x, key, segments, rank, self.name)
        return [q, scales], (x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        q, scales = payload
        n, dtype = ctx
        return dequantize_blocks(q[None], scales[None], n, self.bits, self.block, dtype)[0]

    def decompress_mean(self, gathered, ctx, K):
        q, scales = gathered                     # (K, bytes), (K, blocks)
        n, dtype = ctx
        return dequantize_blocks(q, scales, n, self.bits, self.block, dtype).mean(0)


#: size L of the table of stratified uniforms behind QSGD's random rounding (see QSGD.uniforms)
UNIFORM_TABLE = 1 << 18
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def shifted_table(dtype: torch.dtype, device: torch.device, shift: int) -> torch.Tensor:
    """:func:`uniform_table` + ``shift`` (cached)."""
    key = (dtype, torch.device(device), shift)
    if key not in _TABLES:
        _TABLES[key] = uniform_table(dtype, device) + shift
    return _TABLES[key]


def uniform_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The L = :data:`UNIFORM_TABLE` points ``(j + ½)/L``, j = 0..L−1, in a fixed random order,
    twice over (so any cyclic window of at most L entries is one contiguous slice). The same on
    every rank and run."""
    key = (dtype, torch.device(device))
    if key not in _TABLES:
        g = torch.Generator().manual_seed(0x5EED)
        t = (torch.randperm(UNIFORM_TABLE, generator=g, dtype=torch.float64) + 0.5) / UNIFORM_TABLE
        _TABLES[key] = torch.cat([t, t]).to(dtype=dtype, device=device)
    return _TABLES[key]


class QSGD(Seeded, Codec):
    """QSGD stochastic quantisation (Alistarh, Grubic, Li, Tomioka & Vojnovic 2017,
    arXiv 1610.02132), with ``s = levels`` levels per norm bucket of ``bucket_size`` elements.

    Update, per reducer bucket split into norm buckets v of ``bucket_size`` elements (the last one
    zero-padded), on each of K ranks:

      1. ``a_i = |v_i| / ‖v‖₂ · s`` ∈ [0, s];
      2. ``ℓ_i = ⌊a_i + u_i⌋`` with ``u_i`` uniform on [0, 1) (so ℓ_i = ⌈a_i⌉ with probability
         a_i − ⌊a_i⌋: unbiased), and ``q_i = sign(v_i) ℓ_i`` as int8 — computed as
         ``q_i = ⌊sign(v_i)·a_i + u_i⌋``, which has the same distribution (rounded away from
         zero with probability frac(a_i)) in one fused pass: ``y = (u_i + s + 1) + v_i·s/‖v‖₂``
         in (0, 2s + 2), ``q_i = trunc(y) − (s + 1)``;
      3. all-gather ``(q, ‖v‖₂ per norm bucket)``; decode ``Q(v)_i = ‖v‖₂ / s · q_i`` and
         average over ranks. ``E[Q(v)] = v``.

    The paper's Elias coding of the levels is replaced by fixed-width int8 (so ``levels`` ≤ 127).
    Bytes per rank and reducer bucket of n elements: an all-gather of
    ``n + 4·⌈n / bucket_size⌉`` bytes.

    The cheap random numbers (a Cranley–Patterson-style random shift of a fixed point set):
    drawing n uniforms from ``torch.Generator`` costs more than the whole quantisation, so
    ``u`` is read from a fixed table T of the L = 2^18 stratified points ``(j + ½)/L`` in random
    order (:func:`uniform_table`) at a random cyclic offset per block of about 2^16 elements,
    drawn from this rank's generator (state saved, so a resumed run draws the same). Each u_i is
    uniform on those L points given everything before, so ``E[Q(v)] = v`` up to the grid's
    ≤ 1/(2L) of a level (float32 rounding of a_i is of the same order) and the paper's variance
    bound holds (y's float32 rounding adds at most 2^-16 of a level); the u_i of one block are
    not independent of each other (a window of one fixed permutation), which neither property
    needs. :meth:`uniforms` returns them.
    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`): every chunk quantised on its
    own, the owner re-quantises its chunk's average with fresh u (unbiased again: no server
    error), so each phase sends ``(K−1)·(c + 4⌈c/bucket_size⌉)`` for chunks of c elements.

    Args:
        levels: s ≥ 1 (≤ 127).
        bucket_size: elements sharing one norm (the paper's bucket size d).
        seed: generator seed (mixed with the rank).
    """

    name, summable, unbiased = "qsgd", False, True
    finite_from_reduction = True

    def __init__(self, levels: int = 16, bucket_size: int = 512, seed: int = 0):
        if not 1 <= int(levels) <= 127:
            raise ValueError(f"QSGD levels must be in [1, 127] (int8 levels), got {levels}")
        if int(bucket_size) < 1:
            raise ValueError(f"QSGD bucket_size must be >= 1, got {bucket_size}")
        self.levels, self.bucket_size = int(levels), int(bucket_size)
        self._init_rng(seed)

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.int8, (n,)), (torch.float32, (-(-n // self.bucket_size),))]

    def block(self) -> int:
        """Elements per block of the fused pass: whole norm buckets, about BLOCK elements (BLOCK
        itself when a norm bucket is larger)."""
        bs = self.bucket_size
        return bs * (BLOCK // bs) if bs <= BLOCK else BLOCK

    def _offsets(self, n: int, device, rank: int | None) -> list[int]:
        """One table offset per block, from this rank's generator (state saved)."""
        nblocks = -(-n // self.block())
        return torch.randint(0, UNIFORM_TABLE, (nblocks,), generator=self.generator(device, rank),
                             device=device).tolist()

    def uniforms(self, n: int, device="cpu", dtype=torch.float32, rank: int | None = None) -> torch.Tensor:
        """The ``u`` of step 2 for ``n`` elements, drawn as :meth:`encode` draws them (and
        advancing the generator alike): ``u_{b,i} = T[o_b + i]``, T :func:`uniform_table`, one
        offset ``o_b`` per block b of :meth:`block` elements (``rank`` seeds a new generator)."""
        table = uniform_table(dtype, device)
        return torch.cat([table[o:o + hi - lo] for o, (lo, hi) in
                          zip(self._offsets(n, device, rank), blocks(n, self.block()))] or [table[:0]])

    def encode(self, x, key, segments, rank=None):
        n, bs, s = x.numel(), self.bucket_size, self.levels
        wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        nbk, full = -(-n // bs), n // bs
        norms = torch.empty(nbk, dtype=wdt, device=x.device)
        if full:
            torch.linalg.vector_norm(x[:full * bs].view(full, bs), dim=1, dtype=wdt, out=norms[:full])
        if nbk > full:          # the last, short bucket (zero padding adds nothing to its norm)
            norms[full] = torch.linalg.vector_norm(x[full * bs:], dtype=wdt)
        if not bool(torch.isfinite(norms).all()):    # NaN/Inf in x (or an overflowing norm)
            check_finite(x, key, segments, rank, self.name)
        mult = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        C, K = self.block(), s + 1
        table = shifted_table(wdt, x.device, K)      # u + K: y = a + u + K ∈ (0, 2s + 2)
        q = torch.empty(n, dtype=torch.uint8, device=x.device)
        y = scratch("qsgd.y", min(C, n), wdt, x.device)
        for o, (lo, hi) in zip(self._offsets(n, x.device, rank), blocks(n, C)):
            m = hi - lo
            v, yb, u = x[lo:hi], y[:hi - lo], table[o:o + hi - lo]
            w = m - m % bs if lo % bs == 0 else 0     # whole buckets: y = u + K + v·s/‖v‖, row by row
            if w:
                torch.addcmul(u[:w].view(w // bs, bs), v[:w].view(w // bs, bs),
                              mult[lo // bs:(lo + w) // bs, None], out=yb[:w].view(w // bs, bs))
            if w < m and (lo + w) // bs == (hi - 1) // bs:     # the rest lies in one bucket
                torch.addcmul(u[w:], v[w:], mult[(lo + w) // bs], out=yb[w:])
            elif w < m:                               # blocks not aligned to buckets (bs > BLOCK)
                torch.addcmul(u[w:], v[w:], mult[torch.arange(lo + w, hi, device=x.device) // bs],
                              out=yb[w:])
            # ⌊a + u⌋ + K = trunc(y) (y > 0); the clamp keeps ℓ in [−s, s] where a rounds past ±s
            q[lo:hi].copy_(yb.clamp_(1, 2 * s + 1))
        q.sub_(K)                                     # uint8 wraps: the int8 bits of ⌊a + u⌋
        return [q.view(torch.int8), norms.to(torch.float32)], (n, x.dtype)

    def decompress(self, payload, ctx):
        q, norms = payload
        n, dtype = ctx
        return self._decode(q[None], norms[None], n, dtype)[0]

    def _decode(self, q, norms, n, dtype):
        """Rows of levels ``q`` (K, n) times their bucket's step ‖v‖/s (``norms`` (K, buckets)),
        in place in one new (K, n) tensor (the last bucket may be short: no padding)."""
        bs, full = self.bucket_size, n // self.bucket_size
        out = torch.empty(q.shape, dtype=dtype, device=q.device).copy_(q)
        step = norms.to(dtype) / self.levels
        if full:
            out[:, :full * bs].view(-1, full, bs).mul_(step[:, :full, None])
        if n > full * bs:
            out[:, full * bs:].mul_(step[:, full, None])
        return out

    def decompress_mean(self, gathered, ctx, K):
        q, norms = gathered
        n, dtype = ctx
        return self._decode(q, norms, n, dtype).mean(0)

    def state_dict(self):
        return self.rng_state()

    def load_state_dict(self, state):
        self.load_rng_state(state)


#: the statistical quantiser's range, in standard deviations (the authors' reference code's default)
STAT_RANGE = 6.0


def stat_quantize(x: torch.Tensor, bits: int, block: int = QUANT_BLOCK, spread: float = STAT_RANGE):
    """The statistical quantiser of the SparseLoCo/MuLoCo authors' reference code (Templar's
    ``TopKCompressor._quantize``), per block of ``block`` elements of flat ``x``, L = 2^bits bins:
    ``(codes, table)``.

      1. shift μ_b = mean of the block, c = x − μ_b, σ_b = its standard deviation (unbiased);
      2. bin width w_b = spread·σ_b / L (1 where that is 0), ``code = clamp(round(c/w_b + L/2), 0, L−1)``;
      3. the table's row b holds μ_b and, for each bin, the mean of the c that fell in it (0 for
         an empty bin): the decoded value of a code is ``μ_b + mean_b[code]``.

    ``codes`` are int64 in [0, L) (n of them); ``table`` float32 ``(⌈n/block⌉, 1 + L)``."""
    n, levels = x.numel(), 1 << bits
    block = min(block, max(n, 1))
    nb = -(-n // block)
    wdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = torch.zeros(nb * block, dtype=wdt, device=x.device)
    v[:n] = x
    valid = torch.zeros(nb * block, dtype=wdt, device=x.device)
    valid[:n] = 1
    v, valid = v.view(nb, block), valid.view(nb, block)
    count = valid.sum(1)
    shift = v.sum(1) / count
    c = (v - shift[:, None]) * valid
    std = (c.square().sum(1) / (count - 1).clamp(min=1)).sqrt()
    width = spread * std / levels
    width = torch.where((width > 0) & torch.isfinite(width), width, torch.ones_like(width))
    codes = (c / width[:, None] + levels // 2).round_().clamp_(0, levels - 1).to(torch.int64)
    sums = torch.zeros(nb, levels, dtype=wdt, device=x.device).scatter_add_(1, codes, c)
    hits = torch.zeros(nb, levels, dtype=wdt, device=x.device).scatter_add_(1, codes, valid)
    means = torch.where(hits > 0, sums / hits.clamp(min=1), torch.zeros_like(sums))
    table = torch.cat([shift[:, None], means], 1).to(torch.float32)
    return codes.view(-1)[:n], table


def stat_dequantize(codes: torch.Tensor, table: torch.Tensor, n: int, block: int = QUANT_BLOCK,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`stat_quantize` for rows: ``codes`` (R, n) and ``table`` (R, blocks,
    1 + L) -> (R, n) in ``dtype``, each row decoded with its own table."""
    block = min(block, max(n, 1))
    levels = table.shape[-1] - 1
    which = torch.arange(n, device=codes.device) // block                  # the block of each element
    rows = table.to(dtype)
    means = rows[:, :, 1:].reshape(rows.shape[0], -1)
    picked = means.gather(1, which * levels + codes.long())
    return picked.add_(rows[:, :, 0].index_select(1, which))


class StatQuant(Codec):
    """Dense b-bit statistical quantisation (:func:`stat_quantize`), the pseudo-gradient
    compressor of MuLoCo's error-feedback variant (Thérien et al. 2025, arXiv 2505.23725, with
    error feedback around it): per block of ``block`` elements a mean, L = 2^b bins of width
    6σ/L around it, each bin decoded as the mean of the values that fell in it.

    Update, per bucket x (n elements) on each of K ranks:

      1. ``(codes, table) = stat_quantize(x, b)``; codes packed b bits each;
      2. all-gather ``(codes, table)``; the average is ``(1/K) Σ_k table_k[codes_k]``.

    Bytes per rank and bucket: an all-gather of ``⌈n·b/8⌉ + 4·(1 + 2^b)·⌈n/block⌉``.

    Args:
        bits: b in {1, 2, 4} (2 for MuLoCo's variant).
        block: elements sharing one table.
    """

    summable = False

    def __init__(self, bits: int = 2, block: int = QUANT_BLOCK):
        if bits not in (1, 2, 4):
            raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
        if int(block) < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.bits, self.block = int(bits), int(block)
        self.name = f"stat{bits}"

    def payload_layout(self, n, dtype, nseg=1):
        return [(torch.uint8, (uints_size(n, self.bits),)),
                (torch.float32, (-(-n // min(self.block, max(n, 1))), 1 + (1 << self.bits)))]

    def encode(self, x, key, segments, rank=None):
        codes, table = stat_quantize(x, self.bits, self.block)
        return [pack_uints(codes, self.bits), table], (x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        return self.decompress_mean([t.unsqueeze(0) for t in payload], ctx, 1)

    def decompress_mean(self, gathered, ctx, K):
        packed, table = gathered
        n, dtype = ctx
        codes = unpack_uints(packed, n, self.bits)
        return stat_dequantize(codes, table, n, self.block, dtype).mean(0)
