"""The capabilities of a method: what the loop, the fleet, snapshots, integrations and the
policies ask of it, each declared here with the default that holds for a plain data-parallel
method and called unconditionally (never probed). A method overrides those that differ for it.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Callable

import torch

from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError


class Role(enum.Enum):
    """What a rank does under its method: trains (a plain method), or is a parameter server's
    worker or server."""
    PLAIN = "plain"
    WORKER = "worker"
    SERVER = "server"


class Capabilities:
    """The declared capabilities of :class:`~lowcomm.strategies.base.Strategy`, with their
    defaults (a mixin of it: ``self.model``, ``self.comm`` are the method's)."""

    #: what this rank does (a parameter server's ranks serve or work)
    role = Role.PLAIN
    #: gradients and optimizer state are sharded over the ranks, as ZeRO does; it clips them itself
    sharded = False
    #: the model is split over the ranks, by FSDP here or below or a pipeline's stages; its
    #: model_state_dict() holds this rank's part
    shards_model = False
    #: the ranks of one unit hold different parts of the model (a pipeline's stages)
    splits_model = False
    #: the model's forward is a collective, as FSDP's (it gathers the parameters)
    collective_forward = False
    #: dense steps before the method's first period, an outer loop's warm-up
    warmup_steps = 0
    #: inner steps a round is in flight before it is applied; 0 where rounds block
    delay = 0
    #: seconds the steps waited for rounds in flight
    wait_s = 0.0

    def model_state_dict(self) -> dict:
        """The model's state as this rank keeps it (a sharding method: this rank's shards)."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Load a :meth:`model_state_dict` into the model."""
        self.model.load_state_dict(state)

    def full_model_state_dict(self) -> dict:
        """The whole model's state (collective where the parameters are sharded)."""
        return self.model_state_dict()

    def local_shards(self) -> dict[str, torch.Tensor] | None:
        """This rank's chunk of every parameter where the method itself shards them; else None."""
        return None

    def distributed_model_state(self) -> dict:
        """The model's state as :mod:`torch.distributed.checkpoint` saves it and loads it back
        in place (``checkpoint.format = "dcp"``: :mod:`lowcomm.run.dcp`), a method that splits
        the model over torch.distributed's group giving its DTensors; a ConfigError naming the
        setting where the method keeps none."""
        raise ConfigError("checkpoint.format", f"{self.name} keeps no model state for "
                          "torch.distributed.checkpoint (\"dcp\" saves a model split over "
                          "torch.distributed's group: tp); use checkpoint.format = \"torch\"")

    def outer_shards(self) -> dict[str, torch.Tensor] | None:
        """What an outer loop above keeps and exchanges of this rank's parameters, by name:
        :meth:`local_shards`, less the tensors another rank of the unit owns where several hold
        them (a split model's replicated or tied parameters, refreshed from their owner by
        :meth:`parameters_changed`); None where :meth:`local_shards` is None."""
        return self.local_shards()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type,
                                              error_if_nonfinite)

    def clips_itself(self) -> bool:
        """Whether :meth:`clip_grad_norm_` is the method's own norm (ZeRO's ranges, a pipeline's
        stages), where torch's over the model's parameters would see part of it."""
        return type(self).clip_grad_norm_ is not Capabilities.clip_grad_norm_

    def joined(self) -> None:
        """A rejoining fleet member took a donor's state: continue from the live outer state."""

    def drain(self) -> None:
        """Wait for the rounds in flight (each is still applied at its step)."""

    def landed(self, step: int) -> int:
        """The last inner step whose rounds have landed on every member, the loop at ``step``."""
        return step

    def forward_backward(self, loss_fn: Callable, batch, before_backward: Callable | None = None):
        """One forward and backward pass of this rank's ``batch``: ``loss = loss_fn(model,
        batch)`` (``before_backward(loss)`` where given), ``loss.backward()``; returns the loss.
        A method that splits the model runs its schedule here (pipeline parallelism)."""
        loss = loss_fn(self.model, batch)
        if before_backward is not None:
            before_backward(loss)
        loss.backward()
        return loss

    def evaluate(self, loss_fn: Callable, batch) -> float:
        """The held-out loss of ``batch``: ``loss_fn(model, batch)`` (a method that splits the
        model runs its forward passes here)."""
        return float(loss_fn(self.model, batch).item())

    def batch_place(self) -> tuple[int, int]:
        """This rank's place among the step's batches: (index, count) — its rank and the ranks'
        count; the stages of one pipeline share one batch."""
        return self.comm.rank, self.comm.size

    def takes_step(self) -> bool:
        """Whether this rank computes the next step (forward, backward, :meth:`step`); False
        where the method passes over it (dynamic local updates: a slower member takes fewer
        of a period's steps). Call :meth:`pass_step` instead of computing such a step."""
        return True

    def pass_step(self) -> None:
        """Go past a step this rank does not compute (:meth:`takes_step` is False): the
        method's schedule moves on, nothing is computed or sent except at a period's end."""
        raise LowcommError(f"{type(self).__name__} computes every step: pass_step() is for a "
                           "step that takes_step() says this rank passes over")

    def local_nonfinite(self) -> str | None:
        """What was non-finite in this rank's own gradients before the method exchanged them
        (e.g. ``"the gradient of 'w'"``), for methods that average gradients during backward
        (their ``p.grad`` then holds the average, with nothing non-finite sent); else None."""
        return None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients (torch DDP's ``no_sync``):
        the next backward outside the block exchanges them. A no-op for methods that exchange
        nothing during backward."""
        yield

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks: from ``old``, every old rank's checkpoint state
        (``{"model": ..., "strategy": ...}``, in old rank order), return this rank's
        ``{"model": model state dict, "strategy": state for load_state_dict}`` in the new world
        (``self.comm``); it may add ``"loop"`` and ``"rng"`` (the loop's counters and the RNG
        states to continue from; default: old rank ``rank mod K_old``'s). Called on every new
        rank with the same ``old``.

        Default: the state is replicated, so rank 0's copy carries over (checked equal on every
        old rank, see :func:`~lowcomm.strategies.reshard.replicated`). Strategies with per-rank
        state merge it by their own rule; one that cannot be resized raises a
        :class:`~lowcomm.errors.LowcommError` saying why."""
        from .reshard import replicated
        return replicated(old, self.name)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors the method holds beside the model's and its optimizer's, by kind ("param",
        "grad", "state"), for the memory a run reports (:mod:`lowcomm.run.memory`)."""
        return {}

    def parameters_changed(self) -> None:
        """The model's parameters were set from outside the method (an outer loop above it
        merged a synchronisation): a method keeping its own copy of them refreshes it."""

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """Extra fields for a log line of metrics.jsonl, or (``final``, after :meth:`close`)
        for summary.json; e.g. consensus distance. Called on every rank together; reduce over
        ``ctl``, the uncharged control communicator."""
        return {}
