"""Where an outer loop sits in a per-level policy, and the capabilities it reads through from
the level below it (:mod:`lowcomm.strategies.policy`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.comm import Comm
from ...comm.roles import Peers, Whole
from ...comm.collectives import broadcast_
from ..base import Strategy
from ..wrapped import parts_of_one_method


@dataclass
class Nesting:
    """Where an outer loop sits in a per-level policy (:mod:`lowcomm.strategies.policy`).

    The loop synchronises *units* (e.g. datacenters) whose ranks keep step with each other by
    ``inner``, the strategy one level down (e.g. SyncDP inside each datacenter), which takes
    the inner steps. A synchronisation averages inside the unit first when its ranks may differ
    (``average_inside``), then across units among ``leaders`` (the first rank of every unit,
    the only ranks that send across), then the unit's leader broadcasts the average inside.

    A fleet of datacenters (:mod:`lowcomm.run.fleet`) passes its channel as ``leaders`` (it
    reduces in rounds that survive the loss of a datacenter: ``rounds = True``) and, as
    ``whole``, the span of all its ranks that the last partial period and the buffers are
    averaged over."""
    inner: Strategy | None      # takes the inner steps (None: the plain optimizer)
    inside: Comm | None         # the ranks of my unit (None: a unit is one rank)
    leaders: Peers | None       # the first rank of each unit (on those ranks only)
    average_inside: bool = False
    whole: Whole | None = None  # every rank of every unit (None: the loop's comm)
    peers: Peers | None = None  # my counterpart in every unit (sharded outer state)


class OverALevel:
    """The capabilities an outer loop reads through from the strategy that takes its inner
    steps (:attr:`_driver`: its dense warm-up's SyncDP, or the level below in a per-level
    policy, ``nest.inner``; None: the plain optimizer). A mixin of
    :class:`~lowcomm.strategies.outer.loop.OuterLoop` (``self.nest``, ``self._dense``)."""

    def _start_equal(self, context, local):
        """Every rank starts from rank 0's model: the dense warm-up's SyncDP (returned; it
        broadcasts rank 0's state itself; its keys from the settings, its compressor and NaN
        policy from ``context``), or a broadcast (FSDP below: rank i of every unit takes unit
        0's rank i's chunks)."""
        if self.warmup_steps > 0:
            from ..sync.syncdp import SyncDP
            with parts_of_one_method():
                return SyncDP(self.model, self.optimizer, self.comm, algorithm=self.algorithm,
                              levels=context.levels, **self.settings.warmup_options(context))
        if local is not None:
            if not self.nest.peers.rounds:           # a fleet's members start equal
                broadcast_(self.nest.peers, list(local.values()), root=0)
            broadcast_(self.nest.peers, [b for b in self.model.buffers() if not b.is_meta], root=0)
        else:
            broadcast_(self.comm, list(self.model.state_dict().values()), root=0)
        return None

    def _below_state(self) -> dict:
        """The state of the strategies below: the warm-up's compressor, the level below's."""
        state = {}
        if self._dense is not None and self._dense.compressor is not None:
            state["warmup_compressor"] = self._dense.compressor.state_dict()
        if self._inner is not None:
            state["inner"] = self._inner.state_dict()
        return state

    def _load_below_state(self, state: dict) -> None:
        """Load :meth:`_below_state` (after the loop's step counter ``t``)."""
        if self._dense is not None:
            if self.t >= self.warmup_steps:      # resumed after the warm-up
                self._dense.close()
                self._dense = None
            elif self._dense.compressor is not None:
                self._dense.compressor.load_state_dict(state["warmup_compressor"])
        if self._inner is not None:
            self._inner.load_state_dict(state["inner"])

    @property
    def _inner(self) -> Strategy | None:
        """The level below in a per-level policy (None outside one)."""
        return self.nest.inner if self.nest is not None else None

    @property
    def _driver(self) -> Strategy | None:
        """The strategy that takes the inner steps, or None (the plain optimizer)."""
        return self._dense if self._dense is not None else self._inner

    @property
    def lockstep(self) -> bool:
        """Only the warm-up's SyncDP (or a SyncDP level below) exchanges gradients every step."""
        driver = self._driver
        return driver is not None and driver.lockstep

    def _vote(self, mine: bool) -> bool:
        return self._driver._vote(mine)

    def local_nonfinite(self) -> str | None:
        driver = self._driver
        return driver.local_nonfinite() if driver is not None else None

    def _local_step(self, closure=None):
        """The inner step: the driver's (:attr:`_driver`), else the wrapped optimizer's."""
        driver = self._driver
        return driver.step(closure) if driver is not None else self.optimizer.step(closure)

    def skip(self) -> None:
        driver = self._driver
        if driver is not None:
            driver.skip()
        else:
            self.zero_grad()

    @property
    def collective_forward(self) -> bool:
        """The level below's (FSDP gathers in its forward, a pipeline's stages pass activations)."""
        return self._inner is not None and self._inner.collective_forward

    def forward_backward(self, loss_fn, batch, before_backward=None):
        """The level below's forward and backward passes (a pipeline's schedule)."""
        if self._inner is None:
            return super().forward_backward(loss_fn, batch, before_backward)
        return self._inner.forward_backward(loss_fn, batch, before_backward)

    def evaluate(self, loss_fn, batch) -> float:
        return super().evaluate(loss_fn, batch) if self._inner is None else \
            self._inner.evaluate(loss_fn, batch)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the level below's global norm (a pipeline's over every stage)."""
        if self._driver is None:
            return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return self._driver.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def clips_itself(self) -> bool:
        return self._driver is not None and self._driver.clips_itself()

    def batch_place(self) -> tuple[int, int]:
        """Where the level below places its ranks' batches inside each unit (a pipeline's
        stages share one), the units one after another; else the rank's own. In a fleet's
        datacenter, the place inside the datacenter (the fleet's loop puts the datacenters one
        after another)."""
        inner = self._inner
        if inner is None or self.nest.peers is None or self.nest.inside is None:
            return super().batch_place()
        i, n = inner.batch_place()
        if n == self.nest.inside.size:
            return super().batch_place()
        if self.nest.peers.rounds:    # a fleet's datacenter: its place is the fleet's to add
            return i, n
        return self.nest.peers.rank * n + i, self.nest.peers.size * n

    def model_state_dict(self) -> dict:
        """The model as the level below keeps it (FSDP: this rank's shards)."""
        return self.nest.inner.model_state_dict() if self.shards_model else super().model_state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Load a :meth:`model_state_dict` (through the level below where it shards the model)."""
        if self.shards_model:
            self.nest.inner.load_model_state_dict(state)
        else:
            super().load_model_state_dict(state)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The level below's, and the outer state (:meth:`_outer_state`) as optimizer state."""
        out = {k: list(v) for k, v in (self._inner.memory_tensors() if self._inner else {}).items()}
        out.setdefault("state", []).extend(self._outer_state())
        return out
