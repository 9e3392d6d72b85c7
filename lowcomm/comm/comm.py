"""Comm: a thin wrapper over an mpi4py intracommunicator that moves torch tensors.

Every call uses mpi4py's buffer (upper-case) interface on the tensor's own memory, so nothing is
pickled on a hot path, and records bytes and seconds in a :class:`~lowcomm.comm.ledger.Ledger` under
the communicator's ``level`` ("world", "node", "dc", ...). This is the only module that uses
mpi4py, imported lazily (importing lowcomm makes no MPI call); what needs no MPI call —
argument checks, staging of CUDA tensors through pinned host buffers, the node's shared-memory
bookkeeping — is in :mod:`lowcomm.comm.base` and :mod:`lowcomm.comm.tensors`.
"""
from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import torch

from ..errors import CommError
from .base import CommBase, WindowBase
from .idle import NONBLOCKING, spin_then_nap
from .ledger import Ledger, wire_bytes
from .request import Request
from .tensors import Traffic, check_counts, check_fits, describe, displacements, reduce_op as _reduce_op
from .tensors import clock as _clock, nbytes as _nbytes, since as _since
from .watchdog import Watchdog

_HALF_OPS: dict = {}                # torch dtype -> MPI.Op summing 16-bit floats, created on first use
#: SharedWindow.sync: seconds a waiting rank polls (yielding its core between polls to any
#: thread that wants it) before it naps (:func:`~lowcomm.comm.idle.spin_then_nap`)
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


