"""Comm: a thin wrapper over an mpi4py intracommunicator that moves torch tensors.

Every call uses mpi4py's buffer (upper-case) interface on the tensor's own memory, so nothing is
pickled on a hot path, and records bytes and seconds in a :class:`~lowcomm.comm.ledger.Ledger` under
the communicator's ``level`` ("world", "node", "dc", ...).

Device handling lives here and nowhere else: a CUDA tensor is staged through a reusable pinned
host buffer (after a stream sync) and copied back after the op. Everything above Comm works on
whatever device the tensor lives on.

mpi4py is imported lazily, so importing lowcomm makes no MPI call.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import zlib
from contextlib import contextmanager
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import CommError
from .idle import IdleWait
from .ledger import Ledger, charge_comm_cpu, wire_bytes
from .watchdog import Watchdog

#: the blocking calls :meth:`Comm._call` can wait for asleep: their non-blocking forms
_NONBLOCKING = {"Allreduce": "Iallreduce", "Allgather": "Iallgather", "Allgatherv": "Iallgatherv",
                "Alltoall": "Ialltoall", "Alltoallv": "Ialltoallv", "Bcast": "Ibcast",
                "Barrier": "Ibarrier", "Reduce_scatter": "Ireduce_scatter", "Send": "Isend",
                "Recv": "Irecv", "Wait": "Wait"}


def _clock() -> tuple[float, float]:
    """Start of a timed MPI call: (wall, this thread's CPU time)."""
    return time.perf_counter(), time.thread_time()


def _since(t0: tuple[float, float]) -> float:
    """Wall seconds since :func:`_clock`; the thread's CPU seconds in between go to
    :func:`~lowcomm.comm.ledger.charge_comm_cpu` (MPI busy-polls while it waits)."""
    charge_comm_cpu(time.thread_time() - t0[1])
    return time.perf_counter() - t0[0]


_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
                torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
                torch.bool: 10}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_META_LEN = 12          # dtype, numel, ndim, 6 dims, hash of further dims, op hash, root
#: the launchers' count of the job's ranks on this node (Open MPI, MPICH/Hydra)
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_HALF_OPS: dict = {}                # torch dtype -> MPI.Op summing 16-bit floats, created on first use
#: SharedWindow.sync: seconds a waiting rank polls (yielding its core between polls to any
#: thread that wants it) before it naps; a rank with a core of its own sees its peers arrive at
#: once, and an oversubscribed one hands the core over at every poll
_SHM_YIELD_S = 0.002


def mpi():
    """The ``mpi4py.MPI`` module, imported (and MPI initialised) on first use."""
    from mpi4py import MPI
    return MPI


def _half_sum_op(dtype: torch.dtype):
    """An MPI user op summing float16 / bfloat16 (MPI has no 16-bit float type to reduce)."""
    if dtype not in _HALF_OPS:
        def fn(inbuf, inoutbuf, datatype, _dtype=dtype):
            if len(inoutbuf) == 0:
                return
            acc = torch.frombuffer(inoutbuf, dtype=_dtype)
            acc.add_(torch.frombuffer(inbuf, dtype=_dtype))
        _HALF_OPS[dtype] = mpi().Op.Create(fn, commute=True)
    return _HALF_OPS[dtype]


def _typed(t: torch.Tensor):
    """``(buffer, MPI datatype, MPI sum op)`` for a contiguous CPU tensor, for vendor reductions."""
    MPI = mpi()
    flat = t.reshape(-1)
    if t.dtype in (torch.float16, torch.bfloat16):
        return [flat.view(torch.int16).numpy(), MPI.INT16_T], _half_sum_op(t.dtype)
    kinds = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T,
             torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
             torch.uint8: MPI.UINT8_T}
    if t.dtype not in kinds:
        raise TypeError(f"cannot reduce tensors of dtype {t.dtype}")
    return [flat.numpy(), kinds[t.dtype]], MPI.SUM


def _raw(t: torch.Tensor):
    """The tensor's bytes as an MPI.BYTE buffer (point-to-point and gathers need no type)."""
    return [t.reshape(-1).view(torch.uint8).numpy(), mpi().BYTE]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class Traffic(NamedTuple):
    """The bytes a non-blocking op sends and receives; ``charged``: charged to the ledger when
    the op was posted (not again when it completes)."""
    sent: int
    recv: int
    charged: bool = False


class Request:
    """A non-blocking op in flight. :meth:`wait` (blocking, watched) or :meth:`test` (one
    watched poll) completes it and charges the ledger ``op``'s ``traffic``, unless it was
    charged when the op was posted."""

    def __init__(self, comm: "Comm", req, op: str, traffic: Traffic,
                 finish: Callable[[], None] | None = None, keep=None, peer: int | None = None):
        self._comm, self._req, self.op, self._peer = comm, req, op, peer
        self._sent, self._recv, charged = traffic
        self._finish = finish
        self._ledger = comm.ledger  # the ledger in force when posted (Comm.charged_to)
        self._keep = keep          # buffers MPI reads or writes until completion
        self._done = False
        self._charged = charged

    def wait(self) -> None:
        if self._done:
            return
        t0 = _clock()
        self._comm._guard(self.op, self._sent, self._req.Wait, peer=self._peer)
        self._complete(_since(t0))

    def test(self) -> bool:
        if self._done:
            return True
        t0 = _clock()
        flag = self._comm._guard(self.op, self._sent, self._req.Test, peer=self._peer)
        if flag:
            self._complete(_since(t0))
        return bool(flag)

    def _complete(self, seconds: float) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
        self._keep = None
        if not self._charged:
            self._ledger.record(self.op, self._comm.level, self._sent, self._recv, seconds)


