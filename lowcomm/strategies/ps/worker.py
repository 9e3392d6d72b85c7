"""The worker side of the asynchronous parameter server: :class:`Worker`, the role a worker rank
of :class:`~lowcomm.strategies.ps.async_ps.AsyncPS` plays — it pushes each shard's gradient to its
server and pulls the shard's parameters back (the papers and the update rules are in
:mod:`lowcomm.strategies.ps.async_ps`'s docstring).

It talks to the servers through :class:`~lowcomm.comm.comm.Comm` only (every call watched and charged)
and knows of them only what :mod:`.protocol` defines.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ...comm.comm import Comm
from ...errors import LowcommError, NonFiniteError
from ...settings import NonFinite
from ..base import Role
from ..passes import BackwardPasses
from .protocol import (DROPPED, HEADER, POLL_S, PUSH, SKIP, STOP, TAG_BEAT, TAG_DONE, TAG_INIT,
                       TAG_PULL, TAG_PUSH, AsyncPSSettings, BufferBlock, Reply, ServerLost,
                       WorkerDropped, build_shards, channels, load_shard, pack_push, trainable)


class Worker:
    """The worker of an asynchronous sharded parameter server with bounded staleness (see
    :mod:`lowcomm.strategies.ps.async_ps` for the papers and the update as numbered steps).

    Built on worker ranks (``comm.rank >= servers``) by
    :class:`lowcomm.strategies.ps.async_ps.AsyncPS`, collectively with the servers'
    :class:`~lowcomm.strategies.ps.server.ParameterServer` (same settings).

    Args:
        model, optimizer: the user's torch objects (the same code on every rank). On worker
            ranks the optimizer is not stepped: the servers step their shards.
        comm: the world communicator (collective construction; PS traffic runs on a duplicate).
        servers: S, the number of server ranks (the first S ranks); ``1 ≤ S < comm.size``.
        max_staleness: τ; ``-1`` fully asynchronous, ``0`` synchronous, ``τ > 0`` SSP.
        staleness_lr: divide the learning rate by the staleness (Zhang et al. 2016).
        dc_lambda: DC-ASGD's λ (0 = off); servers keep one copy of their shard per worker.
        compressor: a :class:`~lowcomm.compress.Compressor` for the pushed gradients (None: dense).
        worker_timeout_s: a worker silent this long (while owed nothing) is lost.
        server_timeout_s: a worker waiting this long with no reply and no heartbeat from a server
            raises :class:`ServerLost`.
        overlap: push each shard as soon as its gradients are complete in the backward pass (False:
            all shards in ``step()``).
        budget: stop after this many gradients in all (pushes and skips; None: serve until every
            worker calls :meth:`done`). Once a server has taken its ``budget``-th gradient its
            replies carry STOP and :attr:`stopped` turns True on the workers: fast workers do
            more steps than slow ones, as in any asynchronous run with a fixed sample budget.
        nonfinite: the NaN policy: ABORT (a NaN/Inf gradient is an error, never sent) or SKIP
            (the caller calls :meth:`skip`; the worker's clock advances without a gradient).
    """

    role = Role.WORKER

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Comm, *,
                 compressor, settings: AsyncPSSettings, nonfinite: NonFinite = NonFinite.ABORT,
                 budget: int | None = None):
        self.model, self.optimizer, self.comm = model, optimizer, comm
        self.settings = st = settings
        if self.comm.rank < st.servers:
            raise LowcommError(f"rank {self.comm.rank} is a parameter server (ranks 0..{st.servers - 1}): "
                               "build ParameterServer there")
        self.servers, self.workers = st.servers, self.comm.size - st.servers
        self.max_staleness, self.staleness_lr, self.dc_lambda = st.max_staleness, st.staleness_lr, st.dc_lambda
        self.compressor = compressor
        self.worker_timeout_s, self.server_timeout_s = st.worker_timeout_s, st.server_timeout_s
        self.nonfinite, self.budget = nonfinite, budget
        self.stopped = False             # a server said the budget is spent
        self.finished = False            # done() told the servers
        self.index = self.comm.rank - st.servers
        self._named = trainable(model)
        self._params = dict(self._named)
        self.shards = build_shards(self._named, st.servers)
        self.ps, self.ctl = channels(self.comm)
        self.clock = 0
        self.loss = float("nan")
        self._hooks = []
        self.block = BufferBlock(model)        # pushed to server 0, served back averaged
        self._replies = [Reply(sh, self.block.nbytes if s == 0 else 0)
                         for s, sh in enumerate(self.shards)]
        self._flat = [torch.zeros(sh.numel, dtype=sh.dtype) for sh in self.shards]
        self._pushed = [False] * self.servers
        self._push_req: list = [None] * self.servers
        self._pull_req: list = [None] * self.servers
        self._pending = [len(sh.segments) for sh in self.shards]
        self._shard_of = {seg.name: s for s, sh in enumerate(self.shards) for seg in sh.segments}
        self.lag_hist: dict[int, int] = {}
        self.wait_s = 0.0
        self.passes = BackwardPasses(st.backward_passes_per_step, lambda: None)
        if st.overlap and nonfinite is NonFinite.ABORT:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self._named]
        self._initial_pull()

    def _initial_pull(self) -> None:
        """Every worker starts from the servers' parameters (as SyncDP broadcasts rank 0's)."""
        reqs = [self.ps.irecv_(r.raw, s, TAG_INIT, op="pull") for s, r in enumerate(self._replies)]
        self._wait_all(reqs, "the initial parameters", list(range(self.servers)))
        for s in range(self.servers):
            self._load(s)

    # worker ---------------------------------------------------------------------------------
    def note_loss(self, loss: float) -> None:
        """The loss of the gradient about to be pushed (servers log it; call before backward)."""
        self.loss = float(loss)

    def _hook(self, name: str):
        s = self._shard_of[name]

        def hook(p: torch.Tensor) -> None:
            if not self.passes.exchanging():
                return                       # an accumulating pass: nothing is pushed yet
            if self._pushed[s]:
                raise LowcommError(f"worker {self.index}: a backward pass after this step's "
                                   "gradients were pushed; accumulate inside no_sync() or set "
                                   "backward_passes_per_step to the backward() calls per step")
            self._pending[s] -= 1
            if self._pending[s] == 0:
                self._gather(s)
                self._push(s, PUSH)
        return hook

    def _gather(self, s: int) -> torch.Tensor:
        flat = self._flat[s]
        for seg in self.shards[s].segments:
            g = self._params[seg.name].grad
            if g is None:
                flat[seg.start:seg.stop].zero_()
            else:
                if self.nonfinite is NonFinite.ABORT and not bool(torch.isfinite(g).all()):
                    raise NonFiniteError(self.comm.rank, f"the gradient of {seg.name!r}", self.clock + 1)
                flat[seg.start:seg.stop].copy_(g.reshape(-1))
        return flat

    def _push(self, s: int, kind: float) -> None:
        """Send shard ``s``'s gradient (gathered in ``_flat[s]``) or a skip to server ``s``, and
        post the receive of its reply."""
        if self._push_req[s] is not None:        # the server replied to it: long complete
            self._wait_all([self._push_req[s]], f"the previous push to server {s}", [s])
        header = np.zeros(HEADER, dtype=np.float64)
        header[0], header[1], header[2] = kind, self.clock, self.loss
        if kind != PUSH:
            payload, ctx = [], None
        elif self.compressor is None:
            payload, ctx = [self._flat[s]], None
        else:
            payload, ctx = self.compressor.compress(self._flat[s], f"shard{s}", self.shards[s].segments)
        if s == 0 and self.block.nbytes:
            payload = [*payload, self.block.pack()]
        buf = pack_push(header, payload, ctx, [g["lr"] for g in self.optimizer.param_groups])
        tot = self.ps.ledger.totals()            # cumulative traffic, for the servers' log lines
        fields = buf[:HEADER * 8].view(np.float64)
        fields[3], fields[4] = tot["bytes_sent"] + buf.nbytes, tot["bytes_recv"]
        # charged when posted, so the totals above never depend on when completion is noticed
        self._push_req[s] = self.ps.isend(torch.from_numpy(buf), s, TAG_PUSH, op="push", charge="post")
        self._pull_req[s] = self.ps.irecv_(self._replies[s].raw, s, TAG_PULL, op="pull")
        self._pushed[s] = True

    def step(self, closure=None):
        """Push the gradients not pushed yet, wait for every shard's reply, load the parameters."""
        if closure is not None:
            raise LowcommError("async-ps does not take a closure")
        self.passes.before_step()
        for s in range(self.servers):
            if not self._pushed[s]:
                self._gather(s)
                self._push(s, PUSH)
        self._finish_step()

    def no_sync(self):
        return self.passes.no_sync()

    def skip(self) -> None:
        """Abandon this step on this worker: its clock advances, no gradient is applied."""
        self.passes.before_step()
        if any(self._pushed):
            raise LowcommError("skip() after the backward pass pushed gradients (overlap); build "
                               "AsyncPS with nonfinite='skip' to push only in step()/skip()")
        for s in range(self.servers):
            if not self._pushed[s]:
                self._push(s, SKIP)
        self._finish_step()
        self.zero_grad()

    def _finish_step(self) -> None:
        t0 = time.perf_counter()
        self._wait_all(self._pull_req, "a reply", list(range(self.servers)))
        self.wait_s += time.perf_counter() - t0
        lag = 0
        for s, r in enumerate(self._replies):
            if r.header[2].item() == DROPPED:
                raise WorkerDropped(f"worker {self.index} (rank {self.comm.rank}): parameter server {s} "
                                    f"declared this worker lost (silent for more than "
                                    f"strategy.worker_timeout_s = {self.worker_timeout_s:g} s); stopping")
            lag = max(lag, int(r.header[1].item()))
            self.stopped = self.stopped or r.header[2].item() == STOP
            self._load(s)
        if not self.stopped:
            self.lag_hist[lag] = self.lag_hist.get(lag, 0) + 1
        self.clock += 1
        self._pushed = [False] * self.servers
        self._pending = [len(sh.segments) for sh in self.shards]

    def _load(self, s: int, vals: torch.Tensor | None = None) -> None:
        """Copy shard ``s``'s values (default: its last reply) into the model's parameters (and
        server 0's served buffers into the model's buffers)."""
        load_shard(self._params, self.shards[s], self._replies[s].values if vals is None else vals)
        if s == 0 and vals is None and self.block.nbytes:
            self.block.unpack(self._replies[0].extra)

    def _wait_all(self, reqs: list, what: str, servers: list[int]) -> None:
        """Poll ``reqs`` (``reqs[i]`` waits on server ``servers[i]``; each poll a watched
        :meth:`Request.test`), sleeping between polls; while a server owes a reply its heartbeats
        keep it alive, and ``server_timeout_s`` without either is :class:`ServerLost`."""
        heard = {s: time.monotonic() for s in servers}
        open_ = [i for i, r in enumerate(reqs) if r is not None]
        beat = torch.zeros(1, dtype=torch.float64)
        while open_:
            open_ = [i for i in open_ if not reqs[i].test()]
            if not open_:
                return
            now = time.monotonic()
            for i in open_:
                s = servers[i]
                while self.ctl.iprobe(s, TAG_BEAT) is not None:
                    self.ctl.recv_(beat, s, TAG_BEAT)
                    heard[s] = now
                if now - heard[s] > self.server_timeout_s:
                    raise ServerLost(f"worker {self.index} (rank {self.comm.rank}): parameter server "
                                     f"{s} (rank {s}) sent neither {what} nor a heartbeat for "
                                     f"{now - heard[s]:.1f} s (strategy.server_timeout_s = "
                                     f"{self.server_timeout_s:g}); it is gone, ending the job")
            time.sleep(POLL_S)

    def shard_values(self, s: int) -> torch.Tensor:
        """A buffer for shard ``s``'s values (the servers broadcast them at the end)."""
        return torch.empty(self.shards[s].numel, dtype=self.shards[s].dtype)

    def done(self, signum: int = 0) -> None:
        """Tell every server this worker is done (servers end when all workers are done or
        lost); ``signum``: it stops because it was sent that signal (the servers then stop
        every worker)."""
        self.finished = True
        done = torch.tensor([float(self.clock), float(signum)], dtype=torch.float64)
        reqs = [self.ctl.isend(done, s, TAG_DONE, op="done") for s in range(self.servers)]
        pushes = [s for s, r in enumerate(self._push_req) if r is not None]
        self._wait_all([*reqs, *[self._push_req[s] for s in pushes]], "the end of the run",
                       [*range(self.servers), *pushes])

    # state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"clock": self.clock, "lag_hist": dict(self.lag_hist)}
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.clock, self.lag_hist = state["clock"], dict(state["lag_hist"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks: this worker starts from the servers' parameters
        (:func:`~.protocol.reshard_model`) with clock 0 (the servers restart every clock) and a
        fresh compressor (its error feedback is reset, with a warning); its RNG state and loop
        counters are old worker ``index mod W_old``'s."""
        from ..reshard import reset_compressor
        from .protocol import reshard_model
        S, W_old = self.servers, len(old) - self.servers
        src = old[S + self.index % W_old]
        state = {"clock": 0, "lag_hist": {}}
        if self.compressor is not None:
            state["compressor"] = reset_compressor([s["strategy"].get("compressor") for s in old[S:]],
                                                   self.compressor.state_dict(), "async-ps")
        return {"model": reshard_model(old, self.shards), "strategy": state,
                "loop": src["loop"], "rng": src["rng"]}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
