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

Modules: :mod:`lowcomm.strategies.ps.protocol` (tags, messages, shards, errors),
:mod:`lowcomm.strategies.ps.worker` (:class:`~lowcomm.strategies.ps.worker.AsyncPS`, the worker
strategy), :mod:`lowcomm.strategies.ps.server` (:class:`ParameterServer`, not a strategy). This
module is the entry users and the registry use: :class:`AsyncPS` here builds, on each rank, the
role that rank plays, and re-exports the protocol's names.

Example::

    ps = AsyncPS(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, servers=1,
                 max_staleness=2)    # a ParameterServer on ranks < servers, a worker elsewhere
    if ps.is_server:
        ps.serve()                   # until every worker has finished or is lost
    else:
        for x, y in batches:
            ps.zero_grad(); loss = model.loss(x, y); ps.note_loss(loss.item())
            loss.backward(); ps.step()   # push gradients, pull parameters
        ps.done()
"""
from __future__ import annotations

from ..comm.comm import Comm, init
from .ps import worker
from .ps.protocol import (DROPPED, HEADER, OK, POLL_S, PUSH, SKIP, STOP, TAG_BEAT, TAG_DONE,
                          TAG_INIT, TAG_PULL, TAG_PUSH, Reply, ServerLost, Settings, Shard,
                          WorkerDropped, WorkersLost, build_shards, dc_compensate, pack_push,
                          recovery_enabled, staleness_lr, unpack_push)
from .ps.server import ParameterServer


class AsyncPS(worker.AsyncPS):
    """The asynchronous parameter server as the registry and users build it: on server ranks
    (``comm.rank < servers``) constructing it returns a :class:`ParameterServer` (which serves
    and is not a strategy), on worker ranks this worker strategy
    (:class:`lowcomm.strategies.ps.worker.AsyncPS`). Same arguments on every rank; see the
    worker class for them (:mod:`.ps.method` builds it from the run's settings)."""

    def __new__(cls, model=None, optimizer=None, comm: Comm | None = None, *, compressor=None,
                **settings):
        comm = comm or init()
        if comm.rank < settings.get("servers", 1):
            return ParameterServer(model, optimizer, comm, compressor=compressor, **settings)
        return super().__new__(cls)


__all__ = ["AsyncPS", "DROPPED", "HEADER", "OK", "POLL_S", "PUSH", "ParameterServer", "Reply",
           "SKIP", "STOP", "ServerLost", "Settings", "Shard", "TAG_BEAT", "TAG_DONE", "TAG_INIT",
           "TAG_PULL", "TAG_PUSH", "WorkerDropped", "WorkersLost", "build_shards", "dc_compensate",
           "pack_push", "recovery_enabled", "staleness_lr", "unpack_push"]
