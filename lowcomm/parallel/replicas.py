"""Data parallelism over replicas of a split model: the gradients of each part averaged over the
ranks that hold the same part in the other replicas (Megatron-LM's data-parallel groups,
Narayanan et al. 2021, arXiv 2104.04473, §2.3).

A per-level policy whose innermost per-step level splits the model (``policy.rank=tp`` or
``pp``) and whose per-step levels above it are ``syncdp`` (``policy.node=syncdp``) trains one
split model per unit of the inner level; after each backward pass, rank i of every unit (its
*replicas*: they hold the same piece or stage) averages its gradients with theirs —
g ← (1/R) Σ_r g_r, one all-reduce per dtype — before the optimizer steps. The units take
different batches, as the ranks of a data-parallel run do.
"""
from __future__ import annotations

import torch

from ..comm.comm import Comm


def average_gradients(replicas: Comm, grads: list[torch.Tensor]) -> None:
    """Each of ``grads`` replaced in place by its mean over ``replicas`` (one all-reduce of the
    flattened tensors per dtype and device)."""
    groups: dict = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    for same in groups.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        replicas.allreduce_(flat, "sum")
        flat.div_(replicas.size)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (its storage, a view), another tensor itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def local_grads(params) -> list[torch.Tensor]:
    """The local tensors of ``params``' gradients (a DTensor's piece; None skipped)."""
    from torch.distributed.tensor import DTensor
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params if p.grad is not None]


def place(replicas: Comm | None) -> tuple[int, int]:
    """A split model's place among the step's batches: its replica's (every rank of one unit
    takes the same batch)."""
    return (0, 1) if replicas is None else (replicas.rank, replicas.size)


__all__ = ["average_gradients", "local_grads", "local_of", "place"]
