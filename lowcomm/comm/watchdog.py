"""Watchdog: a blocking communication call that waits longer than its limit ends the job.

The limit of one call scales with what the α–β model (Hockney 1994) predicts for it on the
links its communicator crosses (``Comm.link``, set from the topology)::

    limit = max(timeout_s, factor × (rounds·α + bytes_sent/β)) + (outage_s if α >= 1 ms else 0)

``timeout_s`` (the floor; ``comm.timeout_s``, ``$LOWCOMM_TIMEOUT_S``, default 60 s) covers the
skew between ranks (one rank still computing, evaluating or checkpointing while the others wait)
and every call whose link is unknown; ``factor`` (``comm.watchdog_factor``,
``$LOWCOMM_WATCHDOG_FACTOR``, default 10) lets a legitimately long transfer — a 10 s outer
synchronisation over a slow link — finish; ``outage_s`` (``comm.outage_s``,
``$LOWCOMM_WATCHDOG_OUTAGE_S``, default 30 s) is the outage a wide-area link (one-way latency
α >= 1 ms: between datacenters) may suffer and recover from (TCP retransmits through it) before
the job is ended. A hang on a fast link (inside a node or a datacenter) still ends the job after
the floor. ``factor = 0`` and ``outage_s = 0`` give one fixed limit for every call.

Every MPI call lowcomm makes goes through :meth:`Comm._guard`, which registers the call here
for the calling thread with a *callable* describing it (op, bytes, whom it waits for): the text
is built only when a call is late, so the hot path pays for two dict operations, not formatting. One daemon thread per
process looks at the registered calls about four times per timeout; when one has waited too
long it prints which rank waits, in which op, for whom, and calls its ``abort`` (the Comm's
``MPI_Abort``, :func:`lowcomm.comm.comm.abort_world`'s kin) so that every rank ends (a rank stopped with SIGSTOP or stuck in a loop never answers; without this the
others would wait forever).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from contextlib import contextmanager

from ..errors import LowcommError
from .ledger import latency_rounds, wire_bytes

#: a link whose one-way latency is at least this is a wide-area one (between datacenters)
WIDE_AREA_ALPHA_S = 1e-3
_VOLUME_FAMILIES = {"allreduce", "allgather", "alltoall", "reduce_scatter", "bcast"}


class Watchdog:
    """Abort the MPI job when a watched call runs longer than its limit (module docstring).

    Args:
        timeout_s: the floor of every limit (0 = no watchdog); None: ``$LOWCOMM_TIMEOUT_S``
            or 60 s (``factor``, ``outage_s``: likewise, module docstring).
        rank: the world rank named in the message.
        abort: how to end the job (Comm passes its ``MPI_Abort``).
        factor: how many times the α–β prediction a call may take.
        outage_s: added to the limit of a call on a wide-area link.
    """

    def __init__(self, timeout_s: float | None, rank: int, abort=None, factor: float | None = None,
                 outage_s: float | None = None):
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        factor = default_factor() if factor is None else factor
        outage_s = default_outage_s() if outage_s is None else outage_s
        for name, v in (("timeout_s", timeout_s), ("factor", factor), ("outage_s", outage_s)):
            if not v >= 0 or math.isinf(v):
                raise ValueError(f"watchdog {name} must be a finite number >= 0, got {v}")
        self.timeout_s, self.rank = timeout_s, rank
        self.factor, self.outage_s = factor, outage_s
        self._abort = abort or _exit   # Comm passes its MPI_Abort (mpi4py lives in comm.py only)
        self._calls: dict[int, tuple[object, float, float, object]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def limit(self, op: str, nbytes: int | None, size: int, link) -> tuple[float, object]:
        """``(seconds, why)``: the limit of one call of ``op`` on ``nbytes`` per rank among
        ``size`` ranks joined by ``link`` (a :class:`~lowcomm.comm.topology.LinkModel`, or None:
        unknown); ``why`` is what :meth:`explain` turns into words (None: the floor alone)."""
        if link is None or not self.timeout_s:
            return self.timeout_s, None
        predicted = predict(op, nbytes or 0, size, link)
        outage = self.outage_s if link.alpha_s >= WIDE_AREA_ALPHA_S else 0.0
        limit = max(self.timeout_s, self.factor * predicted) + outage
        return limit, ((predicted, outage, link) if limit != self.timeout_s else None)

    def explain(self, limit: float, why) -> str:
        if why is None:
            return f"timeout {limit:g} s"
        predicted, outage, link = why
        text = (f"timeout {limit:.4g} s = max(floor {self.timeout_s:g} s, {self.factor:g} × α–β "
                f"{predicted:.3g} s on {link})")
        return text + (f" + outage allowance {outage:g} s (wide-area link)" if outage else "")

    @contextmanager
    def watch(self, describe, limit_s: float | None = None, why=None):
        """Watch the block; ``describe()`` returns ``(op, waits_for)`` text if it is late.
        ``limit_s``: this call's limit (default the floor, ``timeout_s``; see :meth:`limit`)."""
        if not self.timeout_s:
            yield
            return
        self._start()
        key = threading.get_ident()
        with self._lock:
            self._calls[key] = (describe, time.monotonic(),
                                self.timeout_s if limit_s is None else limit_s, why)
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
                late = [(describe, now - t0, limit, why) for describe, t0, limit, why
                        in self._calls.values() if now - t0 > limit]
            if late:
                describe, waited, limit, why = late[0]
                op, who = describe()
                sys.stderr.write(f"lowcomm watchdog: rank {self.rank} waited {waited:.1f} s "
                                 f"({self.explain(limit, why)}) in op {op}, waiting for {who}; "
                                 f"ending the job\n")
                sys.stderr.flush()
                self._abort()
                return


def _exit() -> None:
    """End this process with status 3 (without MPI; the Comms built by lowcomm pass an abort
    that ends every rank)."""
    os._exit(3)


def predict(op: str, nbytes: int, size: int, link) -> float:
    """α–β seconds of one call of ``op`` (``"allreduce.ring"``, ``"sendrecv"``,
    ``"check:allreduce.mpi"``, ...) on ``nbytes`` per rank among ``size`` ranks over ``link``:
    ``rounds·α + bytes_sent/β`` with :func:`~lowcomm.comm.ledger.latency_rounds` and, for the
    collectives with an analytic volume, :func:`~lowcomm.comm.ledger.wire_bytes` (otherwise the
    ``nbytes`` themselves, as for point-to-point)."""
    name = op.rpartition(":")[2]
    family = name.split(".")[0]
    sent = wire_bytes(family, nbytes, size)[0] if family in _VOLUME_FAMILIES else nbytes
    return link.seconds(sent, latency_rounds(name, size))


def _env(name: str, default: float) -> float:
    """``$name`` as a number >= 0 (``default`` when unset); a clear error naming it otherwise."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < math.inf:
        raise LowcommError(f"environment variable {name}={text!r}: expects a number >= 0")
    return v


# The floor, the factor and the outage allowance unless a config or a caller says otherwise
# (read when asked, so that a bad value is an error of the run, not of an import).
def default_timeout_s() -> float:
    return _env("LOWCOMM_TIMEOUT_S", 60.0)


def default_factor() -> float:
    return _env("LOWCOMM_WATCHDOG_FACTOR", 10.0)


def default_outage_s() -> float:
    return _env("LOWCOMM_WATCHDOG_OUTAGE_S", 30.0)
