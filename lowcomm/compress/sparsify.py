"""Sparsification: send k of n elements (top-k: gathered values + indices; random-k: values at
indices every rank draws alike, all-reduced). Both are meant for error feedback (on by default)."""
from __future__ import annotations

import numpy as np
import torch

from .base import Codec, Seeded
from .scratch import BLOCK, blocks, scratch


def kept(n: int, ratio: float) -> int:
    """Elements kept of ``n``: ``k = max(1, ⌊ratio · n⌋)``."""
    return max(1, int(ratio * n))


def _check_ratio(ratio: float) -> float:
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return float(ratio)


#: top_indices selects through a sampled threshold when n ≥ SAMPLED_MIN and k ≤ SAMPLED_MAX_SHARE·n
SAMPLED_MIN = 1 << 16
SAMPLED_MAX_SHARE = 0.05
#: elements in the threshold's sample (every stride-th, stride a prime) and the safety margin
SAMPLE = 1 << 16
_PRIMES = (7, 13, 31, 61, 127, 251, 509, 1021, 2039, 4093, 8191)
_stats = {"sampled": 0, "retries": 0, "full": 0}     # how top_indices went (tests, benchmarks)


def sample_stride(n: int) -> int:
    """The stride of :func:`top_indices`' sample: the largest of a few primes leaving at least
    :data:`SAMPLE` elements (7 at the least)."""
    return next((p for p in reversed(_PRIMES) if n // p >= SAMPLE), _PRIMES[0])


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, in no particular order) of the ``k`` largest ``|x_i|`` of flat ``x``: the
    same set as ``x.abs().topk(k).indices`` (up to the order among equal magnitudes).

    For a large x with a small k it selects as Deep Gradient Compression does (Lin et al. 2018,
    arXiv 1712.01887, Section 3: "sample only 0.1% to 1% of the gradients" to estimate the
    threshold), but stays exact:

      1. estimate the magnitude threshold t from a sample of about 2^16 elements (every
         stride-th, the stride a prime, so no row structure aligns with it) as the sample's
         j-th largest, j ≈ (k/n)·|sample| plus four standard deviations plus 10 %;
      2. one pass: the candidates ``C = {i : |x_i| ≥ t}`` (typically 1.1–1.3 k of them);
      3. if ``|C| ≥ k`` (then C holds every one of the k largest), exact top-k among C;
         otherwise (the estimate was too high; rare) the same with a lower t, and after two
         misses an exact ``topk`` of all of |x|.

    The sample only decides how fast this is, never which indices come out."""
    n = x.numel()
    if n < SAMPLED_MIN or k > SAMPLED_MAX_SHARE * n or x.device.type != "cpu" or \
            x.dtype not in (torch.float32, torch.float64, torch.float16):
        return x.abs().topk(k, sorted=False).indices
    sample = x[::sample_stride(n)].abs()
    m = sample.numel()
    expect = k / n * m
    j = min(m, int(1.1 * expect + 4 * expect ** 0.5) + 1)
    xn = x.numpy()
    absb = scratch("topk.abs", min(n, BLOCK), x.dtype, x.device).numpy()
    mask = scratch("topk.mask", min(n, BLOCK), torch.bool, x.device).numpy()
    for attempt in range(3):
        t = float(sample.topk(j, sorted=False).values.min())
        found = []
        for lo, hi in blocks(n):            # |x| ≥ t block by block: no full-size temporary
            np.greater_equal(np.abs(xn[lo:hi], out=absb[:hi - lo]), t, out=mask[:hi - lo])
            hits = np.flatnonzero(mask[:hi - lo])
            if hits.size:
                found.append(hits + lo)
        cand = torch.from_numpy(np.concatenate(found)) if found else torch.empty(0, dtype=torch.int64)
        if cand.numel() >= k:
            _stats["sampled"] += 1
            return cand.index_select(0, x.index_select(0, cand).abs().topk(k, sorted=False).indices)
        _stats["retries"] += 1
        j = min(m, 4 * j)
    _stats["full"] += 1
    return x.abs().topk(k, sorted=False).indices


class TopK(Codec):
    """Top-k sparsification, as in Deep Gradient Compression (Lin, Han, Mao, Wang & Dally 2018,
    arXiv 1712.01887), per reducer bucket, with local accumulation of what is not sent (the
    :class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapper, on by default).

    Update, per bucket x (n elements) on each of K ranks (x already holds the residual):

      1. ``k = max(1, ⌊ratio · n⌋)``; ``I`` = indices of the k largest ``|x_i|`` (exactly;
         found through DGC's sampled threshold, :func:`top_indices`);
      2. all-gather ``(x_I, I)`` (values in x's dtype, indices int32);
      3. the average is ``(1/K) Σ_k scatter_add(I_k, x_{I_k})``.

    DGC's momentum correction, clipping and sparsity warm-up are not included (the wrapped
    optimizer applies momentum to the averaged gradient).
    Bytes per rank and bucket: an all-gather of ``k · (value bytes + 4)``.

    Two-phase (:class:`~lowcomm.compress.twophase.TwoPhase`), bytes ≈ 2·(K−1)/K·k·(value
    bytes + 4) per rank, flat in K:

      1. each rank keeps the ``k_j = max(1, ⌊ratio·|x_j|⌋)`` largest of every chunk j (chunk-
         balanced selection, so every block has a fixed size, as Ok-Topk balances its
         partitions: Li & Hoefler 2022, arXiv 2201.07598) and sends chunk j to rank j;
      2. the owner sums the K sparse chunks (at most K·k_j non-zeros), adds its server residual,
         and re-sparsifies the result to its k_j largest (gTop-k's re-selection of the summed
         top-k, Shi et al. 2019, arXiv 1901.04359); what it drops is its server residual;
      3. all-gather of the owners' (values, indices).

    Args:
        ratio: share of elements kept, in (0, 1].
    """

    name, summable = "topk", False

    def __init__(self, ratio: float = 0.01):
        self.ratio = _check_ratio(ratio)

    def payload_layout(self, n, dtype, nseg=1):
        k = kept(n, self.ratio)
        return [(dtype, (k,)), (torch.int32, (k,))]

    def encode(self, x, key, segments, rank=None):
        idx = top_indices(x, kept(x.numel(), self.ratio))
        return [x.index_select(0, idx), idx.to(torch.int32)], x.numel()

    def subtract_decoded_(self, p, payload, ctx):
        values, idx = payload                       # only the k sent entries change
        i = idx.long()
        return p.index_copy_(0, i, p.index_select(0, i).sub_(values.to(p.dtype)))

    def decompress(self, payload, ctx):
        values, idx = payload
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_copy_(0, idx.long(), values)

    def decompress_mean(self, gathered, ctx, K):
        values, idx = gathered
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_add_(0, idx.reshape(-1).long(), values.reshape(-1)).div_(K)


def distinct_sample(n: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)``, a uniformly random k-subset in random order, drawn
    from ``gen`` (so ranks whose generators agree draw the same).

    For ``k ≤ n/16``: the first k distinct values of a sequence of independent uniform draws
    (``randint``; about k + k²/2n + slack draws, more if needed): O(k log k) instead of the
    O(n) of a permutation of n. Otherwise the first k of ``randperm(n)``."""
    if 16 * k > n:
        return torch.randperm(n, generator=gen, device=device)[:k]
    draws = torch.empty(0, dtype=torch.int64, device=device)
    want = k + k * k // (2 * n) + 4 * int(k ** 0.5) + 8
    while True:
        draws = torch.cat([draws, torch.randint(0, n, (want,), generator=gen, device=device)])
        uniq, inv = torch.unique(draws, return_inverse=True)
        if uniq.numel() >= k:
            break
        want = k - uniq.numel() + 4 * int(k ** 0.5) + 8
    first = torch.full((uniq.numel(),), draws.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inv, torch.arange(draws.numel(), device=device), "amin")
    return draws.index_select(0, first.sort().values[:k])


class RandomK(Seeded, Codec):
    """Random-k sparsification (Stich, Cordonnier & Jaggi 2018, arXiv 1809.07599; used with
    error feedback as in Lin et al. 2018, arXiv 1712.01887), per reducer bucket.

    Update, per bucket x (n elements) on each of K ranks:

      1. ``k = max(1, ⌊ratio · n⌋)``; ``I`` = a uniformly random k-subset of range(n)
         (:func:`distinct_sample`) drawn from a generator seeded alike on every rank and
         advanced alike (one draw per bucket, in bucket order), so every rank picks the same I
         without sending it;
      2. all-reduce (sum) ``x_I``; the average is ``scatter(I, Σ_k x_I / K)``.

    Not rescaled by n/k (biased, contractive; error feedback keeps what is not sent).
    Bytes per rank and bucket: an all-reduce of ``k`` values (no indices on the wire).

    Args:
        ratio: share of elements kept, in (0, 1].
        seed: the shared generator's seed (equal on every rank).
    """

    name, summable = "randomk", True
    per_rank = False

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        self.ratio = _check_ratio(ratio)
        self._init_rng(seed)

    def payload_layout(self, n, dtype, nseg=1):
        return [(dtype, (kept(n, self.ratio),))]

    def encode(self, x, key, segments, rank=None):
        n = x.numel()
        idx = distinct_sample(n, kept(n, self.ratio), self.generator(x.device, rank), x.device)
        return [x.index_select(0, idx)], (idx, n)

    def subtract_decoded_(self, p, payload, ctx):
        idx, _ = ctx                                # only the k sent entries change
        return p.index_copy_(0, idx, p.index_select(0, idx).sub_(payload[0].to(p.dtype)))

    def decompress(self, payload, ctx):
        idx, n = ctx
        out = torch.zeros(n, dtype=payload[0].dtype, device=payload[0].device)
        return out.index_copy_(0, idx, payload[0])

    def state_dict(self):
        return self.rng_state()

    def load_state_dict(self, state):
        self.load_rng_state(state)
