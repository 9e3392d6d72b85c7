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

Example::

    ps = AsyncPS(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, servers=1,
                 max_staleness=2)
    if ps.is_server:
        ps.serve()                   # until every worker has finished or is lost
    else:
        for x, y in batches:
            ps.zero_grad(); loss = model.loss(x, y); ps.note_loss(loss.item())
            loss.backward(); ps.step()   # push gradients, pull parameters
        ps.done()
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..compress import Segment
from ..comm import Comm, mpi
from ..errors import LowcommError, NonFiniteError
from .base import Strategy, balance

log = logging.getLogger("lowcomm.async_ps")

TAG_PUSH, TAG_PULL, TAG_DONE, TAG_BEAT, TAG_INIT = 71, 72, 73, 74, 75
HEADER = 8                     # float64 fields leading every push and every reply
PUSH, SKIP = 1.0, 2.0          # push kinds
OK, DROPPED, STOP = 0.0, 1.0, 2.0   # reply status (STOP: the run's gradient budget is spent)
POLL_S = 0.0005                # idle sleep between polls (a spinning poll would steal a core)


class ServerLost(LowcommError):
    """A parameter server stopped answering; the job cannot continue without its shard."""


class WorkerDropped(LowcommError):
    """This worker was declared lost by a server (it was silent past ``worker_timeout_s``)."""

    exit_code = 4


class WorkersLost(LowcommError):
    """The run finished, but some workers were lost on the way (the summary names them)."""

    exit_code = 4


@dataclass
class Shard:
    """The parameters one server owns: ``segments`` index one flat vector of ``numel`` values."""
    server: int
    segments: list[Segment]
    numel: int
    dtype: torch.dtype

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]


def build_shards(named: list[tuple[str, torch.Tensor]], servers: int) -> list[Shard]:
    """Shard ``named`` parameters over ``servers`` (each tensor whole; model order inside a shard)."""
    if len(named) < servers:
        raise ValueError(f"{servers} servers but only {len(named)} parameter tensors to shard")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        raise ValueError(f"async-ps needs one parameter dtype, got {sorted(map(str, dtypes))}")
    where = balance([p.numel() for _, p in named], servers)
    shards = []
    for s in range(servers):
        segs, n = [], 0
        for (name, p), b in zip(named, where):
            if b == s:
                segs.append(Segment(name, p.shape, n, n + p.numel()))
                n += p.numel()
        shards.append(Shard(s, segs, n, next(iter(dtypes))))
    return shards


def staleness_lr(lr: float, sigma: int) -> float:
    """Zhang et al. 2016's staleness-dependent learning rate ``lr / σ`` (``lr`` when σ = 0)."""
    return lr / max(sigma, 1)


def dc_compensate(g: torch.Tensor, w: torch.Tensor, w_bak: torch.Tensor, lam: float) -> torch.Tensor:
    """DC-ASGD's delay-compensated gradient ``g + λ · g ⊙ g ⊙ (w - w_bak)`` (Zheng et al. 2017)."""
    return g + lam * g * g * (w - w_bak)


