"""Asynchronous parameter server: sharded servers, bounded staleness, stragglers and lost workers.

Asynchronous SGD through a parameter server (Dean et al. 2012, "Large Scale Distributed Deep
Networks"; Li et al. 2014, OSDI, "Scaling Distributed Machine Learning with the Parameter
Server") with stale synchronous parallel consistency (Ho et al. 2013, NeurIPS, "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server"), the staleness-aware learning
rate of Zhang, Gupta, Lian & Liu 2016 (arXiv 1511.05950) and delay-compensated ASGD (DC-ASGD,
Zheng et al. 2017, arXiv 1609.08326).

Roles: MPI ranks ``0 … S-1`` are *servers* (``servers = S``), ranks ``S … K-1`` are *workers*
(worker index ``w = rank - S``). Parameter tensors are sharded over the servers, balanced by size
(largest tensor first onto the least-loaded server). Each server owns its shard and steps the
user's optimizer on it; workers only compute gradients.

Two counters, two kinds of staleness (both in the summary):

* a server's *version* ``v`` counts the updates it has applied to its shard. The *staleness*
  of a gradient (Zhang et al.'s σ) is ``v`` when it is applied minus ``v`` when its worker read
  the parameters: how many other updates landed in between.

* a worker's *clock* ``c_w`` counts the gradients it has pushed. SSP's bound is on clocks: a
  worker may compute gradient ``c_w`` only while ``c_w - min_live c ≤ τ`` (``max_staleness``);
  the *clock lag* ``c_w - min_live c`` at the moment its parameters are sent is therefore ≤ τ.

Update, per gradient ``g`` pushed by worker ``m`` (on every server, for its shard):
  1. worker ``m`` computes ``g`` on parameters ``w_bak(m)`` read at version ``v_m``; during the
     backward pass each shard's gradient, as soon as it is complete, is (optionally) compressed
     and sent to its server with a non-blocking send, and the receive for the reply is posted
     (communication overlaps the rest of the backward pass and the servers' work);
  2. the server computes the staleness ``σ = v - v_m``;
  3. DC-ASGD (``dc_lambda = λ > 0``): ``g ← g + λ · g ⊙ g ⊙ (w - w_bak(m))``;
  4. staleness-aware lr (``staleness_lr``): the step uses ``lr / max(σ, 1)``;
  5. the server's optimizer steps its shard with ``g``; ``v ← v + 1``; ``c_m ← c_m + 1``;
  6. the reply (the shard's current parameters) goes to ``m`` as soon as ``c_m - min_live c ≤ τ``
     (``τ = -1``: at once); until then ``m`` waits. The server re-checks held replies after every
     update and whenever a worker finishes or is lost.

With ``τ = 0`` the server instead waits for every live worker's gradient of the round and applies
their mean once (``v`` counts rounds, ``σ = 0``): synchronous SGD, equal to :class:`SyncDP` for
plain SGD.

Failures: a worker that sends nothing for ``worker_timeout_s`` while the server owes it nothing is
*lost*: every server logs it, stops waiting for it, and the others finish; the run's summary lists
it and ``lowcomm train`` exits with status 4. (Open MPI's ``mpirun`` ends the whole job when any
process dies unless launched with ``--enable-recovery``; rank 0 warns when it is not.) A worker
waiting on a server that neither replies nor sends a heartbeat for ``server_timeout_s`` raises
:class:`ServerLost` naming the server, which ends the job.

Buffers (BatchNorm's running statistics): servers never run a forward pass, so the workers'
buffers are the model's: each push to server 0 carries the worker's buffers, server 0 serves the
average of every live worker's latest (the lowest worker's for integer buffers) with its shard,
and the model the run delivers holds it. Learning rates: each push carries the worker's
``param_groups`` learning rates and the server steps with them (times the staleness factor), so
an LR scheduler on the workers' method drives the servers.

Modules: :mod:`lowcomm.strategies.ps.protocol` (tags, messages, shards, settings, errors),
:mod:`lowcomm.strategies.ps.worker` (:class:`~lowcomm.strategies.ps.worker.Worker`, the worker's
role), :mod:`lowcomm.strategies.ps.server` (:class:`ParameterServer`, the server's role). This
module's :class:`AsyncPS` is the method on every rank: it builds the role the rank plays.

Example::

    ps = AsyncPS(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, servers=1,
                 max_staleness=2)    # ranks < servers serve, the others train
    if ps.is_server:
        ps.serve()                   # until every worker has finished or is lost
    else:
        for x, y in batches:
            ps.zero_grad(); loss = model.loss(x, y); ps.note_loss(loss.item())
            loss.backward(); ps.step()   # push gradients, pull parameters
    ps.finish()                      # every rank: the servers' model, buffers included
"""
from __future__ import annotations

