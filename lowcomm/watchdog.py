"""Watchdog: a blocking communication call that waits longer than ``timeout_s`` ends the job.

Every MPI call lowcomm makes goes through :meth:`Comm._guard`, which registers the call here
for the calling thread with a *callable* describing it (op, bytes, whom it waits for): the text
is built only when a call is late, so the hot path pays for two dict operations, not formatting. One daemon thread per
process looks at the registered calls about four times per timeout; when one has waited too
long it prints which rank waits, in which op, for whom, and calls its ``abort`` (the Comm's
``MPI_Abort``, :func:`lowcomm.comm.abort_world`'s kin) so that every rank ends (a rank stopped with SIGSTOP or stuck in a loop never answers; without this the
others would wait forever).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager


class Watchdog:
    """Abort the MPI job when a watched call runs longer than ``timeout_s`` (0 = never)."""

    def __init__(self, timeout_s: float, rank: int, abort=None):
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self._abort = abort or _exit   # Comm passes its MPI_Abort (mpi4py lives in comm.py only)
        self._calls: dict[int, tuple[object, float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, describe):
        """Watch the block; ``describe()`` returns ``(op, waits_for)`` text if it is late."""
        if not self.timeout_s:
            yield
            return
        self._start()
        key = threading.get_ident()
        with self._lock:
            self._calls[key] = (describe, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lowcomm-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                late = [(describe, now - t0) for describe, t0 in self._calls.values()
                        if now - t0 > self.timeout_s]
            if late:
                describe, waited = late[0]
                op, who = describe()
                sys.stderr.write(f"lowcomm watchdog: rank {self.rank} waited {waited:.1f} s "
                                 f"(timeout {self.timeout_s:g} s) in op {op}, waiting for {who}; "
                                 f"ending the job\n")
                sys.stderr.flush()
                self._abort()
                return


def _exit() -> None:
    """End this process with status 3 (without MPI; the Comms built by lowcomm pass an abort
    that ends every rank)."""
    os._exit(3)


DEFAULT_TIMEOUT_S = float(os.environ.get("LOWCOMM_TIMEOUT_S", "60"))
