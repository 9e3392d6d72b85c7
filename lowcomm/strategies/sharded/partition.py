"""ZeRO's partition: the optimizer's parameters packed into flat buckets, each cut into one range
per rank (Rajbhandari et al. 2020, ZeRO, §5: P_os and P_g partition the optimizer state and the
gradients), and the gradient a rank sees between the exchange and the step."""
from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ...comm.collectives import chunk_bounds
from ...comm.comm import Comm
from ...compress.base import Segment
from ...errors import LowcommError
from ..layout import balance


@dataclass
class Bucket:
    """Parameters of one group laid out flat; rank r owns ``[bounds[r], bounds[r+1])``."""
    index: int
    group: int
    members: list[tuple[str, torch.nn.Parameter, int, int]]   # name, parameter, start, stop
    bounds: list[int]
    params: torch.Tensor                 # the flat parameters (the model's are views of it)
    shard: torch.Tensor                  # this rank's range (a view of params, or qwZ's master copy)
    pieces: list[tuple[torch.nn.Parameter, int, int]]   # what the inner optimizer steps: views
                                         # of ``shard`` at [lo, hi) (one flat piece, or whole tensors)
    grad: torch.Tensor | None = None     # the flat gradient while it is reduced
    pending: set[int] = field(default_factory=set)
    future: Future | None = None

    @property
    def numel(self) -> int:
        return self.params.numel()

    @functools.cached_property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    @functools.cached_property
    def segments(self) -> list[Segment]:
        return [Segment(n, p.shape, a, b) for n, p, a, b in self.members]


class ShardedGrad(torch.Tensor):
    """The ``p.grad`` of a model parameter between a ZeRO exchange and the step: no rank holds
    the parameter's whole reduced gradient, so any use of it (torch's ``clip_grad_norm_`` on the
    model's parameters would find a norm of 0 and clip nothing) raises, naming what to call."""

    message = ""
    sharded = True          # (a check of the model's gradients skips it; the method checks them)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LowcommError(cls.message)


ShardedGrad.message = ("the model's gradients are sharded by ZeRO (each rank holds the reduced "
                       "gradient of its ranges only): clip with the method's "
                       "clip_grad_norm_(max_norm) (the global norm), not torch's on the model's "
                       "parameters, and read gradients from its param_groups")


def sharded_grad(p: torch.Tensor) -> torch.Tensor:
    """A ShardedGrad shaped as ``p`` (no memory: a zero-stride view of one element)."""
    return torch.Tensor._make_subclass(ShardedGrad, torch.zeros(1, dtype=p.dtype, device=p.device)
                                       .expand(p.shape))


def partition(optimizer, names: dict, bucket_bytes: int, scatter: Comm, *, by_tensor: bool,
              master_copy: bool) -> list[Bucket]:
    """The optimizer's trainable parameters packed into flat buckets of at most ``bucket_bytes``
    (per group, dtype and device, in reverse order: the order backward produces them), each cut
    into ``scatter.size`` ranges; the model's parameters become views of the buckets and each
    group's ``params`` this rank's pieces. ``by_tensor``: ranges hold whole tensors, balanced by
    size (an optimizer that is not elementwise); ``master_copy``: this rank's range is a copy
    (qwZ's full-precision master)."""
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    owner = dict(zip(map(id, trainable), balance([p.numel() for p in trainable], scatter.size))) \
        if by_tensor else {}
    buckets = [_bucket(i, gi, params, names, owner, scatter, master_copy)
               for i, (gi, params) in enumerate(_packed(optimizer, bucket_bytes))]
    for gi, g in enumerate(optimizer.param_groups):
        g["params"] = [q for b in buckets if b.group == gi for q, _, _ in b.pieces]
    return buckets


def _packed(optimizer, bucket_bytes: int) -> list[tuple[int, list[torch.nn.Parameter]]]:
    """``(group, parameters)`` of each bucket: a group's trainable parameters in reverse, a new
    bucket where the dtype or device changes or ``bucket_bytes`` would be passed."""
    packed: list[tuple[int, list[torch.nn.Parameter]]] = []
    for gi, g in enumerate(optimizer.param_groups):
        size = 0
        for p in reversed([p for p in g["params"] if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            last = packed[-1] if packed else None
            if last is None or last[0] != gi or last[1][0].dtype != p.dtype or \
                    last[1][0].device != p.device or size + nbytes > bucket_bytes:
                packed.append((gi, []))
                size = 0
            packed[-1][1].append(p)
            size += nbytes
    return packed


def _bucket(index: int, group: int, params: list, names: dict, owner: dict, scatter: Comm,
            master_copy: bool) -> Bucket:
    """One bucket over ``params``: flat, the model's parameters views of it, cut into ranges
    (by ``owner``'s rank per tensor where given, else evenly)."""
    K, r = scatter.size, scatter.rank
    if owner:
        params = sorted(params, key=lambda p: owner[id(p)])   # stable: ranges in rank order
    members, n = [], 0
    for p in params:
        members.append((names[id(p)], p, n, n + p.numel()))
        n += p.numel()
    bounds = [next((a for _, p, a, _ in members if owner[id(p)] >= k), n) for k in range(K)] + [n] \
        if owner else chunk_bounds(n, K)
    flat = torch.empty(n, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for _, p, a, b in members:
            flat[a:b].copy_(p.detach().reshape(-1))
            p.data = flat[a:b].view(p.shape)
    own = flat[bounds[r]:bounds[r + 1]]
    shard = own.clone() if master_copy else own
    if owner:          # whole tensors, shaped: the optimizer sees the model's tensors
        pieces = [(torch.nn.Parameter(shard[a - bounds[r]:z - bounds[r]].view(p.shape)),
                   a - bounds[r], z - bounds[r])
                  for _, p, a, z in members if owner[id(p)] == r]
    else:
        pieces = [(torch.nn.Parameter(shard), 0, shard.numel())]
    return Bucket(index, group, members, bounds, flat, shard, pieces)


def merged_model_range(model_state: dict, b: Bucket, r: int) -> torch.Tensor:
    """This rank's range of bucket ``b`` taken from a full model state dict (qwZ's master copy
    after a resize: the dequantized values every rank held)."""
    flat = torch.cat([model_state[n].reshape(-1) for n, _, _, _ in b.members])
    return flat[b.bounds[r]:b.bounds[r + 1]].clone()


__all__ = ["Bucket", "ShardedGrad", "merged_model_range", "partition", "sharded_grad"]
