"""The shape every strategy shares: an optimizer wrapper that keeps the user's loop as it is."""
from __future__ import annotations

import torch

from ..comm import Comm, init


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

    @classmethod
    def from_config(cls, cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    comm: Comm) -> "Strategy":
        """Build from a :class:`~lowcomm.config.Config` (``cfg.strategy`` and friends)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a config")

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

    def log_fields(self, ctl: Comm) -> dict:
        """Extra fields for this log line of metrics.jsonl (called on every rank together;
        reduce over ``ctl``, the uncharged control communicator). E.g. consensus distance."""
        return {}

    def summary(self, ctl: Comm) -> dict:
        """Extra fields for summary.json (called on every rank together, after training)."""
        return {}

    def finish(self) -> None:
        """After :meth:`close` and :meth:`summary`: leave on every rank the model the run
        delivers (e.g. the average of the ranks' local models). Called on all ranks together;
        traffic is charged to the method."""

    def close(self) -> None:
        """Release threads and hooks; the strategy must not be used afterwards."""
