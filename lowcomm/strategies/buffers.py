"""A model's buffers across ranks: BatchNorm's running statistics are model state too.

Only persistent buffers (those in ``model.state_dict()``) are moved; non-persistent ones (a
causal mask, rotary frequencies) are constants that every rank builds alike. Two rules:

* :func:`broadcast_buffers`: every buffer becomes rank 0's (torch DDP's ``broadcast_buffers``);
* :func:`average_buffers`: floating-point buffers become the average over the ranks, the others
  (``num_batches_tracked``) rank 0's — what an outer loop does when it averages parameters.

Both are one message per dtype, charged to the communicator's ledger; a model without
persistent buffers sends nothing.
"""
from __future__ import annotations

import torch

from ..comm.collectives import allreduce_, broadcast_
from ..comm.comm import Comm


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the buffers in ``model.state_dict()``, in its order."""
    saved = set(model.state_dict().keys())
    return [(n, b) for n, b in model.named_buffers() if n in saved]


class Buffers:
    """A model's persistent buffers, split once into floating-point ones and the rest."""

    def __init__(self, model: torch.nn.Module):
        named = persistent_buffers(model)
        self.floating = [b for _, b in named if b.is_floating_point()]
        self.other = [b for _, b in named if not b.is_floating_point()]

    def __bool__(self) -> bool:
        return bool(self.floating or self.other)

    @torch.no_grad()
    def broadcast(self, comm: Comm, root: int = 0) -> None:
        """Every buffer becomes ``root``'s."""
        if self and comm.size > 1:
            broadcast_(comm, self.floating + self.other, root)

    @torch.no_grad()
    def average(self, comm: Comm) -> None:
        """Floating-point buffers become the rank average (one all-reduce per dtype), the
        others rank 0's."""
        if not self or comm.size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.floating:
            by_dtype.setdefault(b.dtype, []).append(b)
        for _, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            flat = torch.cat([b.reshape(-1) for b in group])
            allreduce_(flat, comm, "mpi", op="avg")
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view(b.shape))
                offset += b.numel()
        self.broadcast_other(comm)

    @torch.no_grad()
    def broadcast_other(self, comm: Comm, root: int = 0) -> None:
        """The non-floating-point buffers (``num_batches_tracked``) become ``root``'s."""
        if self.other and comm.size > 1:
            broadcast_(comm, self.other, root)


def broadcast_buffers(comm: Comm, model: torch.nn.Module, root: int = 0) -> None:
    """Every persistent buffer of ``model`` becomes ``root``'s (DDP's rule)."""
    Buffers(model).broadcast(comm, root)


def average_buffers(comm: Comm, model: torch.nn.Module) -> None:
    """Floating-point buffers averaged over the ranks, the others rank 0's."""
    Buffers(model).average(comm)
