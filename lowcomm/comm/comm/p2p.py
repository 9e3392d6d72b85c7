"""Point-to-point calls of :class:`~lowcomm.comm.comm.Comm`: sends, receives, probes, matched
receives and pickled control-plane objects, on contiguous CPU tensors."""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import CommError
from .base import Request, Traffic, _clock, _nbytes, _raw, _since, describe, mpi

if TYPE_CHECKING:
    from .core import Comm


class PointToPoint:
    """The point-to-point part of :class:`~lowcomm.comm.comm.Comm` (a mixin: it calls the
    communicator's ``_guard``, ``ledger`` and ``level``)."""

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
        return (MPI.ANY_SOURCE if source == PointToPoint.ANY_SOURCE else source,
                MPI.ANY_TAG if tag == PointToPoint.ANY_TAG else tag)

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int, int] | None:
        """``(source, tag, nbytes)`` of a message that has arrived from ``source`` with ``tag``
        (``PointToPoint.ANY_SOURCE`` / ``PointToPoint.ANY_TAG`` match any), or None. Does not receive it."""
        MPI = mpi()
        status = MPI.Status()
        src, tg = self._wild(source, tag)
        peer = None if source == PointToPoint.ANY_SOURCE else source
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
        peer = None if source == PointToPoint.ANY_SOURCE else source
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