def recovery_enabled() -> bool | None:
    """Whether Open MPI's mpirun keeps the job alive when a process dies (None: not Open MPI)."""
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return None
    return os.environ.get("OMPI_MCA_orte_enable_recovery", "0").lower() in ("1", "true", "yes")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def pack_push(header: np.ndarray, payload: list[torch.Tensor], ctx) -> np.ndarray:
    """One push message: ``HEADER`` float64s, the pickled payload layout and ``ctx`` (the decoder
    needs it and, unlike inside an all-reduce, the server has no copy), then the payload bytes."""
    meta = pickle.dumps(([(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in payload], ctx))
    body = sum(t.numel() * t.element_size() for t in payload)
    header[5], header[6] = len(meta), body
    out = np.empty(HEADER * 8 + len(meta) + body, dtype=np.uint8)
    out[:HEADER * 8] = header.view(np.uint8)
    out[HEADER * 8:HEADER * 8 + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
    at = HEADER * 8 + len(meta)
    for t in payload:
        n = t.numel() * t.element_size()
        out[at:at + n] = _np(t.detach().contiguous())
        at += n
    return out


def unpack_push(buf: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor], object]:
    header = buf[:HEADER * 8].view(np.float64).copy()
    n_meta = int(header[5])
    specs, ctx = pickle.loads(buf[HEADER * 8:HEADER * 8 + n_meta].tobytes())
    at, payload = HEADER * 8 + n_meta, []
    for dtype, shape in specs:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        payload.append(torch.from_numpy(buf[at:at + n].copy()).view(dt).view(shape))
        at += n
    return header, payload, ctx


class Reply:
    """A reply buffer: ``HEADER`` float64s (version, clock lag, status) then the shard's values."""

    def __init__(self, shard: Shard):
        self.raw = torch.empty(HEADER * 8 + shard.numel * torch.empty((), dtype=shard.dtype).element_size(),
                               dtype=torch.uint8)
        self.header = self.raw[:HEADER * 8].view(torch.float64)
        self.values = self.raw[HEADER * 8:].view(shard.dtype)
        self.nbytes = self.raw.numel()


class AsyncPS(Strategy):
    """Asynchronous sharded parameter server with bounded staleness (see the module docstring for
    the papers and the update as numbered steps).

    Args:
        model, optimizer: the user's torch objects (the same code on every rank). On server ranks
            the optimizer steps the server's shard; on worker ranks it is not used.
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
        nonfinite: ``"raise"`` (a NaN/Inf gradient is an error, never sent) or ``"skip"`` (the
            caller calls :meth:`skip`; the worker's clock advances without a gradient).
    """

    name = "async-ps"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, servers: int = 1, max_staleness: int = -1,
                 staleness_lr: bool = False, dc_lambda: float = 0.0, compressor=None,
                 worker_timeout_s: float = 30.0, server_timeout_s: float = 10.0,
                 overlap: bool = True, nonfinite: str = "raise", budget: int | None = None):
        super().__init__(model, optimizer, comm)
        K = self.comm.size
        if not 1 <= servers < K:
            raise LowcommError(f"async-ps needs 1 <= strategy.servers < ranks so that at least one "
                               f"rank trains; got servers={servers} on {K} ranks")
        if max_staleness < -1:
            raise ValueError(f"max_staleness must be >= -1 (-1 = fully asynchronous), got {max_staleness}")
        if dc_lambda < 0:
            raise ValueError(f"dc_lambda must be >= 0, got {dc_lambda}")
        if not (worker_timeout_s > 0 and server_timeout_s > 0):
            raise ValueError("worker_timeout_s and server_timeout_s must be > 0")
        if budget is not None and budget < 1:
            raise ValueError(f"budget must be >= 1 gradients, got {budget}")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.servers, self.workers = servers, K - servers
        self.max_staleness, self.staleness_lr, self.dc_lambda = max_staleness, staleness_lr, dc_lambda
        self.compressor = compressor
        self.worker_timeout_s, self.server_timeout_s = worker_timeout_s, server_timeout_s
        self.nonfinite, self.budget = nonfinite, budget
        self.stopped = False             # a server said the budget is spent
        self.is_server = self.comm.rank < servers
        self.index = self.comm.rank if self.is_server else self.comm.rank - servers
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = dict(self._named)
        self.shards = build_shards(self._named, servers)
        self.ps = self.comm.dup()              # PS traffic: its own message space, same ledger
        self.clock = 0
        self.loss = float("nan")
        self._hooks = []
        if self.is_server:
            from .ps_server import ParameterServer
            self.server = ParameterServer(self)
        else:
            self.server = None
            self._setup_worker(overlap and nonfinite == "raise")
        self._initial_pull()

    @classmethod
    def from_config(cls, cfg, model, optimizer, comm):
        from ..compress import build_compressor
        s = cfg.strategy
        return cls(model, optimizer, comm, servers=s.servers, max_staleness=s.max_staleness,
                   staleness_lr=s.staleness_lr, dc_lambda=s.dc_lambda,
                   compressor=build_compressor(cfg.compressor), worker_timeout_s=s.worker_timeout_s,
                   server_timeout_s=s.server_timeout_s, overlap=s.overlap,
                   nonfinite="skip" if cfg.on_nonfinite == "skip" else "raise",
                   budget=cfg.steps * (comm.size - s.servers))

    # set-up ---------------------------------------------------------------------------------
    def _setup_worker(self, hooks: bool) -> None:
        self._replies = [Reply(sh) for sh in self.shards]
        self._flat = [torch.zeros(sh.numel, dtype=sh.dtype) for sh in self.shards]
        self._pushed = [False] * self.servers
        self._push_req: list = [None] * self.servers
        self._push_buf: list = [None] * self.servers
        self._pull_req: list = [None] * self.servers
        self._pending = [len(sh.segments) for sh in self.shards]
        self._shard_of = {seg.name: s for s, sh in enumerate(self.shards) for seg in sh.segments}
        self.lag_hist: dict[int, int] = {}
        self.wait_s = 0.0
        if hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self._named]

    def _initial_pull(self) -> None:
        """Every worker starts from the servers' parameters (as SyncDP broadcasts rank 0's)."""
        MPI = mpi()
        t0 = time.perf_counter()
        if self.is_server:
            self.server.initial_push()
            return
        reqs = [self.ps.mpi.Irecv([_np(r.raw), MPI.BYTE], s, TAG_INIT)
                for s, r in enumerate(self._replies)]
        self._wait_all(reqs, "the initial parameters", list(range(self.servers)))
        for s, r in enumerate(self._replies):
            self._load(s)
            self.ps.ledger.record("pull", self.ps.level, 0, r.nbytes, time.perf_counter() - t0)

    # worker ---------------------------------------------------------------------------------
    def note_loss(self, loss: float) -> None:
        """The loss of the gradient about to be pushed (servers log it; call before backward)."""
        self.loss = float(loss)

    def _hook(self, name: str):
        s = self._shard_of[name]

        def hook(p: torch.Tensor) -> None:
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
                if self.nonfinite == "raise" and not bool(torch.isfinite(g).all()):
                    raise NonFiniteError(self.comm.rank, f"the gradient of {seg.name!r}", self.clock + 1)
                flat[seg.start:seg.stop].copy_(g.reshape(-1))
        return flat

    def _push(self, s: int, kind: float) -> None:
        """Send shard ``s``'s gradient (gathered in ``_flat[s]``) or a skip to server ``s``, and
        post the receive of its reply."""
        MPI = mpi()
        t0 = time.perf_counter()
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
        buf = pack_push(header, payload, ctx)
        tot = self.ps.ledger.totals()            # cumulative traffic, for the servers' log lines
        fields = buf[:HEADER * 8].view(np.float64)
        fields[3], fields[4] = tot["bytes_sent"] + buf.nbytes, tot["bytes_recv"]
        self._push_buf[s] = buf
        self._push_req[s] = self.ps.mpi.Isend([buf, MPI.BYTE], s, TAG_PUSH)
        self._pull_req[s] = self.ps.mpi.Irecv([_np(self._replies[s].raw), MPI.BYTE], s, TAG_PULL)
        self._pushed[s] = True
        self.ps.ledger.record("push", self.ps.level, buf.nbytes, 0, time.perf_counter() - t0)

    def step(self, closure=None):
        """Push the gradients not pushed yet, wait for every shard's reply, load the parameters."""
        if self.is_server:
            raise LowcommError(f"rank {self.comm.rank} is a parameter server: call serve(), not step()")
        if closure is not None:
            raise LowcommError("async-ps does not take a closure")
        for s in range(self.servers):
            if not self._pushed[s]:
                self._gather(s)
                self._push(s, PUSH)
        self._finish_step()

    def skip(self) -> None:
        """Abandon this step on this worker: its clock advances, no gradient is applied."""
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
            self.ps.ledger.record("pull", self.ps.level, 0, r.nbytes, 0.0)
        if not self.stopped:
            self.lag_hist[lag] = self.lag_hist.get(lag, 0) + 1
        self.clock += 1
        self._pushed = [False] * self.servers
        self._pending = [len(sh.segments) for sh in self.shards]

    def _load(self, s: int, vals: torch.Tensor | None = None) -> None:
        """Copy shard ``s``'s values (default: its last reply) into the model's parameters."""
        vals = self._replies[s].values if vals is None else vals
        with torch.no_grad():
            for seg in self.shards[s].segments:
                self._params[seg.name].copy_(vals[seg.start:seg.stop].view(seg.shape))

    def _wait_all(self, reqs: list, what: str, servers: list[int]) -> None:
        """Poll ``reqs`` (``reqs[i]`` waits on server ``servers[i]``), sleeping between polls; while
        a server owes a reply its heartbeats keep it alive, and ``server_timeout_s`` without either
        is :class:`ServerLost`."""
        MPI = mpi()
        heard = {s: time.monotonic() for s in servers}
        open_ = [i for i, r in enumerate(reqs) if r is not None]
        beat = np.zeros(1, dtype=np.float64)
        while open_:
            open_ = [i for i in open_ if not reqs[i].Test()]
            if not open_:
                return
            now = time.monotonic()
            for i in open_:
                s = servers[i]
                while self.ps.mpi.Iprobe(s, TAG_BEAT):
                    self.ps.mpi.Recv([beat, MPI.DOUBLE], s, TAG_BEAT)
                    heard[s] = now
                if now - heard[s] > self.server_timeout_s:
                    raise ServerLost(f"worker {self.index} (rank {self.comm.rank}): parameter server "
                                     f"{s} (rank {s}) sent neither {what} nor a heartbeat for "
                                     f"{now - heard[s]:.1f} s (strategy.server_timeout_s = "
                                     f"{self.server_timeout_s:g}); it is gone, ending the job")
            time.sleep(POLL_S)

    def done(self) -> None:
        """Tell every server this worker is done (servers end when all workers are done or lost)."""
        if self.is_server:
            return
        MPI = mpi()
        done = np.array([float(self.clock)])
        reqs = [self.ps.mpi.Isend([done, MPI.DOUBLE], s, TAG_DONE) for s in range(self.servers)]
        pushes = [s for s, r in enumerate(self._push_req) if r is not None]
        self._wait_all([*reqs, *[self._push_req[s] for s in pushes]], "the end of the run",
                       [*range(self.servers), *pushes])

    def serve(self, on_update=None, on_idle=None) -> None:
        """Serve until every worker has finished or is lost (server ranks only). ``on_update(
        entries)`` is called after every update (after its replies are sent) with one
        ``(worker, push header, staleness or None)`` per gradient; ``on_idle()`` once per poll."""
        if not self.is_server:
            raise LowcommError(f"rank {self.comm.rank} is a worker: it trains, it does not serve()")
        self.server.serve(on_update, on_idle)

    # state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.is_server:
            return self.server.state_dict()
        state = {"clock": self.clock, "lag_hist": dict(self.lag_hist)}
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.is_server:
            self.server.load_state_dict(state)
            return
        self.clock, self.lag_hist = state["clock"], dict(state["lag_hist"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
