"""The communicator: collectives on tensors, checked, staged, watched and charged to a ledger."""
from __future__ import annotations

import zlib
from contextlib import contextmanager

import numpy as np
import torch

from ...errors import CommError
from ..idle import IdleWait
from ..ledger import Ledger, wire_bytes
from ..watchdog import Watchdog
from .base import (_CODE_DTYPES, _DTYPE_CODES, _META_LEN, _NONBLOCKING, Request, Traffic, _clock,
                   _nbytes, _raw, _reduce_op, _since, _typed, _watchdog_abort, describe, mpi)
from .p2p import PointToPoint
from .shared import SharedMemory, SharedWindow


class Comm(PointToPoint, SharedMemory):
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