from operator import attrgetter

import torch

from ...comm.comm import Comm
from ...errors import ArgumentError, ConfigError, LowcommError
from ...settings import NonFinite
from ..base import Role, Strategy
from ..method import Context, Method
from .protocol import (DROPPED, HEADER, OK, POLL_S, PUSH, SKIP, STOP, TAG_BEAT, TAG_DONE,
                          TAG_INIT, TAG_PULL, TAG_PUSH, AsyncPSSettings, BufferBlock, Reply, ServerLost, Shard,
                          WorkerDropped, WorkersLost, build_shards, dc_compensate, load_shard,
                          pack_push, recovery_enabled, staleness_lr, unpack_push)
from .server import ParameterServer
from .worker import Worker


class AsyncPS(Strategy):
    """The asynchronous parameter server as a method, on every rank: ranks
    ``0 … servers-1`` serve (:meth:`serve`), the others train (:meth:`step`). The part the rank
    plays (:attr:`part`: a :class:`~lowcomm.strategies.ps.worker.Worker` or a
    :class:`ParameterServer`) is read through the attributes declared below. Same arguments on
    every rank; see :class:`~lowcomm.strategies.ps.worker.Worker` for their meaning
    (:func:`build` builds it from the run's settings)."""

    name = "async-ps"
    Settings = AsyncPSSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: AsyncPSSettings | None = None,
                 compressor=None, nonfinite: NonFinite | str = NonFinite.ABORT,
                 budget: int | None = None, **options):
        super().__init__(model, optimizer, comm, settings=settings, **options)
        st = self.settings
        if not st.servers < self.comm.size:
            raise ArgumentError("servers", f"async-ps needs 1 <= servers < ranks (strategy.servers "
                                f"in a config) so that at least one rank trains; got "
                                f"{st.servers} on {self.comm.size} ranks")
        nonfinite = NonFinite.parse(nonfinite, "nonfinite", ArgumentError)
        if budget is not None and budget < 1:
            raise ArgumentError("budget", f"must be >= 1 gradients, got {budget}")
        part = ParameterServer if self.comm.rank < st.servers else Worker
        self.part = part(model, optimizer, self.comm, compressor=compressor, settings=st,
                         nonfinite=nonfinite, budget=budget)

    @property
    def role(self) -> Role:
        """SERVER on ranks ``0 … servers-1``, WORKER on the others."""
        return self.part.role

    @property
    def is_server(self) -> bool:
        """Whether this rank serves (:attr:`role` is SERVER)."""
        return self.role is Role.SERVER

    # the part's attributes, read through this object (both parts)
    servers = property(attrgetter("part.servers"), doc="S, the number of server ranks")
    workers = property(attrgetter("part.workers"), doc="the number of worker ranks")
    index = property(attrgetter("part.index"), doc="this rank's worker or server index")
    shards = property(attrgetter("part.shards"), doc="the parameters' shards, one per server")
    clock = property(attrgetter("part.clock"), doc="a worker's clock; a server's, per worker")
    max_staleness = property(attrgetter("part.max_staleness"), doc="τ, the staleness bound")
    staleness_lr = property(attrgetter("part.staleness_lr"), doc="the staleness-aware learning rate")
    dc_lambda = property(attrgetter("part.dc_lambda"), doc="DC-ASGD's λ (0: off)")
    worker_timeout_s = property(attrgetter("part.worker_timeout_s"), doc="a silent worker is lost after it")
    server_timeout_s = property(attrgetter("part.server_timeout_s"), doc="a silent server is lost after it")
    # a worker's
    stopped = property(attrgetter("part.stopped"), doc="a server said the budget is spent")
    finished = property(attrgetter("part.finished"), doc="done() told the servers")
    lag_hist = property(attrgetter("part.lag_hist"), doc="the clock lags of the replies, counted")
    wait_s = property(attrgetter("part.wait_s"), doc="seconds the worker waited for replies")
    note_loss = property(attrgetter("part.note_loss"), doc="log the loss of the next gradient")
    # a server's
    server = property(attrgetter("part.server"), doc="the ParameterServer (on a server rank)")
    load_shard = property(attrgetter("part.load_shard"), doc="set shard ``s`` to given values")

    def _worker(self, what: str) -> Worker:
        if self.is_server:
            raise LowcommError(f"rank {self.comm.rank} is a parameter server (ranks "
                               f"0..{self.servers - 1} serve): call serve() there, not {what}")
        return self.part

    def serve(self, on_update=None, on_idle=None) -> None:
        """A server rank: serve until every worker has finished or is lost (see
        :meth:`ParameterServer.serve`)."""
        if not self.is_server:
            raise LowcommError(f"rank {self.comm.rank} is a worker: it steps; ranks "
                               f"0..{self.servers - 1} serve")
        with self.guard.own_step():              # the server steps its shard with the optimizer
            self.part.serve(on_update, on_idle)

    def _step(self, closure=None):
        return self._worker("step()").step(closure)

    def skip(self) -> None:
        self._worker("skip()").skip()

    def no_sync(self):
        return self._worker("no_sync()").no_sync()

    def done(self, signum: int = 0) -> None:
        """A worker: tell every server it has finished (see :meth:`Worker.done`)."""
        self._worker("done()").done(signum)

    def _state_dict(self) -> dict:
        return self.part.state_dict()

    def _load_state_dict(self, state: dict) -> None:
        self.part.load_state_dict(state)

    def reshard(self, old: list[dict]) -> dict:
        return self.part.reshard(old)

    def _close(self) -> None:
        self.part.close()

    def _finish(self) -> None:
        """Every rank ends with the servers' model: a worker that has not said so is done; then
        each server broadcasts its shard (server 0 its served buffers too) to every rank. A
        collective over every rank: with a lost worker, :func:`lowcomm.train` delivers the model
        point to point instead."""
        if not self.is_server and not self.part.finished:
            self.part.done()
        for s, shard in enumerate(self.shards):
            flat = self.part.shard_values(s)
            self.comm.bcast_(flat, root=s)
            load_shard(self.part._params, shard, flat)
        block = BufferBlock(self.model)
        if block.nbytes:
            data = block.pack()          # rank 0 (server 0) holds the served buffers
            self.comm.bcast_(data, root=0)
            block.unpack(data)


