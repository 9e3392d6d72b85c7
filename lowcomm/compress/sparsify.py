"""Sparsification: send k of n elements (top-k: gathered values + indices; random-k: values at
indices every rank draws alike, all-reduced). Both are meant for error feedback (on by default)."""
from __future__ import annotations

import torch

from .base import Compressor, Seeded


def kept(n: int, ratio: float) -> int:
    """Elements kept of ``n``: ``k = max(1, ⌊ratio · n⌋)``."""
    return max(1, int(ratio * n))


def _check_ratio(ratio: float) -> float:
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return float(ratio)


class TopK(Compressor):
    """Top-k sparsification, as in Deep Gradient Compression (Lin, Han, Mao, Wang & Dally 2018,
    arXiv 1712.01887), per reducer bucket, with local accumulation of what is not sent (the
    :class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapper, on by default).

    Update, per bucket x (n elements) on each of K ranks (x already holds the residual):
      1. ``k = max(1, ⌊ratio · n⌋)``; ``I`` = indices of the k largest ``|x_i|``;
      2. all-gather ``(x_I, I)`` (values in x's dtype, indices int32);
      3. the average is ``(1/K) Σ_k scatter_add(I_k, x_{I_k})``.
    DGC's momentum correction, clipping and sparsity warm-up are not included (the wrapped
    optimizer applies momentum to the averaged gradient).
    Bytes per rank and bucket: an all-gather of ``k · (value bytes + 4)``.

    Two-phase (:func:`~lowcomm.compress.twophase.two_phase_reduce`), bytes ≈ 2·(K−1)/K·k·(value
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

    name, summable, horovod, two_phase = "topk", False, False, True

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        self.ratio = _check_ratio(ratio)

    def payload_nbytes(self, n, dtype):
        return kept(n, self.ratio) * (torch.empty(0, dtype=dtype).element_size() + 4)

    def _compress(self, x, key, segments):
        k = kept(x.numel(), self.ratio)
        idx = x.abs().topk(k, sorted=False).indices
        return [x[idx], idx.to(torch.int32)], x.numel()

    def decompress(self, payload, ctx):
        values, idx = payload
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_put_((idx.long(),), values)

    def decompress_mean(self, gathered, ctx, K):
        values, idx = gathered
        out = torch.zeros(ctx, dtype=values.dtype, device=values.device)
        return out.index_add_(0, idx.reshape(-1).long(), values.reshape(-1)).div_(K)


class RandomK(Seeded, Compressor):
    """Random-k sparsification (Stich, Cordonnier & Jaggi 2018, arXiv 1809.07599; used with
    error feedback as in Lin et al. 2018, arXiv 1712.01887), per reducer bucket.

    Update, per bucket x (n elements) on each of K ranks:
      1. ``k = max(1, ⌊ratio · n⌋)``; ``I`` = the first k of a random permutation of n drawn from
         a generator seeded alike on every rank and advanced alike (one draw per bucket, in
         bucket order), so every rank picks the same I without sending it;
      2. all-reduce (sum) ``x_I``; the average is ``scatter(I, Σ_k x_I / K)``.
    Not rescaled by n/k (biased, contractive; error feedback keeps what is not sent).
    Bytes per rank and bucket: an all-reduce of ``k`` values (no indices on the wire).

    Args:
        ratio: share of elements kept, in (0, 1].
        seed: the shared generator's seed (equal on every rank).
    """

    name, summable, horovod = "randomk", True, False
    per_rank = False

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__()
        self.ratio = _check_ratio(ratio)
        self._init_rng(seed)

    def _compress(self, x, key, segments):
        n = x.numel()
        k = kept(n, self.ratio)
        idx = torch.randperm(n, generator=self.generator(x.device), device=x.device)[:k]
        return [x[idx]], (idx, n)

    def decompress(self, payload, ctx):
        idx, n = ctx
        out = torch.zeros(n, dtype=payload[0].dtype, device=payload[0].device)
        return out.index_put_((idx,), payload[0])

    def state_dict(self):
        return self.rng_state()

    def load_state_dict(self, state):
        self.load_rng_state(state)