class Comm(CommBase):
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

    def __init__(self, mpi_comm, ledger: Ledger | None = None, level: str = "world",
                 validate: bool = True, watchdog: Watchdog | None = None):
        self.mpi = mpi_comm
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), level, ledger, validate,
                         watchdog or Watchdog(None, mpi().COMM_WORLD.Get_rank(), abort=_watchdog_abort))

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
        if idle is None or name not in NONBLOCKING or not isinstance(owner, kind):
            return fn(*args)
        req = owner if name == "Wait" else getattr(owner, NONBLOCKING[name])(*args)
        tests = 0
        while not req.Test():
            idle.sleep(tests)
            tests += 1
        return None

    def _await(self, req, op: str, nbytes: int, peer: int | None, block: bool) -> bool:
        """Wait for (``block``) or test once the MPI request ``req`` of a :class:`Request`,
        watched; True when it has completed."""
        if block:
            self._guard(op, nbytes, req.Wait, peer=peer)
            return True
        return bool(self._guard(op, nbytes, req.Test, peer=peer))

    def _timed(self, op: str, nbytes: int | None, charge: tuple[int, int], fn, *args,
               peer: int | None = None):
        """:meth:`_guard` ``fn(*args)``, then charge the ledger ``op`` with ``charge`` (bytes sent,
        received) and the seconds the call took."""
        t0 = _clock()
        out = self._guard(op, nbytes, fn, *args, peer=peer)
        self.ledger.record(op, self.level, *charge, _since(t0))
        return out

    def _gather_meta(self, op: str, meta: np.ndarray) -> np.ndarray:
        table = np.empty((self.size, meta.size), dtype=meta.dtype)
        t0 = _clock()
        self._guard("check:" + op, meta.nbytes, self.mpi.Allgather, meta, table)
        sent, recv = wire_bytes("allgather", meta.nbytes, self.size)
        self.ledger.record("check", self.level, sent, recv, _since(t0))
        return table

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

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Broadcast ``t`` from ``root`` in place."""
        self.check("bcast", t, root)
        n = _nbytes(t)
        with self.staged(t, read=self.rank == root, write=self.rank != root) as h:
            sent, recv = wire_bytes("bcast", n, self.size)
            charge = (sent, 0) if self.rank == root else (0, recv)
            self._timed("bcast", n, charge, self.mpi.Bcast, _raw(h), root)
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
        check_counts("reduce_scatter", self.rank, t, counts, self.size)
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
        check_counts("allgather.blocks", self.rank, t, counts, self.size)
        self.check("allgather.blocks", t)
        es = t.element_size()
        displ = [sum(counts[:r]) * es for r in range(self.size)]
        mine = counts[self.rank] * es
        with self.staged(t) as h:
            self._timed("allgather.blocks", _nbytes(t), ((self.size - 1) * mine, _nbytes(t) - mine),
                        self.mpi.Allgatherv, mpi().IN_PLACE,
                        [h.view(-1).view(torch.uint8).numpy(), ([c * es for c in counts], displ),
                         mpi().BYTE])
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
        sdispl, rdispl = displacements(scounts), displacements(recv_nbytes)
        sent = sum(c for j, c in enumerate(scounts) if j != self.rank)
        recv = sum(c for j, c in enumerate(recv_nbytes) if j != self.rank)
        MPI = mpi()
        with self.staged(send, write=False) as h, self.staged(out, read=False) as o:
            self._timed(op, sent, (sent, recv), self.mpi.Alltoallv, [h.numpy(), (scounts, sdispl), MPI.BYTE],
                        [o.numpy(), (list(recv_nbytes), rdispl), MPI.BYTE])
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
        displ = displacements(nbytes)
        sent = (self.size - 1) * raw.numel()
        recv = sum(c for j, c in enumerate(nbytes) if j != self.rank)
        MPI = mpi()
        with self.staged(raw, write=False) as h, self.staged(out, read=False) as o:
            self._timed("allgather.v", sent, (sent, recv), self.mpi.Allgatherv, [h.numpy(), MPI.BYTE],
                        [o.numpy(), (list(nbytes), displ), MPI.BYTE])
        return list(out.split(list(nbytes)))

    def _exchange(self, op: str, n: int, call, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Vendor ``call(send, recv)`` from ``t`` into ``out`` (both staged), under the watchdog,
        charging the ledger ``op``'s wire bytes for ``n`` bytes per rank."""
        with self.staged(t, write=False) as h, self.staged(out, read=False) as o:
            self._timed(op, n, wire_bytes(op, n, self.size), call, _raw(h), _raw(o))
        return out

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
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Blocking send of a contiguous CPU tensor's bytes to rank ``dest`` (``MPI_Send``)."""
        self._host_only("send", t)
        n = _nbytes(t)
        self._timed("send", n, (n, 0), self.mpi.Send, _raw(t), dest, tag, peer=dest)

    def recv_(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive from rank ``source`` into the contiguous CPU tensor ``t`` (``MPI_Recv``);
        returns ``t``."""
        self._host_only("recv", t)
        n = _nbytes(t)
        self._timed("recv", n, (0, n), self.mpi.Recv, _raw(t), source, tag, peer=source)
        return t

    def sendrecv_(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                  tag: int = 0) -> torch.Tensor:
        """Send ``send`` to ``dest`` while receiving into ``recv`` from ``source``."""
        self._host_only("sendrecv", send, recv)
        ns, nr = _nbytes(send), _nbytes(recv)
        self._timed("sendrecv", ns, (ns, nr), self.mpi.Sendrecv, _raw(send), dest, tag, _raw(recv),
                    source, tag, peer=source)
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

    def _probe(self, op: str, fn, source: int, tag: int):
        """``(found, (source, tag, nbytes))``: what the probe ``fn`` answers for ``source`` and
        ``tag`` (the placeholders mean any) and the status it filled in."""
        MPI = mpi()
        status = MPI.Status()
        src = MPI.ANY_SOURCE if source == Comm.ANY_SOURCE else source
        found = self._guard(op, 0, fn, src, MPI.ANY_TAG if tag == Comm.ANY_TAG else tag, status,
                            peer=None if source == Comm.ANY_SOURCE else source)
        return found, (status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int, int] | None:
        """``(source, tag, nbytes)`` of a message that has arrived from ``source`` with ``tag``
        (``Comm.ANY_SOURCE`` / ``Comm.ANY_TAG`` match any), or None. Does not receive it."""
        found, seen = self._probe("iprobe", self.mpi.Iprobe, source, tag)
        return seen if found else None

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> "Message | None":
        """Matched probe (``MPI_Improbe``): the :class:`Message` that has arrived from ``source``
        with ``tag``, removed from matching so that only :meth:`Message.recv_` /
        :meth:`Message.irecv_` can take it (safe beside other threads' receives), or None."""
        msg, seen = self._probe("improbe", self.mpi.Improbe, source, tag)
        return None if msg is None else Message(self, msg, *seen)

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
    def _count_node_ranks(self) -> int:
        sub = self.split_shared()
        sub.free()
        return sub.size

    def _new_window(self, slot_bytes: int) -> "SharedWindow":
        return SharedWindow(self, slot_bytes)

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


class SharedWindow(WindowBase):
    """An MPI-3 shared-memory window (``MPI_Win_allocate_shared``) over a node-local Comm:
    ``slot_bytes`` bytes of data per rank, every rank's slot mapped into every process.

    ``slot(j)`` is rank j's data as a tensor (no copy: loads and stores go straight to the
    shared pages). :meth:`sync` is a barrier through the window itself: each rank bumps a
    counter in its slot's header and waits until every counter has reached it, with
    ``MPI_Win_sync`` fences on both sides (MPI-3.1 §11.5.5's recipe for load/store access).
    A waiting rank yields its core between polls, then naps (:func:`~lowcomm.comm.idle.spin_then_nap`;
    an ``MPI_Barrier`` spins, stealing the core from the ranks still working). The wait runs
    under the communicator's watchdog, so a rank that never arrives ends the job with a
    message naming the op, not a hang.
    """

    def __init__(self, comm: Comm, slot_bytes: int):
        MPI = mpi()
        total = self.HEADER + int(slot_bytes)
        self.win = comm._guard("shared_window", total, MPI.Win.Allocate_shared,
                               total, 1, MPI.INFO_NULL, comm.mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)     # one passive epoch for the window's life
        super().__init__(comm, slot_bytes, [self.win.Shared_query(j)[0] for j in range(comm.size)])
        self.comm._guard("shared_window", 0, self.comm.mpi.Barrier)   # counters zeroed

    def sync(self, op: str = "shm.sync") -> None:
        """Make this rank's stores visible to every rank and wait until all have arrived."""
        self.win.Sync()              # my data stores before my counter store
        arrived = self._arrive()
        self.comm._guard(op, 0, spin_then_nap, arrived, _SHM_YIELD_S)
        self.win.Sync()              # their data loads after their counters

    def free(self) -> None:
        """Release the window (collective)."""
        self._forget()
        self.win.Unlock_all()
        self.win.Free()


class Message:
    """A message matched by :meth:`Comm.improbe`: ``source``, ``tag`` and ``nbytes`` are known;
    receive it once, with :meth:`recv_` or :meth:`irecv_` into a buffer of ``nbytes`` bytes."""

    def __init__(self, comm: Comm, msg, source: int, tag: int, nbytes: int):
        self._comm, self._msg = comm, msg
        self.source, self.tag, self.nbytes = source, tag, nbytes

    def _check(self, op: str, t: torch.Tensor) -> None:
        check_fits(op, self._comm.rank, t, self.nbytes,
                   f"the message from rank {self.source} (tag {self.tag})")

    def recv_(self, t: torch.Tensor, op: str = "recv") -> torch.Tensor:
        """Receive the message into ``t`` (blocking, watched); charged as ``op``."""
        self._check(op, t)
        self._comm._timed(op, self.nbytes, (0, self.nbytes), self._msg.Recv, _raw(t), peer=self.source)
        return t

    def irecv_(self, t: torch.Tensor, op: str = "recv") -> Request:
        """Start receiving the message into ``t``; charged as ``op`` when the request completes."""
        self._check(op, t)
        buf = _raw(t)
        req = self._comm._guard(op, self.nbytes, self._msg.Irecv, buf, peer=self.source)
        return Request(self._comm, req, op, Traffic(0, self.nbytes), keep=(t, buf), peer=self.source)


def _running():
    """``mpi4py.MPI`` if something imported it and MPI is initialised and not finalised, else
    None (without importing or starting it)."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized() else None


def world_rank() -> int:
    """This process's world rank without starting MPI: the world Comm's once :func:`init` ran,
    else MPI's if mpi4py initialised it, else the launcher's (``OMPI_COMM_WORLD_RANK``,
    ``PMI_RANK``, ``PMIX_RANK``, ``SLURM_PROCID``), else 0. For error messages and seeds."""
    if _WORLD is not None:
        return _WORLD.rank
    MPI = _running()
    if MPI is not None:
        return MPI.COMM_WORLD.Get_rank()
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def abort_world(code: int) -> None:
    """``MPI_Abort`` every rank with ``code`` if MPI is running with more than one rank (after
    flushing this process's output); otherwise return and let the caller exit."""
    MPI = _running()
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
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


_WORLD: Comm | None = None


def init(validate: bool = True, timeout_s: float | None = None) -> Comm:
    """Initialise MPI (if needed) and return the world :class:`Comm` (one per process).

    ``timeout_s``: the floor of the watchdog's limit for one blocking call (0 = off; default
    ``$LOWCOMM_TIMEOUT_S`` or 60 s); the limit scales with the call's α–β prediction where its
    communicator's link is known (:mod:`lowcomm.comm.watchdog`)."""
    global _WORLD
    if _WORLD is None:
        MPI = mpi()
        dog = Watchdog(timeout_s, MPI.COMM_WORLD.Get_rank(), abort=_watchdog_abort)
        _WORLD = Comm(MPI.COMM_WORLD, Ledger(), "world", validate, dog)
    elif timeout_s is not None:
        _WORLD.watchdog.timeout_s = timeout_s
    return _WORLD
