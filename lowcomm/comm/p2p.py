"""PeerComm: the part of :class:`~lowcomm.comm.comm.Comm` that lowcomm's all-reduce algorithms
use — point-to-point sends and receives, an all-gather made of them — over a transport between
separately launched jobs, where there is no MPI communicator (a fleet's datacenters).

Two transports implement it: :class:`~lowcomm.comm.gloo.GlooComm` (a torch gloo process group,
plain TCP) and :class:`~lowcomm.comm.tls.TlsComm` (TLS 1.3, mutually authenticated). lowcomm's
own algorithms (``ring``, ``rabenseifner``, ``tree``) are plain functions of these calls, so the
same function sums in the same order over either as over MPI: a fleet with no failure gives the
parameters of one MPI job, bit for bit.

Every call records bytes and seconds in the ledger, under the level given (``"dc"``), and waits
at most ``timeout_s``; a peer that died or a call that times out raises
:class:`~lowcomm.errors.CommError` naming this rank, the op, the peer and the bytes (the fleet
retries the round without the failed datacenter).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .ledger import Ledger
from .tensors import nbytes as _nbytes


class PeerRequest:
    """A send or receive in flight; :meth:`wait` completes it and charges the ledger."""

    def __init__(self, comm: "PeerComm", work, op: str, sent: int, recv: int, peer: int, keep):
        self._comm, self._work, self.op, self._peer = comm, work, op, peer
        self._sent, self._recv, self._keep = sent, recv, keep
        self._t0 = time.perf_counter()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._comm._wait(self._work, self.op, self._sent or self._recv, self._peer)
        self._done, self._keep = True, None
        self._comm.ledger.record(self.op, self._comm.level, self._sent, self._recv,
                                 time.perf_counter() - self._t0)


class PeerComm:
    """A communicator of ``size`` members, this one ``rank`` (module docstring). ``peers``: what
    each rank stands for, for error messages (e.g. the datacenter indices of the members). A
    transport implements :meth:`_post_send`, :meth:`_post_recv` (a handle each, the call in
    flight) and :meth:`_wait` (complete a handle within ``timeout_s`` or raise CommError)."""

    # as a :class:`~lowcomm.comm.roles.Peers`: the ranks of one group
    rounds = per_rank = False
    dcs = None

    def __init__(self, rank: int, size: int, ledger: Ledger | None = None, level: str = "dc",
                 timeout_s: float = 60.0, peers: list | None = None, link=None):
        self.rank, self.size, self.level = rank, size, level
        self.ledger = ledger if ledger is not None else Ledger()
        self.timeout_s, self.link = timeout_s, link
        self.peers = list(peers) if peers is not None else list(range(self.size))
        self.validate = False
        self.auto_policy = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level!r}, rank={self.rank}, size={self.size})"

    def _who(self, peer: int | None) -> str:
        return f"{self.level} {self.peers[peer]}" if peer is not None else \
            f"the {self.size} members {self.peers}"

    def _post_send(self, flat: torch.Tensor, dest: int, tag: int):
        raise NotImplementedError

    def _post_recv(self, flat: torch.Tensor, source: int, tag: int):
        raise NotImplementedError

    def _wait(self, work, op: str, nbytes: int, peer: int | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of the transport's connections (nothing to let go of by default)."""

    # what collectives.allreduce_ asks of a Comm -----------------------------------------------
    def check(self, op: str, t: torch.Tensor, root: int = -1) -> None:
        """No per-call agreement check: a round's members agreed on its tensor beforehand."""

    def registered(self, t: torch.Tensor) -> None:
        """None: a group between jobs registers no shared memory
        (:meth:`lowcomm.comm.comm.Comm.registered`)."""
        return None

    @contextmanager
    def staged(self, t: torch.Tensor, read: bool = True, write: bool = True):
        """A contiguous 1-D CPU tensor holding ``t`` (copied back on exit when it is not one)."""
        t = t.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            yield t.reshape(-1)
            return
        host = t.reshape(-1).to("cpu", copy=True)
        yield host
        if write:
            t.copy_(host.view(t.shape))

    # point-to-point ---------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dest: int, tag: int = 0, op: str = "send") -> PeerRequest:
        flat = t.detach().reshape(-1)
        return PeerRequest(self, self._post_send(flat, dest, tag), op, _nbytes(t), 0, dest, flat)

    def irecv_(self, t: torch.Tensor, source: int, tag: int = 0, op: str = "recv") -> PeerRequest:
        flat = t.detach().view(-1)
        return PeerRequest(self, self._post_recv(flat, source, tag), op, 0, _nbytes(t), source,
                           flat)

    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.isend(t, dest, tag).wait()

    def recv_(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        self.irecv_(t, source, tag).wait()
        return t

    def sendrecv_(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                  tag: int = 0) -> torch.Tensor:
        """Send ``send`` to ``dest`` while receiving into ``recv`` from ``source``."""
        t0 = time.perf_counter()
        r = self._post_recv(recv.view(-1), source, tag)
        s = self._post_send(send.detach().reshape(-1), dest, tag)
        self._wait(s, "sendrecv", _nbytes(send), dest)
        self._wait(r, "sendrecv", _nbytes(recv), source)
        self.ledger.record("sendrecv", self.level, _nbytes(send), _nbytes(recv),
                           time.perf_counter() - t0)
        return recv

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t`` (same shape and dtype), as :meth:`lowcomm.comm.comm.Comm.allgather`:
        shape ``(size, *t.shape)``, row r from member r; a ring of ``size − 1`` exchanges, each
        charged as ``allgather``."""
        out = torch.empty((self.size, *t.shape), dtype=t.dtype)
        out[self.rank].copy_(t.detach().cpu())
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for i in range(self.size - 1):      # pass on the row received last
            r = self.irecv_(out[(self.rank - i - 1) % self.size], left, op="allgather")
            self.isend(out[(self.rank - i) % self.size], right, op="allgather").wait()
            r.wait()
        return out


__all__ = ["PeerComm", "PeerRequest"]