# the method: its checks against the run's keys and its builder (the registry's entry)
def check_run(s: AsyncPSSettings, cfg, prefix: str) -> None:
    """Combinations with the run's keys."""
    if prefix != "strategy.":
        raise ConfigError(prefix.rstrip(".") or "spec", "async-ps cannot be a level of a per-level policy")
    if cfg.checkpoint.every and s.max_staleness != 0:
        raise ConfigError("checkpoint.every", "async-ps checkpoints every N steps only with "
                          "strategy.max_staleness = 0 (synchronous): asynchronous servers and "
                          "workers never pass a common step whose state could be saved (at any "
                          "max_staleness, SIGINT/SIGTERM stops the run with a final checkpoint)")
    if cfg.eval_every and s.servers != 1:
        raise ConfigError("eval_every", "async-ps evaluates during the run only with "
                          "strategy.servers = 1 (rank 0 then holds the whole model); use 0 to "
                          "evaluate at the end")


def build(s: AsyncPSSettings, model, optimizer, comm: Comm, ctx: Context):
    return AsyncPS(model, optimizer, comm, settings=s, compressor=ctx.gradient_compressor(),
                   nonfinite=ctx.nonfinite, budget=ctx.steps * (comm.size - s.servers) if ctx.steps else None)


METHOD = Method("async-ps", AsyncPSSettings, build, "asynchronous parameter server: sharded, "
                "with a staleness bound", check=check_run, python="AsyncPS",
                example="async-ps:servers=1")


__all__ = ["AsyncPS", "AsyncPSSettings", "DROPPED", "HEADER", "OK", "POLL_S", "PUSH", "ParameterServer", "Reply",
           "SKIP", "STOP", "ServerLost", "Shard", "TAG_BEAT", "TAG_DONE", "TAG_INIT",
           "TAG_PULL", "TAG_PUSH", "Worker", "WorkerDropped", "WorkersLost", "build_shards",
           "dc_compensate", "pack_push", "recovery_enabled", "staleness_lr", "unpack_push"]
