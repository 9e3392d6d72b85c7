"""Asynchronous DiLoCo's outer state in one place: the fleet coordinator's arrival server.

Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling" (arXiv 2401.09135),
§3: a server holds the outer parameters θ and the outer optimizer; each worker trains from the
θ it last took, sends its pseudo-gradient when its local steps are done, and takes the θ of
that moment back — nobody waits for anybody. For each arrival of member k, with Δ_k = θ^(k) −
θ_k (θ^(k) the outer parameters k started its local steps from, θ_k its model after them):

  1. θ ← DelayedNesterov(θ, Δ_k): the buffer d ← d + Δ_k; on every N-th arrival the momentum
     m ← β·m + d/N, θ ← θ − η·β·m − η·Δ_k/N, d ← 0; otherwise θ ← θ − η·Δ_k/N
     (:class:`~lowcomm.strategies.outer.diloco.DelayedNesterov`; N = ``every``, by default the
     fleet's datacenters, so that N arrivals move θ about as one synchronous round does);
  2. member k's floating-point buffers (BatchNorm's statistics) replace the ones it sent last;
     the buffers handed back are the mean over the members' latest;
  3. member k takes θ (and the buffers) and trains on from there.

Stale pseudo-gradients are applied as they are, as in the paper. A member's first arrival of
an incarnation also carries the θ it started from, which sets θ where the server has none (the
fleet's start, or a coordinator started again without a saved state). :meth:`state_dict` holds
everything; the coordinator saves it when it stops and loads it when it starts again.
"""
from __future__ import annotations

import copy

import torch

from ...strategies.outer.diloco import DelayedNesterov


class ArrivalServer:
    """The outer state of asynchronous DiLoCo (module docstring): ``lr`` η, ``momentum`` β,
    ``every`` N arrivals between momentum updates."""

    def __init__(self, lr: float, momentum: float, every: int):
        if every < 1:
            raise ValueError(f"every must be >= 1 arrivals, got {every}")
        self.lr, self.momentum, self.every = lr, momentum, every
        self.theta: torch.nn.Parameter | None = None
        self.optimizer: DelayedNesterov | None = None
        self.buffers: dict[int, torch.Tensor] = {}     # member -> its latest floating buffers
        self.arrivals = 0
        warm = torch.nn.Parameter(torch.zeros(1), requires_grad=False)   # torch's first
        warm.grad = torch.zeros(1)                  # optimizer step imports for about a second:
        DelayedNesterov([warm], lr, momentum, every).step()    # not in the first arrival's time

    @property
    def ready(self) -> bool:
        return self.theta is not None

    def start(self, theta: torch.Tensor) -> None:
        """Set θ where there is none yet (else nothing: the state in place is the live one)."""
        if self.theta is None:
            self.theta = torch.nn.Parameter(theta.detach().to(torch.float32).clone(),
                                            requires_grad=False)
            self.optimizer = DelayedNesterov([self.theta], self.lr, self.momentum, self.every)

    def arrive(self, member: int, delta: torch.Tensor | None,
               buffers: torch.Tensor | None = None) -> None:
        """Apply member ``member``'s pseudo-gradient (None: it brings none, e.g. a run that
        ended on a synchronisation) and keep its buffers (steps 1–2)."""
        if self.theta is None:
            raise RuntimeError("an arrival before the server has θ (a first arrival carries it)")
        if delta is not None:
            if delta.numel() != self.theta.numel():
                raise ValueError(f"member {member} sent {delta.numel()} values, θ has "
                                 f"{self.theta.numel()}")
            self.theta.grad = delta.to(torch.float32)
            self.optimizer.step()
            self.theta.grad = None
            self.arrivals += 1
        if buffers is not None and buffers.numel():
            self.buffers[member] = buffers.detach().to(torch.float32).clone()

    def mean_buffers(self) -> torch.Tensor:
        """The mean of the members' latest floating-point buffers (empty: none)."""
        if not self.buffers:
            return torch.zeros(0)
        return torch.stack(list(self.buffers.values())).mean(0)

    def state_dict(self) -> dict:
        return {"theta": None if self.theta is None else self.theta.detach().clone(),
                "optimizer": None if self.optimizer is None else
                copy.deepcopy(self.optimizer.state_dict()),     # not the live tensors
                "buffers": {str(k): v for k, v in self.buffers.items()},
                "arrivals": self.arrivals,
                "settings": {"lr": self.lr, "momentum": self.momentum, "every": self.every}}

    def load_state_dict(self, state: dict) -> None:
        if state["settings"] != {"lr": self.lr, "momentum": self.momentum, "every": self.every}:
            raise ValueError(f"the saved arrival server ran with {state['settings']}, this one "
                             f"with lr={self.lr}, momentum={self.momentum}, every={self.every}")
        self.theta = self.optimizer = None
        if state["theta"] is not None:
            self.start(state["theta"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.buffers = {int(k): v for k, v in state["buffers"].items()}
        self.arrivals = int(state["arrivals"])


__all__ = ["ArrivalServer"]
