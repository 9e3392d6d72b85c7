"""Quantisation to a few bits per element: scaled int8 and QSGD (gathered, then decoded)."""
from __future__ import annotations

import torch

from .base import Compressor, Seeded


class Int8(Compressor):
    """Per-bucket scaled int8: one float32 scale per bucket, one byte per element.

    Update, per bucket x (n elements) on each of K ranks:
      1. ``s = max|x| / 127`` (``s = 0``: all zeros);
      2. ``q = round(x / s)`` (round half to even) as int8, in [-127, 127];
      3. all-gather ``(q, s)``; the average is ``(1/K) Σ_k s_k q_k``.
    Bytes per rank and bucket: an all-gather of ``n + 4`` bytes; with the two-phase collective
    (:func:`~lowcomm.compress.twophase.two_phase_reduce`, one scale per chunk, the owner
    re-quantises the chunk's average; its rounding error is fed back only under
    ``error_feedback = true``) ``(K−1)·2·(⌈n/K⌉ + 4)`` at most.

    Example::

        payload, ctx = Int8().compress(x, "w")     # [int8 q, float32 s]
    """

    name, summable, horovod, two_phase = "int8", False, False, True

    def payload_nbytes(self, n, dtype):
        return n + 4

    def _compress(self, x, key, segments):
        scale = (x.abs().max().float() / 127).reshape(1)
        w = x if x.dtype == torch.float64 else x.float()
        denom = torch.where(scale > 0, scale, torch.ones_like(scale)).to(w.dtype)
        q = torch.round(w / denom).to(torch.int8)
        return [q, scale], x.dtype

    def decompress(self, payload, ctx):
        q, scale = payload
        return q.to(ctx) * scale.to(ctx)

    def decompress_mean(self, gathered, ctx, K):
        q, scales = gathered                               # (K, n) int8, (K, 1) float32
        return (scales.view(1, K).to(ctx) @ q.to(ctx)).view(-1).div_(K)


class QSGD(Seeded, Compressor):
    """QSGD stochastic quantisation (Alistarh, Grubic, Li, Tomioka & Vojnovic 2017,
    arXiv 1610.02132), with ``s = levels`` levels per norm bucket of ``bucket_size`` elements.

    Update, per reducer bucket split into norm buckets v of ``bucket_size`` elements (the last one
    zero-padded), on each of K ranks:
      1. ``a_i = |v_i| / ‖v‖₂ · s`` ∈ [0, s];
      2. ``ℓ_i = ⌊a_i + u_i⌋`` with ``u_i ~ U[0, 1)`` (so ℓ_i = ⌈a_i⌉ with probability
         a_i − ⌊a_i⌋: unbiased), and ``q_i = sign(v_i) ℓ_i`` as int8;
      3. all-gather ``(q, ‖v‖₂ per norm bucket)``; decode ``Q(v)_i = ‖v‖₂ / s · q_i`` and
         average over ranks. ``E[Q(v)] = v``.
    The paper's Elias coding of the levels is replaced by fixed-width int8 (so ``levels`` ≤ 127).
    Bytes per rank and reducer bucket of n elements: an all-gather of
    ``n + 4·⌈n / bucket_size⌉`` bytes. ``u`` comes from this rank's generator (state saved).
    Two-phase (:func:`~lowcomm.compress.twophase.two_phase_reduce`): every chunk quantised on its
    own, the owner re-quantises its chunk's average with fresh u (unbiased again: no server
    error), so each phase sends ``(K−1)·(c + 4⌈c/bucket_size⌉)`` for chunks of c elements.

    Args:
        levels: s ≥ 1 (≤ 127).
        bucket_size: elements sharing one norm (the paper's bucket size d).
        seed: generator seed (mixed with the rank).
    """

    name, summable, horovod, two_phase, unbiased = "qsgd", False, False, True, True

    def __init__(self, levels: int = 16, bucket_size: int = 512, seed: int = 0):
        super().__init__()
        if not 1 <= int(levels) <= 127:
            raise ValueError(f"QSGD levels must be in [1, 127] (int8 levels), got {levels}")
        if int(bucket_size) < 1:
            raise ValueError(f"QSGD bucket_size must be >= 1, got {bucket_size}")
        self.levels, self.bucket_size = int(levels), int(bucket_size)
        self._init_rng(seed)

    def payload_nbytes(self, n, dtype):
        return n + 4 * -(-n // self.bucket_size)

    def _compress(self, x, key, segments):
        n, bs, s = x.numel(), self.bucket_size, self.levels
        nbk = -(-n // bs)
        v = torch.zeros(nbk * bs, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype,
                        device=x.device)
        v[:n] = x
        v = v.view(nbk, bs)
        norms = torch.linalg.vector_norm(v, dim=1, keepdim=True)
        a = v.abs().mul_(torch.where(norms > 0, s / norms, torch.zeros_like(norms)))
        u = torch.rand(a.shape, generator=self.generator(x.device), dtype=a.dtype, device=a.device)
        lev = a.add_(u).floor_().clamp_(max=s)
        q = lev.mul_(torch.sign(v)).view(-1)[:n].to(torch.int8)
        return [q, norms.view(-1).float()], (n, x.dtype)

    def decompress(self, payload, ctx):
        q, norms = payload
        n, dtype = ctx
        return self._decode(q.unsqueeze(0), norms.unsqueeze(0), n, dtype)[0]

    def _decode(self, q, norms, n, dtype):
        K, bs = q.shape[0], self.bucket_size
        nbk = norms.shape[1]
        full = torch.zeros(K, nbk * bs, dtype=dtype, device=q.device)
        full[:, :n] = q
        full = full.view(K, nbk, bs).mul_((norms.to(dtype) / self.levels).unsqueeze(-1))
        return full.view(K, -1)[:, :n]

    def decompress_mean(self, gathered, ctx, K):
        q, norms = gathered
        n, dtype = ctx
        return self._decode(q, norms, n, dtype).mean(0)

    def state_dict(self):
        return self.rng_state()

    def load_state_dict(self, state):
        self.load_rng_state(state)
