"""A model's buffers across ranks: BatchNorm's running statistics are model state too.

Only persistent buffers (those in ``model.state_dict()``) are moved; non-persistent ones (a
causal mask, rotary frequencies) are constants that every rank builds alike. Two rules:

* :func:`broadcast_buffers`: every buffer becomes rank 0's (torch DDP's ``broadcast_buffers``);
* :func:`average_buffers`: floating-point buffers become the average over the ranks, the others
  (``num_batches_tracked``) rank 0's — what an outer loop does when it averages parameters.

Both are one message per dtype, charged to the communicator's ledger; a model without
persistent buffers sends nothing.

Averaged running statistics need not fit averaged weights (an outer step moves the weights
away from every rank's statistics); :func:`recompute_statistics` measures them again on
training batches under the weights the ranks now share.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import ArgumentError

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

    def flat_floating(self) -> torch.Tensor:
        """The floating-point buffers as one float32 CPU tensor (empty: none)."""
        if not self.floating:
            return torch.zeros(0)
        return torch.cat([b.detach().reshape(-1).to("cpu", torch.float32) for b in self.floating])

    @torch.no_grad()
    def set_floating(self, flat: torch.Tensor) -> None:
        """The floating-point buffers from :meth:`flat_floating`'s layout."""
        at = 0
        for b in self.floating:
            b.copy_(flat[at:at + b.numel()].view(b.shape).to(b.dtype))
            at += b.numel()

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


def batchnorms(model: torch.nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of ``model`` that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def default_forward(model: torch.nn.Module, batch) -> None:
    """``model(batch[0])`` for an (inputs, labels) pair, ``model(**batch)`` for a dict, else
    ``model(batch)``."""
    if isinstance(batch, (tuple, list)):
        model(batch[0])
    elif isinstance(batch, dict):
        model(**batch)
    else:
        model(batch)


@torch.no_grad()
def recompute_statistics(model: torch.nn.Module, batches: Iterable, count: int,
                         forward: Callable | None = None) -> int:
    """BatchNorm's running statistics measured again on ``count`` batches of ``batches`` under
    the current weights, as SWA's ``update_bn`` (Izmailov et al. 2018, arXiv 1803.05407).

      1. every BatchNorm layer's running mean and variance are reset and its momentum set to
         None, so that the statistics become the plain average over the batches;
      2. ``forward(model, batch)`` for each batch, without gradients, the BatchNorm layers in
         training mode and every other module in evaluation mode (dropout off, no random
         numbers drawn: the run's random state is untouched);
      3. momenta and training modes are restored.

    Returns the number of batches used. Fewer than ``count`` is fine; none raises
    :class:`~lowcomm.errors.ArgumentError` naming ``context.batches`` and leaves the statistics as
    they were (as does any error inside ``forward``)."""
    layers = batchnorms(model)
    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone(),
              m.momentum) for m in layers]
    modes = [(m, m.training) for m in model.modules()]
    forward = forward or default_forward
    used = 0
    try:
        model.eval()
        for m in layers:
            m.reset_running_stats()
            m.momentum = None
            m.train()
        for batch in itertools.islice(batches, count):
            forward(model, batch)
            used += 1
        if used == 0:
            raise ArgumentError("context.batches", "gave no batch to recompute BatchNorm's statistics "
                                "on (an exhausted iterator? pass a list, a DataLoader or a "
                                "function of the step)")
    except BaseException:
        for m, (mean, var, n, _) in zip(layers, saved):
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(n)
        raise
    finally:
        for m, (*_, momentum) in zip(layers, saved):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return used


def broadcast_buffers(comm: Comm, model: torch.nn.Module, root: int = 0) -> None:
    """Every persistent buffer of ``model`` becomes ``root``'s (DDP's rule)."""
    Buffers(model).broadcast(comm, root)


def average_buffers(comm: Comm, model: torch.nn.Module) -> None:
    """Floating-point buffers averaged over the ranks, the others rank 0's."""
    Buffers(model).average(comm)


class Recompute:
    """BatchNorm's running statistics recomputed on ``count`` of this rank's training batches
    (``batches``: an iterable, iterated afresh each time, or a function of the inner step t
    returning one; ``forward(model, batch)`` runs the model on one), checked when built."""

    def __init__(self, model: torch.nn.Module, count: int, batches, forward):
        if not batchnorms(model):
            raise ArgumentError("bn_recompute", f"{count} batches to recompute BatchNorm's "
                                "running statistics on, but the model has no BatchNorm layer "
                                "that keeps them; use 0")
        if batches is None:
            raise ArgumentError("context.batches", f"bn_recompute = {count} needs training "
                                "batches: pass context=lowcomm.Context(batches=...) (a list, a "
                                "DataLoader or a function of the step; lowcomm.train passes the "
                                "task's)")
        if forward is not None and not callable(forward):
            raise ArgumentError("context.forward", f"must be a function (model, batch), got "
                                f"{type(forward).__name__}")
        self.model, self.count, self.batches, self.forward = model, count, batches, forward

    @torch.no_grad()
    def __call__(self, t: int) -> None:
        """Recompute them at inner step ``t``."""
        batches = self.batches(t) if callable(self.batches) else self.batches
        recompute_statistics(self.model, batches, self.count, self.forward)
