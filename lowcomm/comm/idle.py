"""How a background thread waits for its pending MPI call without taking a core from the
computation: test, sleep, test again (:attr:`lowcomm.comm.comm.Comm.idle`).

A blocking MPI call polls the network on the calling core until it completes. A thread that
reduces in the background while the training steps compute (an outer loop's fragments over a
WAN) would spin through every round trip on a core the computation needs; so its communicators
run each blocking call as the non-blocking form, tested between sleeps. How long it sleeps is
the trade: short sleeps notice completion sooner but wake the thread (a context switch, the
other thread's caches) hundreds of times per second.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable

#: the blocking MPI calls a communicator with an idle wait runs as their non-blocking forms
#: (:meth:`lowcomm.comm.comm.Comm._call`), by mpi4py's method names
NONBLOCKING = {"Allreduce": "Iallreduce", "Allgather": "Iallgather", "Allgatherv": "Iallgatherv",
               "Alltoall": "Ialltoall", "Alltoallv": "Ialltoallv", "Bcast": "Ibcast",
               "Barrier": "Ibarrier", "Reduce_scatter": "Ireduce_scatter", "Send": "Isend",
               "Recv": "Irecv", "Wait": "Wait"}


class IdleWait:
    """The sleeps between tests of a pending call: ``first_s`` after the first unsuccessful
    test, doubling after each next one up to ``max_s`` (a call waiting a 73 ms WAN all-gather
    is tested 6 times instead of 36 at a fixed 2 ms), except while someone waits for the call's
    result (:meth:`hurry`): then the sleeper is woken at once and tests every ``first_s``.

    Example::

        idle = IdleWait(0.002, 0.032)
        comm.idle = idle                  # the reduction thread's calls sleep between tests
        with idle.hurry():                # the main thread needs the result now
            avg = future.result()
    """

    def __init__(self, first_s: float, max_s: float | None = None):
        max_s = first_s if max_s is None else max_s
        if not 0 < first_s <= max_s:
            raise ValueError(f"IdleWait needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s, self.max_s = first_s, max_s
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._hurried = 0

    def pause(self, n: int) -> float:
        """Seconds to sleep after the ``n``-th unsuccessful test of a call (from 0)."""
        if self._hurried:
            return self.first_s
        return min(self.first_s * 2 ** min(n, 32), self.max_s)

    def sleep(self, n: int) -> None:
        """Sleep :meth:`pause` ``(n)`` seconds, or until :meth:`hurry` begins."""
        self._wake.wait(self.pause(n))
        self._wake.clear()

    @contextmanager
    def hurry(self):
        """While inside, the sleeping thread tests every ``first_s`` (woken now)."""
        with self._lock:
            self._hurried += 1
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._hurried -= 1


def spin_then_nap(done: Callable[[], bool], yield_s: float, nap_s: float = 50e-6) -> None:
    """Poll ``done`` until it is true: for ``yield_s`` seconds handing the core to any thread
    that wants it between polls (``sched_yield``), then with naps of ``nap_s`` in between. A
    waiter with a core of its own sees the event at once; an oversubscribed one hands the core
    over at every poll (a vendor barrier spins, stealing the core from the ranks still working)."""
    until = None
    while not done():
        now = time.perf_counter()
        until = until or now + yield_s
        if now < until:
            os.sched_yield()
        else:
            time.sleep(nap_s)
