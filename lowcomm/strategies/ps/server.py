"""The server side of the asynchronous parameter server: one shard, its optimizer, versions,
clocks, held replies, heartbeats and lost-worker detection (the update rules are in
:mod:`lowcomm.strategies.ps.async_ps`'s docstring).

A :class:`ParameterServer` is the role a server rank of
:class:`~lowcomm.strategies.ps.async_ps.AsyncPS` plays: it does not take training steps, it serves
(:meth:`ParameterServer.serve`) until every worker has finished or is lost. It talks to the
workers through :class:`~lowcomm.comm.comm.Comm` only (every call watched and charged), using what
:mod:`.protocol` defines and nothing of the worker's code.

The serving loop never blocks: pushes are matched with :meth:`Comm.improbe` (any worker, any
size) and received with non-blocking matched receives; replies and heartbeats are non-blocking
sends; between polls the loop sleeps briefly, so a server sharing a core with workers does not
steal it.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ...comm.comm import Comm
from ...errors import LowcommError
from ...settings import NonFinite
from ..base import Role
from .protocol import (DROPPED, OK, POLL_S, PUSH, STOP, TAG_BEAT, TAG_DONE, TAG_INIT, TAG_PULL,
                       TAG_PUSH, AsyncPSSettings, BufferBlock, Reply, build_shards, channels,
                       dc_compensate, load_shard, staleness_lr, trainable, unpack_push)

log = logging.getLogger("lowcomm.async_ps")


def _bump(hist: dict, key: int, n: int = 1) -> None:
    hist[key] = hist.get(key, 0) + n


class ParameterServer:
    """Serves shard ``index = comm.rank`` of ``model``'s parameters to the worker ranks.

    Built on server ranks (``comm.rank < servers``) by
    :class:`~lowcomm.strategies.ps.async_ps.AsyncPS` with the same settings as the workers'
    :class:`~lowcomm.strategies.ps.worker.Worker` (see it for their meaning); collective with
    the workers' constructors. ``optimizer`` steps this server's shard, at the learning rates
    each push carries; the shard's parameters become views of one flat vector :attr:`flat`.
    Server 0 also serves the buffers: the average of every worker's latest ones.
    """

    role = Role.SERVER

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Comm, *,
                 compressor, settings: AsyncPSSettings, nonfinite: NonFinite = NonFinite.ABORT,
                 budget: int | None = None):
        self.settings = st = settings
        if comm.rank >= st.servers:
            raise LowcommError(f"rank {comm.rank} is a worker (servers = ranks 0..{st.servers - 1}): "
                               "build AsyncPS there")
        self.model, self.optimizer, self.compressor = model, optimizer, compressor
        self.world = comm
        self.index = comm.rank
        self.servers, self.workers = st.servers, comm.size - st.servers
        self.max_staleness, self.staleness_lr, self.dc_lambda = st.max_staleness, st.staleness_lr, st.dc_lambda
        self.budget = budget
        self.interrupt = 0                      # a stop signal's number (here or a worker's)
        self.worker_timeout_s, self.server_timeout_s = st.worker_timeout_s, st.server_timeout_s
        self._params = dict(trainable(model))
        self.shards = build_shards(trainable(model), st.servers)
        self.comm, self.ctl = channels(comm)
        self.shard = self.shards[self.index]
        self.W, self.S = self.workers, self.servers
        self.tau = st.max_staleness
        self.taken = 0                          # gradients (and skips) taken, toward the budget
        # the shard's parameters become views of one flat vector: a reply is one copy, and
        # DC-ASGD's w − w_bak is one subtraction
        self.flat = torch.empty(self.shard.numel, dtype=self.shard.dtype)
        self._devices = {n: p.device for n, p in self._params.items()}   # where close() puts them back
        self._bind_flat()
        self._grad = torch.zeros_like(self.flat)
        self.version = 0
        self.clock = [0] * self.W
        self.read_version = [0] * self.W
        self.backup = [self.flat.clone() for _ in range(self.W)] if st.dc_lambda > 0 else None
        # server 0 serves the buffers: every worker's latest, averaged into this model's
        self.block = BufferBlock(model) if self.index == 0 else None
        self.worker_buffers: dict[int, torch.Tensor] = {}
        extra = self.block.nbytes if self.block is not None else 0
        self.replies = [Reply(self.shard, extra) for _ in range(self.W)]
        self.reply_req: list = [None] * self.W
        self.staleness: dict[int, int] = {}     # σ per applied gradient
        self.lag: dict[int, int] = {}           # clock lag per reply
        self.lag_since = 0                      # largest clock lag since the loop last read it
        self.applied = [0] * self.W             # gradients applied, per worker
        self.skipped = [0] * self.W
        self.recv_from = [0] * self.W           # push bytes received, per worker
        self.done: set[int] = set()
        self.lost: dict[int, dict] = {}
        self._dead_reqs: list = []              # requests to lost workers, never completed
        self.initial_push()

    @property
    def server(self) -> "ParameterServer":
        """This object (the loop reads ``ps.server`` on every server rank)."""
        return self

    def rank_of(self, w: int) -> int:
        return self.S + w

    def initial_push(self) -> None:
        """Send every worker the shard's starting values (the workers' initial pull)."""
        reqs = []
        for w in range(self.W):
            r = self.replies[w]
            r.header.zero_()
            r.values.copy_(self.flat)
            if self.block is not None:
                self.block.pack(r.extra)
            reqs.append(self.comm.isend(r.raw, self.rank_of(w), TAG_INIT, op="pull"))
        for req in reqs:
            req.wait()

    # the update -------------------------------------------------------------------------------
    def _decode(self, payload, ctx) -> torch.Tensor:
        c = self.compressor
        g = payload[0] if c is None else c.decompress(payload, ctx)
        g = g.reshape(-1).to(self.flat.dtype)
        if g.numel() != self.flat.numel():
            raise LowcommError(f"server {self.index}: a push decoded to {g.numel()} values, the "
                               f"shard has {self.flat.numel()}")
        return g

    def _take_buffers(self, w: int, block: torch.Tensor) -> None:
        """Server 0: worker ``w``'s buffers arrived; serve the average of every live worker's
        latest (this server's model holds it)."""
        self.worker_buffers[w] = block
        self.block.unpack(self.block.average([self.worker_buffers[v] for v in sorted(self.worker_buffers)
                                              if v not in self.lost]))

    def _step(self, grad: torch.Tensor, lr_scale: float, lrs: list[float]) -> None:
        """Steps 4–5: the optimizer steps the shard with ``grad`` at the pushing worker's
        learning rates ``lrs`` (one per parameter group) times ``lr_scale``."""
        opt = self.optimizer
        if len(lrs) != len(opt.param_groups):
            raise LowcommError(f"server {self.index}: a push carried {len(lrs)} learning rates for "
                               f"{len(opt.param_groups)} parameter groups")
        for seg in self.shard.segments:
            self._params[seg.name].grad = grad[seg.start:seg.stop].view(seg.shape)
        saved = [g["lr"] for g in opt.param_groups]
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr * lr_scale
        opt.step()
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr
        for seg in self.shard.segments:
            self._params[seg.name].grad = None
        self.version += 1

    def _apply_one(self, w: int, g: torch.Tensor, lrs: list[float]) -> int:
        """Steps 2–5 for one gradient of worker ``w``; returns its staleness σ."""
        sigma = self.version - self.read_version[w]
        if self.backup is not None:
            g = dc_compensate(g, self.flat, self.backup[w], self.dc_lambda)
        scale = staleness_lr(1.0, sigma) if self.staleness_lr else 1.0
        self._step(g, scale, lrs)
        return sigma

    def _apply_round(self, grads: dict[int, torch.Tensor], lrs: list[float]) -> None:
        """τ = 0: the mean of the round's gradients (worker order), one update (σ = 0) at the
        first worker's learning rates (the workers of a round are at the same step)."""
        if grads:
            acc = self._grad.zero_()
            for w in sorted(grads):
                g = grads[w]
                if self.backup is not None:
                    g = dc_compensate(g, self.flat, self.backup[w], self.dc_lambda)
                acc.add_(g)
            acc.div_(len(grads))
            self._step(acc, 1.0, lrs)
        else:
            self.version += 1
        _bump(self.staleness, 0, len(grads))

    # replies ----------------------------------------------------------------------------------
    def _active(self) -> list[int]:
        return [w for w in range(self.W) if w not in self.done and w not in self.lost]

    def _may_proceed(self, w: int) -> bool:
        if self.tau < 0:
            return True
        return self.clock[w] - min(self.clock[v] for v in self._active()) <= self.tau

    def _spent(self) -> bool:
        """The budget is spent, or a stop was asked for (:meth:`stop`): replies say STOP."""
        return bool(self.interrupt) or (self.budget is not None and self.taken >= self.budget)

    def stop(self, signum: int) -> None:
        """SIGINT/SIGTERM here or at a worker: answer STOP from now on, so every worker ends
        after the step it is in and :meth:`serve` returns when all have (nothing stays in
        flight: the loop then writes a checkpoint). Ignored once the budget is spent."""
        if not self._spent():
            self.interrupt = signum
            log.warning("parameter server %d (rank %d): stop requested (signal %d) after %d "
                        "gradients; stopping the workers", self.index, self.comm.rank, signum,
                        self.taken)

    def _reply(self, w: int, status: float = OK) -> None:
        if self.reply_req[w] is not None:       # the worker pushed again: it got the last one
            self.reply_req[w].wait()
        r = self.replies[w]
        active = self._active()
        lag = self.clock[w] - min(self.clock[v] for v in active) if w in active else 0
        r.header.zero_()
        r.header[0], r.header[1], r.header[2] = self.version, lag, status
        r.values.copy_(self.flat)
        if self.block is not None:
            self.block.pack(r.extra)
        if self.backup is not None:
            self.backup[w].copy_(self.flat)
        self.read_version[w] = self.version
        # charged when posted: a reply to a worker that dies before taking it still counts
        self.reply_req[w] = self.comm.isend(r.raw, self.rank_of(w), TAG_PULL, op="pull", charge="post")
        if status == OK:                        # STOP / DROPPED: nothing is computed on it
            _bump(self.lag, lag)
            self.lag_since = max(self.lag_since, lag)

    # the loop ---------------------------------------------------------------------------------
    def serve(self, on_update=None, on_idle=None) -> None:
        """Serve until every worker has finished or is lost. ``on_update(entries)`` is called
        after every update (after its replies are sent) with one ``(worker, push header,
        staleness or None)`` per gradient; ``on_idle()`` once per poll."""
        loop = _Loop(self.W, period=min(0.5, self.settings.server_timeout_s / 4))
        while len(self.done) + len(self.lost) < self.W:
            busy = self._match_pushes(loop)
            busy = self._take_done(loop) or busy
            busy = self._receive(loop) or busy
            busy = self._close_round(loop) or busy
            busy = self._release(loop) or busy
            for entries in loop.updates:  # after the replies: a callback may checkpoint (collective)
                on_update(entries) if on_update else None
            loop.updates = []
            busy = self._watch(loop) or busy
            if on_idle:
                on_idle()
            if not busy:
                time.sleep(POLL_S)
        self._dead_reqs.extend(loop.inflight)  # pushes of lost workers that never completed
        for w in range(self.W):           # the last replies to finished workers have landed
            if self.reply_req[w] is not None and w not in self.lost:
                self.reply_req[w].wait()

    def _match_pushes(self, loop: "_Loop") -> bool:
        """Match every arrived push and start receiving it; whether one arrived."""
        busy = False
        while True:
            msg = self.comm.improbe(Comm.ANY_SOURCE, Comm.ANY_TAG)
            if msg is None:
                return busy
            busy = True
            w = msg.source - self.S
            if msg.tag != TAG_PUSH:
                raise LowcommError(f"server {self.index}: unexpected message tag {msg.tag} "
                                   f"from rank {msg.source}")
            buf = np.empty(msg.nbytes, dtype=np.uint8)
            loop.inflight.append((w, buf, msg.irecv_(torch.from_numpy(buf), op="push")))
            loop.last[w] = time.monotonic()

    def _take_done(self, loop: "_Loop") -> bool:
        """Workers that finished (sent after their last reply); whether one did."""
        busy = False
        while True:
            msg = self.ctl.improbe(Comm.ANY_SOURCE, TAG_DONE)
            if msg is None:
                return busy
            busy = True
            msg.recv_(loop.done_buf, op="done")
            w = msg.source - self.S
            self.done.add(w)
            if loop.done_buf[1] > 0:      # the worker was sent SIGINT/SIGTERM: stop them all
                self.stop(int(loop.done_buf[1]))
            loop.last[w] = time.monotonic()

    def _receive(self, loop: "_Loop") -> bool:
        """Take every push whose receive completed (τ = 0: into the round's stash; else apply
        it); whether one did."""
        busy, still = False, []
        for w, buf, req in loop.inflight:
            if not req.test():
                still.append((w, buf, req))
                continue
            busy = True
            loop.last[w] = time.monotonic()
            self.recv_from[w] += buf.nbytes
            if w in self.lost:            # declared lost, yet alive: tell it to stop
                self._reply(w, DROPPED)
                continue
            self._take_push(loop, w, buf)
        loop.inflight = still
        return busy

    def _take_push(self, loop: "_Loop", w: int, buf: np.ndarray) -> None:
        header, payload, ctx, lrs = unpack_push(buf)
        if self.block is not None and self.block.nbytes:
            self._take_buffers(w, payload.pop())
        if int(header[1]) != self.clock[w]:
            raise LowcommError(f"server {self.index}: worker {w} pushed clock {int(header[1])}, "
                               f"expected {self.clock[w]}")
        g = self._decode(payload, ctx) if header[0] == PUSH else None
        if self.tau == 0:
            loop.stash[w] = (header, g, lrs)
            loop.held.add(w)
            return
        sigma = None
        self.taken += 1
        if g is not None:
            sigma = self._apply_one(w, g, lrs)
            _bump(self.staleness, sigma)
            self.applied[w] += 1
        else:
            self.skipped[w] += 1
        self.clock[w] += 1
        loop.held.add(w)
        loop.updates.append([(w, header, sigma)])

    def _close_round(self, loop: "_Loop") -> bool:
        """τ = 0: once every active worker pushed, one update with the round's mean; whether
        it did."""
        if not (self.tau == 0 and loop.stash and all(w in loop.stash for w in self._active())):
            return False
        stash = loop.stash
        grads = {w: g for w, (h, g, _) in stash.items() if g is not None}
        self._apply_round(grads, stash[min(stash)][2])
        self.taken += len(stash)
        for w, (h, g, _) in stash.items():
            self.clock[w] += 1
            if g is None:
                self.skipped[w] += 1
            else:
                self.applied[w] += 1
        loop.updates.append([(w, h, 0 if g is not None else None) for w, (h, g, _) in sorted(stash.items())])
        loop.stash = {}
        return True

    def _release(self, loop: "_Loop") -> bool:
        """Step 6: release the replies SSP allows; whether one was sent."""
        busy = False
        for w in sorted(loop.held):
            if w in self.lost or w in self.done:
                loop.held.discard(w)
            elif (self.tau != 0 or w not in loop.stash) and (self._spent() or self._may_proceed(w)):
                self._reply(w, STOP if self._spent() else OK)
                loop.held.discard(w)
                loop.last[w] = time.monotonic()
                busy = True
        return busy

    def _watch(self, loop: "_Loop") -> bool:
        """Declare lost the workers silent while owed nothing (or whose push never lands), and
        send the workers kept waiting a heartbeat now and then; whether one was lost."""
        busy = False
        now = time.monotonic()
        for w in self._active():
            if w not in loop.held and now - loop.last[w] > self.settings.worker_timeout_s:
                self._lose(w, now - loop.last[w], loop.stash)
                busy = True
        if now >= loop.next_beat:          # the workers we keep waiting know we are alive
            loop.beats = [b for b in loop.beats if not b.test()]
            for w in loop.held:
                loop.beats.append(self.ctl.isend(loop.beat, self.rank_of(w), TAG_BEAT, op="beat"))
            loop.next_beat = now + loop.period
        return busy

    def _lose(self, w: int, silent_s: float, stash: dict) -> None:
        self.lost[w] = {"worker": w, "rank": self.rank_of(w), "clock": self.clock[w],
                        "silent_s": round(silent_s, 2)}
        stash.pop(w, None)
        if self.reply_req[w] is not None:
            self._dead_reqs.append((self.reply_req[w], self.replies[w]))
            self.reply_req[w] = None
        log.warning("parameter server %d (rank %d): worker %d (rank %d) sent nothing for %.1f s "
                    "(strategy.worker_timeout_s = %g): treating it as lost after %d gradients; the "
                    "other workers go on", self.index, self.comm.rank, w, self.rank_of(w), silent_s,
                    self.settings.worker_timeout_s, self.clock[w])

    # state ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"staleness": dict(self.staleness), "clock_lag": dict(self.lag),
                "applied": list(self.applied), "skipped": list(self.skipped),
                "recv_from": list(self.recv_from), "lost": dict(self.lost), "version": self.version}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "version": self.version, "taken": self.taken,
                "clock": list(self.clock), "read_version": list(self.read_version),
                "backup": self.backup, "staleness": dict(self.staleness), "lag": dict(self.lag),
                "applied": list(self.applied), "skipped": list(self.skipped),
                "recv_from": list(self.recv_from),
                "worker_buffers": {w: b.clone() for w, b in self.worker_buffers.items()}}

    def _bind_flat(self) -> None:
        """Copy the shard's parameters into ``flat`` and make them views of it."""
        with torch.no_grad():
            for seg in self.shard.segments:
                p = self._params[seg.name]
                self.flat[seg.start:seg.stop].copy_(p.detach().reshape(-1))
                p.data = self.flat[seg.start:seg.stop].view(seg.shape)

    def load_state_dict(self, state: dict) -> None:
        """Restore (after the model's state: the shard's values are the model's parameters)."""
        self._bind_flat()
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.clock, self.taken = state["version"], list(state["clock"]), state["taken"]
        self.read_version = list(state["read_version"])
        self.backup = state["backup"]
        self.staleness, self.lag = dict(state["staleness"]), dict(state["lag"])
        self.applied, self.skipped = list(state["applied"]), list(state["skipped"])
        self.recv_from = list(state["recv_from"])
        self.worker_buffers = {int(w): b.clone() for w, b in state.get("worker_buffers", {}).items()}

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks (the same ``servers``, so W_old → W workers): this
        server's shard, optimizer state and version carry over from old rank ``index``; the
        gradients taken toward the budget become ``step × W`` (step-equivalents, so the rest of
        the budget is the remaining steps on W workers); every worker's clock restarts at 0 and
        its read version is the current version (each new worker starts from the servers'
        parameters); per-worker counters are folded (old worker w's onto w mod W), those of the
        run's log (``loop``) included."""
        from .protocol import fold, reshard_model
        W_old = len(old) - self.S
        mine = dict(old[self.index]["strategy"])
        step = mine["taken"] // W_old
        model = reshard_model(old, self.shards)
        flat = torch.cat([model[seg.name].reshape(-1) for seg in self.shard.segments])
        mine.update(taken=step * self.W, clock=[0] * self.W, read_version=[mine["version"]] * self.W,
                    backup=[flat.clone() for _ in range(self.W)] if self.backup is not None else None,
                    applied=fold(mine["applied"], self.W), skipped=fold(mine["skipped"], self.W),
                    recv_from=fold(mine["recv_from"], self.W), worker_buffers={})
        loop = dict(old[self.index]["loop"])         # the run's log: per-worker traffic folds too
        if "traffic" in loop:
            loop.update(traffic=fold(loop["traffic"], self.W), gradients=step * self.W)
        return {"model": model, "strategy": mine, "loop": loop}

    def shard_values(self, s: int) -> torch.Tensor:
        """Shard ``s``'s values: this server's own, else a buffer to receive them into."""
        if s == self.index:
            return self.flat.clone()
        return torch.empty(self.shards[s].numel, dtype=self.shards[s].dtype)

    def load_shard(self, s: int, vals: torch.Tensor) -> None:
        """Copy server ``s``'s shard values ``vals`` into the model (rank 0 assembles the model
        from the other servers' end-of-run reports)."""
        load_shard(self._params, self.shards[s], vals)

    def close(self) -> None:
        """The shard's parameters, served from a flat CPU vector, go back to the device the
        model was on (a CUDA model ends on its GPU on the servers too)."""
        with torch.no_grad():
            for seg in self.shard.segments:
                p, device = self._params[seg.name], self._devices[seg.name]
                if p.device != device:
                    p.data = p.data.to(device)


class _Loop:
    """What :meth:`ParameterServer.serve` keeps from one poll to the next."""

    def __init__(self, workers: int, period: float):
        now = time.monotonic()
        self.last = [now] * workers       # last message from, or reply to, each worker
        self.held: set[int] = set()       # workers owed a reply
        self.stash: dict[int, tuple] = {}     # τ = 0: this round's pushes
        self.inflight: list = []          # (worker, buffer, request) of pushes being received
        self.beats: list = []
        self.beat = torch.zeros(1, dtype=torch.float64)
        self.done_buf = torch.zeros(2, dtype=torch.float64)     # the worker's clock, its stop signal
        self.period = period
        self.next_beat = now + period
        self.updates: list = []           # per update: [(worker, push header, σ or None)]
