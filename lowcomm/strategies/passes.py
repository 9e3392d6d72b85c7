"""When a method that exchanges gradients during backward does so (torch DDP's semantics)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import LowcommError


class BackwardPasses:
    """When a method that exchanges gradients during backward does so (torch DDP's semantics).

    The exchange ``exchange()`` runs at the end of every ``per_step``-th backward pass (queued
    on autograd's engine from the first gradient hook of the pass), so ``p.grad`` holds the
    exchanged gradients when ``backward()`` returns. Passes inside :meth:`no_sync` accumulate
    locally and do not count; :meth:`before_step` exchanges what they left."""

    def __init__(self, per_step: int, exchange: Callable[[], None]):
        self.per_step, self._exchange = per_step, exchange
        self.done = 0            # counted passes since the last exchange
        self.sync = True         # False inside no_sync()
        self.local = False       # gradients accumulated since the last exchange
        self._queued = False

    def exchanging(self) -> bool:
        """From a gradient hook: whether this pass ends with the exchange (so its gradients
        may be sent as they come)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return self.sync and self.done == self.per_step - 1

    def _end(self) -> None:
        self._queued = False
        self.local = True
        if self.sync:
            self.done += 1
            if self.done == self.per_step:
                self.done, self.local = 0, False
                self._exchange()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients only."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def before_step(self) -> None:
        """Before a step (or skip): exchange gradients left by passes under :meth:`no_sync`;
        a step in the middle of N counted passes is an error."""
        if self.done:
            raise LowcommError(f"step() after {self.done} of {self.per_step} backward passes; set "
                               "backward_passes_per_step to the number of backward() calls per "
                               "step, or accumulate inside no_sync()")
        if self.local:
            self.local = False
            self._exchange()
