"""Request: a non-blocking op of :class:`~lowcomm.comm.comm.Comm` in flight, charged to the
ledger when it completes.

It holds the MPI request but never calls it: waits and tests go through the communicator's
:meth:`~lowcomm.comm.comm.Comm._await` (watched, the only place that touches mpi4py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .tensors import Traffic, clock, since

if TYPE_CHECKING:
    from .comm import Comm


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
        """Block (watched) until the op completes."""
        if self._done:
            return
        t0 = clock()
        self._comm._await(self._req, self.op, self._sent, self._peer, block=True)
        self._complete(since(t0))

    def test(self) -> bool:
        """Poll once (watched); True when the op has completed."""
        if self._done:
            return True
        t0 = clock()
        if self._comm._await(self._req, self.op, self._sent, self._peer, block=False):
            self._complete(since(t0))
        return self._done

    def _complete(self, seconds: float) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
        self._keep = None
        if not self._charged:
            self._ledger.record(self.op, self._comm.level, self._sent, self._recv, seconds)
