"""The shape every strategy shares: an optimizer wrapper that keeps the user's loop as it is.

The protocol is narrow: ``zero_grad``, ``step``, ``skip``, ``state_dict``,
``load_state_dict``, ``finish``, ``close``, an optional ``metrics`` and ``reshard`` (merge the
checkpoints of another rank count; default: replicated state, rank 0's copy). A strategy module also
owns a :class:`~lowcomm.settings.Settings` dataclass of its knobs and a builder, which it
publishes as a :class:`Method`; :mod:`lowcomm.run.registry` maps names to methods.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..comm.comm import Comm, init
from ..compress.settings import CompressorSettings
from ..errors import ConfigError


def check_compressor_name(s, prefix: str, allow_empty: bool = False) -> None:
    """``s.compressor`` names a registered compressor (``""`` too where ``allow_empty``)."""
    from ..compress import COMPRESSORS
    if not (allow_empty and s.compressor == "") and s.compressor not in COMPRESSORS:
        raise ConfigError(prefix + "compressor", f"unknown compressor {s.compressor!r}; known: "
                          f"{', '.join(COMPRESSORS)}")


@dataclass
class Context:
    """What a builder takes beyond its own settings: the run's ``[compressor]`` table (the
    gradient compressor, and the knobs of a compressor named by a strategy option), the run's
    NaN policy (``"abort"``: never send a non-finite value; ``"skip"``: the loop skips such
    steps on all ranks),
    the run's step budget (None: open-ended), where a per-level policy nests the strategy, and
    the topology's communicators (:class:`~lowcomm.comm.topology.Levels`, built once by the caller:
    per-level policies and the ``hierarchical`` all-reduce need them; None without a topology)."""
    compressor: CompressorSettings = field(default_factory=CompressorSettings)
    nonfinite: str = "abort"
    steps: int | None = None
    nest: Any = None
    levels: Any = None

    def gradient_compressor(self, name: str | None = None):
        """The run's gradient compressor, or the one called ``name`` with the run's knobs,
        wrapped in error feedback where asked (None for "none")."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name) if name else self.compressor)

    def bare_compressor(self, name: str):
        """The compression operator ``name`` with the run's knobs, without error feedback."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name), error_feedback=False)


@dataclass(frozen=True)
class Method:
    """A strategy as the registry knows it.

    ``build(settings, model, optimizer, comm, ctx) -> Strategy``; ``check(settings, cfg,
    prefix)`` (optional) rejects combinations with the run's other keys before MPI starts,
    naming the key; ``outer`` is True for outer loops (they may wrap a lower policy level);
    ``level``: the method may be a level of a per-level policy."""
    name: str
    settings: type
    build: Callable
    summary: str
    check: Callable | None = None
    outer: bool = False
    level: bool = False     # may be a level of a per-level policy (per-step or outer loop)


def balance(sizes: list[int], bins: int) -> list[int]:
    """Greedy size balancing (LPT, Graham 1969): largest item first onto the least-loaded bin
    (ties: the lowest bin). Returns the bin of each item."""
    load = [0] * bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        out[i] = b
        load[b] += sizes[i]
    return out


class Strategy:
    """Wraps ``optimizer``; ``zero_grad()``, ``backward()``, ``step()`` keep their meaning.

    Subclasses add communication around :meth:`step`. State that must survive a restart goes
    in :meth:`state_dict` (never a Comm).
    """

    name = "strategy"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.comm = comm or init()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def skip(self) -> None:
        """Abandon this step on every rank (all ranks call it together): finish whatever
        communication is in flight, discard the gradients, leave parameters as they are."""
        self.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

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

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """Extra fields for a log line of metrics.jsonl, or (``final``, after :meth:`close`)
        for summary.json; e.g. consensus distance. Called on every rank together; reduce over
        ``ctl``, the uncharged control communicator."""
        return {}

    def finish(self) -> None:
        """After :meth:`close`: leave on every rank the model the run delivers (e.g. the
        average of the ranks' local models), identical on every rank. Called on all ranks
        together; traffic is charged to the method."""

    def close(self) -> None:
        """Release threads and hooks; the strategy must not be used afterwards."""
