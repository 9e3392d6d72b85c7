"""What parameter-server workers and servers agree on: roles, tags, message layouts, the shard
layout, the update rules' formulas and the errors.

Roles: MPI ranks ``0 … S-1`` are *servers* (``servers = S``), ranks ``S … K-1`` are *workers*
(worker index ``w = rank - S``). Parameter tensors are sharded over the servers, balanced by size
(largest tensor first onto the least-loaded server).

Messages (on a duplicate of the world communicator, the *PS channel*, charged to the method):

* ``TAG_PUSH`` worker → server: :func:`pack_push` (``HEADER`` float64s: kind, clock, loss,
  cumulative bytes sent and received, meta length, payload length; then the pickled payload
  layout, compressor context and the worker's learning rates — one per parameter group, the
  server steps with them, so the worker's LR schedule drives the servers — then the payload
  bytes; to server 0, the worker's buffers last, as one :class:`BufferBlock`);
* ``TAG_PULL`` / ``TAG_INIT`` server → worker: a :class:`Reply` (``HEADER`` float64s: version,
  clock lag, status; then the shard's values; from server 0, then the served buffers).

Buffers (BatchNorm's running statistics) are the workers' (servers never run a forward pass):
server 0 keeps every worker's latest buffers and serves their average (floating-point ones;
the others are the lowest-numbered worker's), and holds it in its model, which is the model
the run delivers.

On a second duplicate, the *control channel* (its own ledger: not charged to the method, and
heartbeats are timing-dependent): ``TAG_BEAT`` server → waiting worker (one float64, "I am
alive") and ``TAG_DONE`` worker → server (two float64: the worker's clock, and the signal that
stopped it or 0).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch

from ...compress import Segment
from ...errors import ConfigError, LowcommError
from ...settings import Settings as SettingsBase
from ...comm.ledger import Ledger
from ..layout import balance

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
class AsyncPSSettings(SettingsBase):
    """``[strategy]`` keys of ``async-ps``, the same on every rank (see
    :class:`~.worker.Worker` for each one's meaning); whether ``servers`` fits the rank count is
    checked when the method is built."""
    servers: int = 1               # S: ranks 0..S-1 serve parameter shards, the rest train
    max_staleness: int = -1        # τ: -1 fully asynchronous, 0 synchronous, > 0 SSP
    staleness_lr: bool = False     # lr / staleness (Zhang et al. 2016)
    dc_lambda: float = 0.0         # DC-ASGD's λ (Zheng et al. 2017); 0 = off
    worker_timeout_s: float = 30.0  # a worker silent this long (owed nothing) is lost
    server_timeout_s: float = 10.0  # a server silent this long (owing a reply) ends the job
    overlap: bool = True           # push full shards from inside the backward pass
    backward_passes_per_step: int = 1   # gradient accumulation: push after every N-th backward

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "servers", 1)
        if self.max_staleness < -1:
            raise ConfigError.at(prefix, "max_staleness", f"must be >= -1 (-1 = fully "
                                 f"asynchronous), got {self.max_staleness}")
        self.at_least(prefix, "dc_lambda", 0)
        self.within(prefix, "worker_timeout_s", 0, float("inf"), low_open=True)
        self.within(prefix, "server_timeout_s", 0, float("inf"), low_open=True)
        self.at_least(prefix, "backward_passes_per_step", 1)


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


def pack_push(header: np.ndarray, payload: list[torch.Tensor], ctx, lrs: list[float]) -> np.ndarray:
    """One push message: ``HEADER`` float64s, the pickled payload layout, ``ctx`` (the decoder
    needs it and, unlike inside an all-reduce, the server has no copy) and the learning rates
    ``lrs``, then the payload bytes."""
    meta = pickle.dumps(([(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in payload],
                         ctx, list(lrs)))
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


def unpack_push(buf: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor], object, list[float]]:
    """The inverse of :func:`pack_push`: ``(header, payload tensors, ctx, lrs)``."""
    header = buf[:HEADER * 8].view(np.float64).copy()
    n_meta = int(header[5])
    specs, ctx, lrs = pickle.loads(buf[HEADER * 8:HEADER * 8 + n_meta].tobytes())
    at, payload = HEADER * 8 + n_meta, []
    for dtype, shape in specs:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        payload.append(torch.from_numpy(buf[at:at + n].copy()).view(dt).view(shape))
        at += n
    return header, payload, ctx, lrs


class Reply:
    """A reply buffer: ``HEADER`` float64s (version, clock lag, status), the shard's values, then
    ``extra`` bytes (server 0: the served buffers, a :class:`BufferBlock`)."""

    def __init__(self, shard: Shard, extra: int = 0):
        n = shard.numel * torch.empty((), dtype=shard.dtype).element_size()
        self.raw = torch.empty(HEADER * 8 + n + extra, dtype=torch.uint8)
        self.header = self.raw[:HEADER * 8].view(torch.float64)
        self.values = self.raw[HEADER * 8:HEADER * 8 + n].view(shard.dtype)
        self.extra = self.raw[HEADER * 8 + n:]
        self.nbytes = self.raw.numel()


class BufferBlock:
    """A model's persistent buffers as one byte block (what a worker pushes to server 0 and
    server 0 serves back): :meth:`pack` / :meth:`unpack` copy between the model and a block,
    :meth:`average` merges several workers' blocks."""

    def __init__(self, model: torch.nn.Module):
        from ..buffers import persistent_buffers
        self.named = persistent_buffers(model)
        self.sizes = [b.numel() * b.element_size() for _, b in self.named]
        self.nbytes = sum(self.sizes)

    def _spans(self):
        at = 0
        for (_, b), n in zip(self.named, self.sizes):
            yield b, at, at + n
            at += n

    @torch.no_grad()
    def pack(self, block: torch.Tensor | None = None) -> torch.Tensor:
        """The model's buffers into ``block`` (a fresh uint8 tensor when None)."""
        block = torch.empty(self.nbytes, dtype=torch.uint8) if block is None else block
        for b, a, z in self._spans():
            block[a:z].copy_(b.detach().cpu().reshape(-1).view(torch.uint8))
        return block

    @torch.no_grad()
    def unpack(self, block: torch.Tensor) -> None:
        """``block``'s values into the model's buffers."""
        for b, a, z in self._spans():
            b.copy_(block[a:z].clone().view(b.dtype).view(b.shape))

    def average(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """One block: floating-point buffers averaged over ``blocks``, the others the first's."""
        out = blocks[0].clone()
        if len(blocks) > 1:
            for b, a, z in self._spans():
                if b.is_floating_point():
                    mean = sum(blk[a:z].clone().view(b.dtype).double() for blk in blocks) / len(blocks)
                    out[a:z].copy_(mean.to(b.dtype).view(torch.uint8))
        return out


def channels(comm):
    """The PS channel and the control channel (see the module docstring), duplicates of
    ``comm`` made collectively in the same order on every rank, servers and workers alike."""
    ps = comm.dup()                              # PS traffic: its own message space, same ledger
    ctl = comm.dup(Ledger(), "control")          # heartbeats and "done": not the method's bytes
    ctl.validate = False
    return ps, ctl


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters that train, in model order (what the shards hold)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def load_shard(params: dict, shard: Shard, vals: torch.Tensor) -> None:
    """Copy a shard's flat ``vals`` into the model's parameters ``params`` (name → tensor)."""
    with torch.no_grad():
        for seg in shard.segments:
            params[seg.name].copy_(vals[seg.start:seg.stop].view(seg.shape))


def reshard_model(old: list[dict], shards: list[Shard]) -> dict:
    """The run's model from the checkpoint of a parameter-server run (every old rank's state):
    each shard's parameters from the server that owns it (old rank s), buffers from rank 0.
    The number of servers is part of the config, so old and new runs shard alike."""
    model = dict(old[0]["model"])
    for shard in shards:
        for seg in shard.segments:
            model[seg.name] = old[shard.server]["model"][seg.name]
    return model


def fold(values: list, n: int) -> list:
    """Per-worker counters of W_old workers onto ``n`` workers: old worker w's to new worker
    ``w mod n``, summed (totals are kept)."""
    out = [0] * n
    for w, v in enumerate(values):
        out[w % n] += v
    return out
