"""A map-style ``torch.utils.data.Dataset`` as a task's ``batch(step, rank, world, cfg)``.

The order is torch's ``DistributedSampler``'s with ``drop_last=True``: every epoch a permutation
of the dataset drawn from ``seed + epoch``, cut to a multiple of ``world``, and rank r takes every
world-th index starting at r; each rank takes ``batch_size`` of its indices per step, in order.
A batch is therefore a pure function of (step, rank, world): a resumed run sees exactly the
batches it would have seen, and K ranks together see the same samples per epoch as one process.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import default_collate


def _size(dataset) -> int:
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(f"dataset_batches needs a map-style dataset with __len__, got "
                        f"{type(dataset).__name__}") from None
    if n < 1:
        raise ValueError("dataset_batches: the dataset is empty")
    return n


def dataset_batches(dataset, batch_size: int | None = None, seed: int | None = None,
                    collate: Callable = default_collate) -> Callable:
    """``batch(step, rank, world, cfg)`` over ``dataset`` (see the module docstring).

    ``batch_size``: samples per rank per step (default ``cfg.batch_size``); ``seed``: the
    permutation's seed (default ``cfg.seed``); ``collate``: list of samples -> batch."""
    n = _size(dataset)
    cache: dict = {}

    def order(epoch: int, base_seed: int) -> torch.Tensor:
        key = (epoch, base_seed)
        if key not in cache:
            cache.clear()
            g = torch.Generator().manual_seed(base_seed + epoch)
            cache[key] = torch.randperm(n, generator=g)
        return cache[key]

    def batch(step: int, rank: int, world: int, cfg):
        B = batch_size or cfg.batch_size
        per_rank = n // world
        steps_per_epoch = per_rank // B
        if steps_per_epoch < 1:
            raise ValueError(f"dataset of {n} samples has {per_rank} per rank for {world} ranks, "
                             f"fewer than one batch of {B}")
        epoch, i = divmod(step - 1, steps_per_epoch)
        perm = order(epoch, cfg.seed if seed is None else seed)[:per_rank * world]
        mine = perm[rank::world][i * B:(i + 1) * B]
        return collate([dataset[int(j)] for j in mine])

    return batch


def dataset_eval_batches(dataset, batch_size: int, limit: int | None = None,
                         collate: Callable = default_collate) -> Callable:
    """``eval_batches(cfg)``: ``dataset`` in order, ``batch_size`` samples per batch (the last
    one may be smaller), at most ``limit`` batches."""
    n = _size(dataset)

    def eval_batches(cfg):
        count = -(-n // batch_size)
        for b in range(count if limit is None else min(count, limit)):
            yield collate([dataset[j] for j in range(b * batch_size, min(n, (b + 1) * batch_size))])

    return eval_batches