class Comm:
    """A communicator: ``rank``, ``size``, ``level`` and tensor collectives recorded in ``ledger``.

    Args:
        mpi_comm: an ``mpi4py.MPI.Intracomm``.
        ledger: where traffic is recorded; communicators made by :meth:`split` share it.
        level: the name this communicator's traffic is filed under.
        validate: check that every rank passes the same shape and dtype before a collective
            (one 96-byte all-gather per call; turn off on hot paths whose shapes are fixed).
        watchdog: ends the job when one call waits longer than its limit (shared by the
            communicators made from this one; the limit scales with the α–β prediction of the
            call on :attr:`link`: :mod:`lowcomm.comm.watchdog`; default floor
            ``$LOWCOMM_TIMEOUT_S`` or 60 s).

    Example::

        comm = lowcomm.init()
        t = torch.ones(4) * comm.rank
        comm.allreduce_(t)            # vendor MPI_Allreduce, in place
    """

    # as a :class:`~lowcomm.comm.roles.Peers` and :class:`~lowcomm.comm.roles.Whole`: MPI's ranks
    rounds = per_rank = late_rounds = arrivals = False
    channel = dcs = None

    def __init__(self, mpi_comm, ledger: Ledger | None = None, level: str = "world",
                 validate: bool = True, watchdog: Watchdog | None = None):
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.level = level
        self.ledger = ledger if ledger is not None else Ledger()
        self.validate = validate
        self.watchdog = watchdog or Watchdog(None, mpi().COMM_WORLD.Get_rank(),
                                             abort=_watchdog_abort)
        #: α–β model (:class:`~lowcomm.comm.topology.LinkModel`) of the links this communicator's
        #: traffic crosses, where a topology says (:meth:`lowcomm.comm.topology.Topology.comms`
        #: sets it); None: unknown. Duplicates keep it.
        self.link = None
        self._pinned: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._node_ranks: int | None = None         # _on_my_node()'s cached answer
        self._window: SharedWindow | None = None     # shared_window()'s window, kept
        self._registered: list[SharedWindow] = []    # shared_tensor()'s windows, kept
        self.auto_policy = None   # lowcomm.comm.collectives' auto choice, agreed once per Comm
        #: how a call waits (:class:`~lowcomm.comm.idle.IdleWait`: tests between sleeps); None:
        #: the vendor's blocking call, which polls the network on the calling core. A
        #: communicator driven by a background thread sets it, so that its waits leave the core
        #: to the computation (see :meth:`_call`).
        self.idle: IdleWait | None = None

    def __repr__(self) -> str:
        return f"Comm(level={self.level!r}, rank={self.rank}, size={self.size})"

    # errors -----------------------------------------------------------------------------------
    def _guard(self, op: str, nbytes: int | None, fn, *args, peer: int | None = None):
        """Run one MPI call under the watchdog; MPI errors become CommError."""
        def describe():
            who = f"rank {peer} of level {self.level}" if peer is not None else \
                f"all {self.size} ranks of level {self.level}"
            return f"{op} ({nbytes or 0} bytes) on level {self.level}", who
        limit, why = self.watchdog.limit(op, nbytes, self.size, self.link)
        try:
            with self.watchdog.watch(describe, limit, why):
                return self._call(fn, args)
        except mpi().Exception as e:  # MPI errors come back as exceptions with ERRORS_RETURN
            raise CommError(op, self.rank, e.Get_error_string(), nbytes) from e

    def _call(self, fn, args):
        """``fn(*args)``; with :attr:`idle` set, a blocking collective or point-to-point call
        (or a request's ``Wait``) runs as its non-blocking form, tested with the idle wait's
        sleeps in between: the same messages, but a thread waiting a WAN round trip sleeps
        instead of spinning on a core the computation needs."""
        name, owner = getattr(fn, "__name__", ""), getattr(fn, "__self__", None)
        kind = mpi().Request if name == "Wait" else mpi().Comm     # not a Message's Recv
        idle = self.idle
        if idle is None or name not in _NONBLOCKING or not isinstance(owner, kind):
            return fn(*args)
        req = owner if name == "Wait" else getattr(owner, _NONBLOCKING[name])(*args)
        tests = 0
        while not req.Test():
            idle.sleep(tests)
            tests += 1
        return None

    def check(self, op: str, t: torch.Tensor, root: int = -1) -> None:
        """Raise :class:`CommError` on every rank unless all ranks pass the same dtype and shape
        to the same ``op``. Costs one small all-gather; skipped when ``validate`` is off."""
        if not self.validate or self.size == 1:
            return
        meta = np.full(_META_LEN, -1, dtype=np.int64)
        shape = list(t.shape)
        meta[0], meta[1], meta[2] = _DTYPE_CODES.get(t.dtype, 0), t.numel(), len(shape)
        meta[3:3 + min(6, len(shape))] = shape[:6]
        meta[9] = zlib.crc32(repr(shape[6:]).encode())
        meta[10] = zlib.crc32(op.encode())
        meta[11] = root
        table = np.empty((self.size, _META_LEN), dtype=np.int64)
        t0 = _clock()
        self._guard("check:" + op, meta.nbytes, self.mpi.Allgather, meta, table)
        sent, recv = wire_bytes("allgather", meta.nbytes, self.size)
        self.ledger.record("check", self.level, sent, recv, _since(t0))
        if (table == table[0]).all():
            return
        parts = []
        for r, row in enumerate(table):
            ops = "same op" if row[10] == meta[10] else "another op"
            dims = [int(d) for d in row[3:3 + min(6, int(row[2]))]]
            dt = str(_CODE_DTYPES.get(int(row[0]), "?")).replace("torch.", "")
            parts.append(f"rank {r}: {dt}{dims} ({ops}{', root %d' % row[11] if row[11] >= 0 else ''})")
        raise CommError(op, self.rank, "ranks passed different tensors: " + "; ".join(parts),
                        _nbytes(t))

    # staging ----------------------------------------------------------------------------------
    @contextmanager
    def staged(self, t: torch.Tensor, read: bool = True, write: bool = True):
        """Yield a contiguous 1-D CPU tensor holding ``t``'s values; copy it back on exit.

        A contiguous CPU tensor is used in place. A CUDA tensor goes through a pinned host
        buffer reused across calls, after synchronising the current stream.
        """
        t = t.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            yield t.reshape(-1)
            return
        if t.device.type == "cpu":
            host = t.reshape(-1).clone() if read else torch.empty(t.numel(), dtype=t.dtype)
        else:
            key = (t.dtype, t.numel())
            host = self._pinned.get(key)
            if host is None:
                host = self._pinned[key] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            if read:
                host.copy_(t.reshape(-1), non_blocking=True)
                torch.cuda.current_stream(t.device).synchronize()
        yield host
        if write:
            t.copy_(host.view(t.shape))

    # collectives (vendor) ---------------------------------------------------------------------
    def allreduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Vendor ``MPI_Allreduce`` in place; ``op`` is "sum" or "avg". Returns ``t``."""
        avg = _reduce_op(op)
        self.check("allreduce.mpi", t)
        n = _nbytes(t)
        with self.staged(t) as h:
            buf, mop = _typed(h)
            t0 = _clock()
            self._guard("allreduce.mpi", n, self.mpi.Allreduce, mpi().IN_PLACE, buf, mop)
            if avg:
                h.div_(self.size)
            self.ledger.record("allreduce.mpi", self.level, *wire_bytes("allreduce", n, self.size),
                               seconds=_since(t0))
        return t

    def iallreduce_(self, t: torch.Tensor, op: str = "sum") -> Request:
        """Non-blocking vendor all-reduce of a contiguous CPU tensor (``MPI_Iallreduce``)."""
        avg = _reduce_op(op)
        self._host_only("iallreduce", t)
        self.check("iallreduce.mpi", t)
        buf, mop = _typed(t)
        n = _nbytes(t)
        req = self._guard("iallreduce.mpi", n, self.mpi.Iallreduce, mpi().IN_PLACE, buf, mop)
        finish = (lambda: t.div_(self.size)) if avg else None
        return Request(self, req, "allreduce.mpi", Traffic(*wire_bytes("allreduce", n, self.size)),
                       finish=finish, keep=buf)

    def iallgather(self, t: torch.Tensor) -> tuple[Request, torch.Tensor]:
        """Non-blocking vendor all-gather of a contiguous CPU tensor (``MPI_Iallgather``):
        ``(request, out)``; ``out``, of shape ``(size, *t.shape)``, holds every rank's ``t`` once
        the request completes (charged as :meth:`allgather` is)."""
        self._host_only("iallgather", t)
        self.check("iallgather", t)
        n = _nbytes(t)
        out = torch.empty((self.size, *t.shape), dtype=t.dtype)
        send, recv = _raw(t), _raw(out)
        req = self._guard("iallgather", n, self.mpi.Iallgather, send, recv)
        return Request(self, req, "allgather", Traffic(*wire_bytes("allgather", n, self.size)),
                       keep=(t, send, recv)), out

    @contextmanager
    def charged_to(self, ledger: Ledger):
        """Inside, this communicator's traffic is recorded in ``ledger`` (a request posted
        inside is charged to it whenever it completes). One thread's use: not for a
        communicator another thread is using."""
        old, self.ledger = self.ledger, ledger
        try:
            yield self
        finally:
            self.ledger = old

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Broadcast ``t`` from ``root`` in place."""
        self.check("bcast", t, root)
        n = _nbytes(t)
        with self.staged(t, read=self.rank == root, write=self.rank != root) as h:
            t0 = _clock()
            self._guard("bcast", n, self.mpi.Bcast, _raw(h), root)
            sent, recv = wire_bytes("bcast", n, self.size)
            self.ledger.record("bcast", self.level, sent if self.rank == root else 0,
                               0 if self.rank == root else recv, _since(t0))
        return t

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Gather ``t`` from every rank: returns a tensor of shape ``(size, *t.shape)``."""
        self.check("allgather", t)
        n = _nbytes(t)
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        return self._exchange("allgather", n, self.mpi.Allgather, t, out)

    def reduce_scatter(self, t: torch.Tensor, counts: list[int], op: str = "sum") -> torch.Tensor:
        """Vendor ``MPI_Reduce_scatter``: ``t`` (``sum(counts)`` elements, the same layout on
        every rank) is reduced over the ranks and block ``r`` (``counts[r]`` elements, in rank
        order) lands on rank ``r``. Returns this rank's block, a new tensor on ``t``'s device.
        Charged ``(K−1)/K`` of ``t`` each way (the ring's volume)."""
        avg = _reduce_op(op)
        if sum(counts) != t.numel() or len(counts) != self.size:
            raise CommError("reduce_scatter", self.rank, f"counts {list(counts)} do not split "
                            f"{describe(t)} over {self.size} ranks", _nbytes(t))
        self.check("reduce_scatter", t)
        out = torch.empty(counts[self.rank], dtype=t.dtype, device=t.device)
        with self.staged(t, write=False) as h, self.staged(out, read=False) as o:
            buf, mop = _typed(h)
            t0 = _clock()
            self._guard("reduce_scatter", _nbytes(t), self.mpi.Reduce_scatter, buf,
                        _typed(o)[0], list(counts), mop)
            if avg:
                o.div_(self.size)
            self.ledger.record("reduce_scatter", self.level,
                               *wire_bytes("reduce_scatter", _nbytes(t), self.size), _since(t0))
        return out

    def allgather_blocks_(self, t: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Vendor ``MPI_Allgatherv`` in place: flat ``t`` is cut into blocks of ``counts``
        elements in rank order; each rank's block, as it holds it, replaces the others' copies.
        Returns ``t``. Charged the rank's own block to each of the K−1 others (sent) and the
        rest of ``t`` (received)."""
        if sum(counts) != t.numel() or len(counts) != self.size:
            raise CommError("allgather.blocks", self.rank, f"counts {list(counts)} do not split "
                            f"{describe(t)} over {self.size} ranks", _nbytes(t))
        self.check("allgather.blocks", t)
        es = t.element_size()
        displ = [sum(counts[:r]) * es for r in range(self.size)]
        with self.staged(t) as h:
            t0 = _clock()
            self._guard("allgather.blocks", _nbytes(t), self.mpi.Allgatherv, mpi().IN_PLACE,
                        [h.view(-1).view(torch.uint8).numpy(), ([c * es for c in counts], displ),
                         mpi().BYTE])
            mine = counts[self.rank] * es
            self.ledger.record("allgather.blocks", self.level, (self.size - 1) * mine,
                               _nbytes(t) - mine, _since(t0))
        return t

    def alltoall(self, t: torch.Tensor, op: str = "alltoall") -> torch.Tensor:
        """Vendor ``MPI_Alltoall``: ``t`` has shape ``(size, *block)``; block ``j`` goes to rank
        ``j``. Returns a tensor of the same shape whose block ``j`` came from rank ``j``. The
        ledger (row ``op``, an ``alltoall.*`` name) is charged ``(size-1)·block bytes`` each
        way (this rank's own block stays)."""
        if t.dim() < 1 or t.shape[0] != self.size:
            raise CommError(op, self.rank, f"needs a tensor of shape (size={self.size}, ...), "
                            f"got {describe(t)}", _nbytes(t))
        self.check(op, t)
        block = _nbytes(t) // self.size
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        return self._exchange(op, block, self.mpi.Alltoall, t, out)

    def alltoallv(self, blocks: list[torch.Tensor], recv_nbytes: list[int],
                  op: str = "alltoall.v") -> list[torch.Tensor]:
        """Vendor ``MPI_Alltoallv`` of byte blocks: ``blocks[j]`` (any dtype, sent as its raw
        bytes) goes to rank ``j``; returns ``size`` uint8 tensors, block ``j`` from rank ``j``
        holding ``recv_nbytes[j]`` bytes. The ledger (row ``op``, an ``alltoall.*`` name) is
        charged exactly the bytes that leave and enter this rank (its own block stays)."""
        K = self.size
        if len(blocks) != K or len(recv_nbytes) != K:
            raise CommError(op, self.rank, f"needs {K} blocks and {K} receive sizes, got "
                            f"{len(blocks)} and {len(recv_nbytes)}", None)
        raw = [b.detach().contiguous().reshape(-1).view(torch.uint8) for b in blocks]
        send = torch.cat(raw) if raw else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(recv_nbytes), dtype=torch.uint8, device=send.device)
        scounts = [b.numel() for b in raw]
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64).tolist()
        rdispl = np.concatenate([[0], np.cumsum(recv_nbytes)[:-1]]).astype(np.int64).tolist()
        sent = sum(c for j, c in enumerate(scounts) if j != self.rank)
        recv = sum(c for j, c in enumerate(recv_nbytes) if j != self.rank)
        MPI = mpi()
        with self.staged(send, write=False) as h, self.staged(out, read=False) as o:
            t0 = _clock()
            self._guard(op, sent, self.mpi.Alltoallv,
                        [h.numpy(), (scounts, sdispl), MPI.BYTE],
                        [o.numpy(), (list(recv_nbytes), rdispl), MPI.BYTE])
            self.ledger.record(op, self.level, sent, recv, _since(t0))
        return list(out.split(list(recv_nbytes)))

    def allgatherv(self, t: torch.Tensor, nbytes: list[int]) -> list[torch.Tensor]:
        """Vendor ``MPI_Allgatherv`` of byte blocks of unequal sizes: rank ``j`` contributes
        ``nbytes[j]`` bytes (this rank: ``t``'s raw bytes); returns ``size`` uint8 tensors. The
        ledger (op ``allgather.v``) is charged ``(size-1)·nbytes[rank]`` sent, as for
        :meth:`allgather`, and the others' bytes received."""
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if len(nbytes) != self.size or nbytes[self.rank] != raw.numel():
            raise CommError("allgather.v", self.rank, f"nbytes {list(nbytes)} must list {self.size} "
                            f"sizes, this rank's = {raw.numel()}", raw.numel())
        out = torch.empty(sum(nbytes), dtype=torch.uint8, device=raw.device)
        displ = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64).tolist()
        sent = (self.size - 1) * raw.numel()
        recv = sum(c for j, c in enumerate(nbytes) if j != self.rank)
        MPI = mpi()
        with self.staged(raw, write=False) as h, self.staged(out, read=False) as o:
            t0 = _clock()
            self._guard("allgather.v", sent, self.mpi.Allgatherv, [h.numpy(), MPI.BYTE],
                        [o.numpy(), (list(nbytes), displ), MPI.BYTE])
            self.ledger.record("allgather.v", self.level, sent, recv, _since(t0))
        return list(out.split(list(nbytes)))

    def _exchange(self, op: str, n: int, call, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Vendor ``call(send, recv)`` from ``t`` into ``out`` (both staged), under the watchdog,
        charging the ledger ``op``'s wire bytes for ``n`` bytes per rank."""
        with self.staged(t, write=False) as h, self.staged(out, read=False) as o:
            t0 = _clock()
            self._guard(op, n, call, _raw(h), _raw(o))
            self.ledger.record(op, self.level, *wire_bytes(op, n, self.size),
                               seconds=_since(t0))
        return out

    def disagreeing(self, signature: str, count: int) -> list[int]:
        """The ranks whose ``(signature, count)`` differ from rank 0's (a crc32 of ``signature``,
        one all-gather): e.g. a bucket or fragment layout that every rank must share."""
        crc = torch.tensor([zlib.crc32(signature.encode()), count], dtype=torch.int64)
        seen = self.allgather(crc)
        return [r for r in range(self.size) if not torch.equal(seen[r], seen[0])]

    def allgather_object(self, obj):
        """Pickle-based all-gather of small Python objects (control plane only)."""
        return self._guard("allgather_object", None, self.mpi.allgather, obj)

    def bcast_object(self, obj, root: int = 0):
        """Pickle-based broadcast of a small Python object (control plane only)."""
        return self._guard("bcast_object", None, self.mpi.bcast, obj, root)

    def barrier(self) -> None:
        """Wait until every rank of this communicator reaches it (``MPI_Barrier``)."""
        self._guard("barrier", 0, self.mpi.Barrier)

    # point-to-point (contiguous CPU tensors: collectives stage once, then talk) -----------------
    def _host_only(self, op: str, *ts: torch.Tensor) -> None:
        """Point-to-point and non-blocking calls take contiguous CPU tensors as they are."""
        for t in ts:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise CommError(op, self.rank, f"needs contiguous CPU tensors, got "
                                f"{describe(t)} on {t.device}; stage with Comm.staged()", _nbytes(t))

    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Blocking send of a contiguous CPU tensor's bytes to rank ``dest`` (``MPI_Send``)."""
        self._host_only("send", t)
        n = _nbytes(t)
        t0 = _clock()
        self._guard("send", n, self.mpi.Send, _raw(t), dest, tag, peer=dest)
        self.ledger.record("send", self.level, n, 0, _since(t0))

    def recv_(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive from rank ``source`` into the contiguous CPU tensor ``t`` (``MPI_Recv``);
        returns ``t``."""
        self._host_only("recv", t)
        n = _nbytes(t)
        t0 = _clock()
        self._guard("recv", n, self.mpi.Recv, _raw(t), source, tag, peer=source)
        self.ledger.record("recv", self.level, 0, n, _since(t0))
        return t

    def sendrecv_(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                  tag: int = 0) -> torch.Tensor:
        """Send ``send`` to ``dest`` while receiving into ``recv`` from ``source``."""
        self._host_only("sendrecv", send, recv)
        ns, nr = _nbytes(send), _nbytes(recv)
        t0 = _clock()
        self._guard("sendrecv", ns, self.mpi.Sendrecv, _raw(send), dest, tag, _raw(recv), source, tag,
                    peer=source)
        self.ledger.record("sendrecv", self.level, ns, nr, _since(t0))
        return recv

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0, op: str = "send",
              charge: str = "complete") -> Request:
        """Non-blocking send of a contiguous CPU tensor's bytes, filed in the ledger as ``op``.
        ``charge="post"`` charges the bytes now (a protocol whose logs must not depend on when
        completion is noticed, or whose peer may die before receiving); ``"complete"`` when
        the request completes."""
        self._host_only(op, t)
        n = _nbytes(t)
        buf = _raw(t)
        t0 = _clock()
        req = self._guard(op, n, self.mpi.Isend, buf, dest, tag, peer=dest)
        if charge == "post":
            self.ledger.record(op, self.level, n, 0, _since(t0))
        return Request(self, req, op, Traffic(n, 0, charge == "post"), keep=(t, buf), peer=dest)

    def irecv_(self, t: torch.Tensor, source: int, tag: int = 0, op: str = "recv") -> Request:
        """Non-blocking receive into a contiguous CPU tensor; charged as ``op`` on completion."""
        self._host_only(op, t)
        buf = _raw(t)
        req = self._guard(op, _nbytes(t), self.mpi.Irecv, buf, source, tag, peer=source)
        return Request(self, req, op, Traffic(0, _nbytes(t)), keep=(t, buf), peer=source)

    # probes and matched receives (message sizes not known in advance) ---------------------------
    ANY_SOURCE = -1001     # placeholders for MPI.ANY_SOURCE / MPI.ANY_TAG (their values differ
    ANY_TAG = -1002        # between MPI libraries, and reading them would initialise MPI)

    @staticmethod
    def _wild(source: int, tag: int) -> tuple[int, int]:
        MPI = mpi()
        return (MPI.ANY_SOURCE if source == Comm.ANY_SOURCE else source,
                MPI.ANY_TAG if tag == Comm.ANY_TAG else tag)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int, int] | None:
        """``(source, tag, nbytes)`` of a message that has arrived from ``source`` with ``tag``
        (``Comm.ANY_SOURCE`` / ``Comm.ANY_TAG`` match any), or None. Does not receive it."""
        MPI = mpi()
        status = MPI.Status()
        src, tg = self._wild(source, tag)
        peer = None if source == Comm.ANY_SOURCE else source
        if not self._guard("iprobe", 0, self.mpi.Iprobe, src, tg, status, peer=peer):
            return None
        return status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> "Message | None":
        """Matched probe (``MPI_Improbe``): the :class:`Message` that has arrived from ``source``
        with ``tag``, removed from matching so that only :meth:`Message.recv_` /
        :meth:`Message.irecv_` can take it (safe beside other threads' receives), or None."""
        MPI = mpi()
        status = MPI.Status()
        src, tg = self._wild(source, tag)
        peer = None if source == Comm.ANY_SOURCE else source
        msg = self._guard("improbe", 0, self.mpi.Improbe, src, tg, status, peer=peer)
        if msg is None:
            return None
        return Message(self, msg, status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    # pickled objects, point-to-point (control plane: end-of-run reports) -------------------------
    def issend_object(self, obj, dest: int, tag: int = 0, op: str = "send_object") -> Request:
        """Synchronous non-blocking send of a pickled ``obj``: the request completes only once
        ``dest`` has started receiving it (so this process may end right after). Receive it with
        :meth:`recv_object`."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf = np.frombuffer(data, dtype=np.uint8)
        req = self._guard(op, buf.nbytes, self.mpi.Issend, [buf, mpi().BYTE], dest, tag, peer=dest)
        return Request(self, req, op, Traffic(buf.nbytes, 0), keep=(data, buf), peer=dest)

    def recv_object(self, source: int, tag: int = 0, op: str = "recv_object"):
        """Receive one object sent by :meth:`issend_object` from ``source`` (blocking, watched)."""
        t0 = _clock()
        MPI = mpi()
        status = MPI.Status()
        msg = self._guard(op, None, self.mpi.Mprobe, source, tag, status, peer=source)
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self._guard(op, buf.nbytes, msg.Recv, [buf, MPI.BYTE], peer=source)
        self.ledger.record(op, self.level, 0, buf.nbytes, _since(t0))
        return pickle.loads(buf.tobytes())

    # shared memory (MPI-3 shared windows) --------------------------------------------------------
    def node_local(self) -> bool:
        """True when every rank of this communicator can share memory with every other (one
        node): ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` keeps all of them. Collective the
        first time (the answer is cached; every rank gets the same one)."""
        return self._on_my_node() == self.size

    def _on_my_node(self) -> int:
        """How many ranks of this communicator share this rank's node (collective the first
        time; cached)."""
        if self._node_ranks is None:
            if self.size == 1:
                self._node_ranks = 1
            else:
                sub = self._guard("split_shared", 0, self.mpi.Split_type, mpi().COMM_TYPE_SHARED,
                                  self.rank)
                self._node_ranks = sub.Get_size()
                sub.Free()
        return self._node_ranks

    def cores_per_rank(self) -> float:
        """The CPU cores this rank can count on: those it may run on (its affinity), at most
        the node's cores shared out among the job's ranks on the node, as the launcher tells
        (``OMPI_COMM_WORLD_LOCAL_SIZE``, ``MPI_LOCALNRANKS``; else this communicator's ranks on
        the node, collectively): one core each for 2 ranks on 2 cores, bound or not; 0.5 for 4."""
        local = next((int(os.environ[v]) for v in _LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()),
                     None) or self._on_my_node()
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return min(mine or 1, (os.cpu_count() or 1) / local)

    def shared_window(self, slot_bytes: int) -> "SharedWindow":
        """This communicator's :class:`SharedWindow` of ``slot_bytes`` bytes per rank (allocated
        collectively on first use and kept; a later call asking for more reallocates, so every
        rank must ask for the same size in the same order). Raises :class:`CommError` naming the
        level when the ranks do not share one node."""
        w = self._window
        if w is not None and w.slot_bytes >= slot_bytes:
            return w
        if not self.node_local():
            raise CommError("shared_window", self.rank, f"the {self.size} ranks of level "
                            f"{self.level!r} do not share one node (MPI_COMM_TYPE_SHARED split "
                            f"them); a shared-memory collective needs a node-local communicator",
                            slot_bytes)
        if w is not None:
            w.free()
        self._window = SharedWindow(self, slot_bytes)
        return self._window

    def shared_tensor(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D tensor of ``numel`` elements that lives in a shared-memory window of
        this node-local communicator (collective: every rank asks for the same ``numel`` and
        ``dtype`` in the same order), *registered* with it: an all-reduce of this tensor (or of
        a contiguous slice of it, every rank passing the same slice) with algorithm ``shm`` or
        ``auto`` reads the other ranks' tensors where they lie, with no copy into a staging
        buffer (:func:`lowcomm.comm.collectives.shm`; NCCL's user-buffer registration,
        ``ncclMemAlloc`` + ``ncclCommRegister``, is the same idea). The window is kept for the
        communicator's life. Raises :class:`CommError` naming the level off one node."""
        es = torch.empty(0, dtype=dtype).element_size()
        if not self.node_local():
            raise CommError("shared_tensor", self.rank, f"the {self.size} ranks of level "
                            f"{self.level!r} do not share one node; a registered buffer needs "
                            f"a node-local communicator", numel * es)
        win = SharedWindow(self, max(1, numel) * es)
        self._registered.append(win)
        return win.slot(self.rank, dtype)[:numel].zero_()

    def registered(self, t: torch.Tensor) -> "tuple[SharedWindow, list[torch.Tensor]] | None":
        """For a contiguous CPU tensor inside one of :meth:`shared_tensor`'s windows: the window
        and every rank's tensor at the same place (``[j]`` is rank j's, ``[self.rank]`` is
        ``t``'s memory); else None."""
        if not self._registered or t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for win in self._registered:
            base = win.base
            if base <= ptr and ptr + nbytes <= base + win.slot_bytes and \
                    (ptr - base) % t.element_size() == 0:
                at = (ptr - base) // t.element_size()
                return win, [win.slot(j, t.dtype)[at:at + t.numel()] for j in range(self.size)]
        return None

        # communicators ----------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None, level: str | None = None) -> "Comm | None":
        """``MPI_Comm_split``: ranks with the same ``color`` form a new Comm (``None`` for a
        negative color). The new Comm shares this one's ledger, filed under ``level``."""
        MPI = mpi()
        sub = self._guard("split", 0, self.mpi.Split, MPI.UNDEFINED if color < 0 else color,
                          self.rank if key is None else key)
        if sub == MPI.COMM_NULL:
            return None
        return Comm(sub, self.ledger, level or self.level, self.validate, self.watchdog)

    def split_shared(self, level: str | None = None) -> "Comm":
        """``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the ranks that can share memory with
        this one (one node), ordered by rank here. Collective."""
        sub = self._guard("split_shared", 0, self.mpi.Split_type, mpi().COMM_TYPE_SHARED, self.rank)
        return Comm(sub, self.ledger, level or self.level, self.validate, self.watchdog)

    def free(self) -> None:
        """Release the MPI communicator (collective); the Comm must not be used afterwards."""
        self._guard("free", 0, self.mpi.Free)

    @classmethod
    def self_comm(cls, watchdog: Watchdog | None = None, ledger: Ledger | None = None,
                  level: str = "control") -> "Comm":
        """A Comm over ``MPI_COMM_SELF`` (this process alone; e.g. an evaluation that must not
        wait for other ranks), with its own ledger unless one is given."""
        return cls(mpi().COMM_SELF, ledger or Ledger(), level, False, watchdog)

    def dup(self, ledger: Ledger | None = None, level: str | None = None) -> "Comm":
        """A duplicate communicator: a separate message space, the same watchdog, and this
        one's ledger and level unless others are given (e.g. a control channel whose traffic
        is not charged to the method)."""
        out = Comm(self._guard("dup", 0, self.mpi.Dup), ledger or self.ledger, level or self.level, self.validate,
                   self.watchdog)
        out.link = self.link
        out._node_ranks = self._node_ranks
        out.auto_policy = self.auto_policy
        return out


class SharedWindow:
    """An MPI-3 shared-memory window (``MPI_Win_allocate_shared``) over a node-local Comm:
    ``slot_bytes`` bytes of data per rank, every rank's slot mapped into every process.

    ``slot(j)`` is rank j's data as a tensor (no copy: loads and stores go straight to the
    shared pages). :meth:`sync` is a barrier through the window itself: each rank bumps a
    counter in its slot's header and waits until every counter has reached it, with
    ``MPI_Win_sync`` fences on both sides (MPI-3.1 §11.5.5's recipe for load/store access).
    A waiting rank polls with ``sched_yield`` between polls for up to ``_SHM_YIELD_S``, then
    sleeps in short naps: with a core of its own it sees its peers arrive at once, and on an
    oversubscribed node it hands its core to the ranks still working at every poll (an
    ``MPI_Barrier`` spins, stealing the core from them). The wait runs under the communicator's watchdog,
    so a rank that never arrives ends the job with a message naming the op, not a hang.
    """

    HEADER = 64       # bytes before each slot's data: the sync counter, on its own cache line

    def __init__(self, comm: Comm, slot_bytes: int):
        MPI = mpi()
        self.comm, self.slot_bytes = comm, int(slot_bytes)
        total = self.HEADER + self.slot_bytes
        self.win = comm._guard("shared_window", total, MPI.Win.Allocate_shared,
                               total, 1, MPI.INFO_NULL, comm.mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)     # one passive epoch for the window's life
        self._raw, self._data = [], []
        self._slots: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        for j in range(comm.size):
            mem, _ = self.win.Shared_query(j)
            raw = torch.frombuffer(mem, dtype=torch.uint8, count=total)
            self._raw.append(raw)
            self._data.append(raw[self.HEADER:])
        self._counters = [np.frombuffer(mem, dtype=np.int64, count=1)
                          for mem in (self.win.Shared_query(j)[0] for j in range(comm.size))]
        self._mine = self._counters[comm.rank]
        self.base = self._data[comm.rank].data_ptr()    # where this rank's slot starts
        self._mine[0] = 0
        self._seq = 0
        self.comm._guard("shared_window", 0, self.comm.mpi.Barrier)   # counters zeroed

    def slot(self, j: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Rank ``j``'s slot viewed as ``dtype`` (whole elements; the views are made once)."""
        key = (j, dtype)
        view = self._slots.get(key)
        if view is None:
            es = torch.empty(0, dtype=dtype).element_size()
            view = self._slots[key] = self._data[j][:self.slot_bytes - self.slot_bytes % es].view(dtype)
        return view

    def sync(self, op: str = "shm.sync") -> None:
        """Make this rank's stores visible to every rank and wait until all have arrived."""
        self._seq += 1
        seq = self._seq
        self.win.Sync()              # my data stores before my counter store
        self._mine[0] = seq
        others = [c for j, c in enumerate(self._counters) if j != self.comm.rank]

        def wait():
            until = None
            while not all(c[0] >= seq for c in others):
                now = time.perf_counter()
                until = until or now + _SHM_YIELD_S
                if now < until:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)
        self.comm._guard(op, 0, wait)
        self.win.Sync()              # their data loads after their counters

    def free(self) -> None:
        """Release the window (collective)."""
        self._raw, self._data, self._counters, self._slots = [], [], [], {}
        self.win.Unlock_all()
        self.win.Free()


class Message:
    """A message matched by :meth:`Comm.improbe`: ``source``, ``tag`` and ``nbytes`` are known;
    receive it once, with :meth:`recv_` or :meth:`irecv_` into a buffer of ``nbytes`` bytes."""

    def __init__(self, comm: Comm, msg, source: int, tag: int, nbytes: int):
        self._comm, self._msg = comm, msg
        self.source, self.tag, self.nbytes = source, tag, nbytes

    def _check(self, op: str, t: torch.Tensor) -> None:
        self._comm._host_only(op, t)
        if _nbytes(t) != self.nbytes:
            raise CommError(op, self._comm.rank, f"the message from rank {self.source} (tag "
                            f"{self.tag}) holds {self.nbytes} bytes, the buffer {describe(t)} "
                            f"{_nbytes(t)}", _nbytes(t))

    def recv_(self, t: torch.Tensor, op: str = "recv") -> torch.Tensor:
        """Receive the message into ``t`` (blocking, watched); charged as ``op``."""
        self._check(op, t)
        t0 = _clock()
        self._comm._guard(op, self.nbytes, self._msg.Recv, _raw(t), peer=self.source)
        self._comm.ledger.record(op, self._comm.level, 0, self.nbytes, _since(t0))
        return t

    def irecv_(self, t: torch.Tensor, op: str = "recv") -> Request:
        """Start receiving the message into ``t``; charged as ``op`` when the request completes."""
        self._check(op, t)
        buf = _raw(t)
        req = self._comm._guard(op, self.nbytes, self._msg.Irecv, buf, peer=self.source)
        return Request(self._comm, req, op, Traffic(0, self.nbytes), keep=(t, buf), peer=self.source)


def world_rank() -> int:
    """This process's world rank without starting MPI: the world Comm's once :func:`init` ran,
    else MPI's if mpi4py initialised it, else the launcher's (``OMPI_COMM_WORLD_RANK``,
    ``PMI_RANK``, ``PMIX_RANK``, ``SLURM_PROCID``), else 0. For error messages and seeds."""
    if _WORLD is not None:
        return _WORLD.rank
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank()
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def abort_world(code: int) -> None:
    """``MPI_Abort`` every rank with ``code`` if MPI is running with more than one rank (after
    flushing this process's output); otherwise return and let the caller exit."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() \
            and MPI.COMM_WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)


def _watchdog_abort() -> None:
    """The watchdog's way to end the job: ``MPI_Abort`` with status 3 (``os._exit`` if MPI
    cannot)."""
    mpi().COMM_WORLD.Abort(3)
    os._exit(3)  # pragma: no cover - Abort does not return


def mpi_library() -> tuple[str, int, int]:
    """The MPI library's version text, the thread level granted and ``MPI_THREAD_MULTIPLE``."""
    MPI = mpi()
    return MPI.Get_library_version(), MPI.Query_thread(), MPI.THREAD_MULTIPLE


def _reduce_op(op: str) -> bool:
    """Return True for an average, False for a sum; anything else is an error."""
    if op == "sum":
        return False
    if op in ("avg", "average", "mean"):
        return True
    raise ValueError(f"unknown reduction op {op!r}; use 'sum' or 'avg'")


_WORLD: Comm | None = None


def init(validate: bool = True, timeout_s: float | None = None) -> Comm:
    """Initialise MPI (if needed) and return the world :class:`Comm` (one per process).

    ``timeout_s``: the floor of the watchdog's limit for one blocking call (0 = off; default
    ``$LOWCOMM_TIMEOUT_S`` or 60 s); the limit scales with the call's α–β prediction where its
    communicator's link is known (:mod:`lowcomm.comm.watchdog`)."""
    global _WORLD
    if _WORLD is None:
        MPI = mpi()
        dog = Watchdog(timeout_s, MPI.COMM_WORLD.Get_rank(),
                       abort=_watchdog_abort)
        _WORLD = Comm(MPI.COMM_WORLD, Ledger(), "world", validate, dog)
    elif timeout_s is not None:
        _WORLD.watchdog.timeout_s = timeout_s
    return _WORLD
