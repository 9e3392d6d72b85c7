"""Ledger: bytes and seconds per communication op and per communicator level.

Bytes are what *this rank* puts on the wire (``bytes_sent``) and takes off it (``bytes_recv``).
lowcomm's own algorithms are built from point-to-point calls, so their bytes are counted
exactly; a vendor collective is charged its bandwidth-optimal volume (see :func:`wire_bytes`).
Seconds are the time the calling thread spent inside the op (exposed communication time).

Algorithm bandwidth and bus bandwidth follow nccl-tests (``doc/PERFORMANCE.md`` there):
``algbw = S / t`` and ``busbw = algbw * factor(op, K)`` so that numbers for different ops and
rank counts compare against the link speed.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


def busbw_factor(op: str, size: int) -> float:
    """nccl-tests' bus-bandwidth factor for a collective family on ``size`` ranks."""
    if size <= 1:
        return 0.0 if op.split(".")[0] in {"allreduce", "allgather", "reduce_scatter", "alltoall"} else 1.0
    family = op.split(".")[0]
    if family == "allreduce":
        return 2.0 * (size - 1) / size
    if family in {"allgather", "reduce_scatter", "alltoall"}:
        return (size - 1) / size
    return 1.0


def wire_bytes(op: str, nbytes: int, size: int) -> tuple[int, int]:
    """Bandwidth-optimal (sent, received) bytes per rank of a vendor collective on ``nbytes``.

    ``nbytes`` is the size of the buffer each rank passes in (for allgather: its own block).
    Returns integers; an all-reduce of ``n`` bytes on ``K`` ranks costs ``2(K-1)/K * n`` each way.
    """
    if size <= 1:
        return 0, 0
    family = op.split(".")[0]
    if family == "allreduce":
        v = 2 * (size - 1) * nbytes // size
        return v, v
    if family in {"allgather", "alltoall"}:
        return (size - 1) * nbytes, (size - 1) * nbytes
    if family == "reduce_scatter":
        v = (size - 1) * nbytes // size
        return v, v
    if family == "bcast":
        return nbytes, nbytes  # the pipelined broadcast moves n through every rank once
    raise ValueError(f"no analytic volume for op {op!r}")


def latency_rounds(op: str, size: int) -> int:
    """Message rounds one call of ``op`` takes on ``size`` ranks (the α term's multiplier in the
    α–β model of Hockney 1994 / Thakur, Rabenseifner & Gropp 2005): a ring all-reduce has
    2(K−1) steps, tree-shaped ones 2⌈log2 K⌉, gathers K−1, point-to-point one."""
    if size <= 1:
        return 0
    family, _, algorithm = op.partition(".")
    log2 = max(1, (size - 1).bit_length())
    if family in ("send", "recv", "sendrecv"):
        return 1
    if family == "allreduce":
        return 2 * (size - 1) if algorithm == "ring" else 2 * log2
    if family in ("allgather", "alltoall", "reduce_scatter"):
        return size - 1
    if family in ("bcast", "barrier"):
        return log2
    return 1


def alpha_beta_seconds(rows: list[dict], size: int, alpha_s: float, bytes_per_s: float,
                       levels: tuple[str, ...] | None = None) -> float:
    """Modelled time of the traffic in ledger ``rows`` over one link: Σ rounds·α + bytes_sent/β
    (one rank's view; rows of other ``levels`` are taken as free)."""
    return sum(latency_rounds(r["op"], size) * r["calls"] * alpha_s + r["bytes_sent"] / bytes_per_s
               for r in rows if levels is None or r["level"] in levels)


@dataclass(frozen=True)
class Link:
    """A network link of the α–β model: one-way latency ``delay_ms`` (α) and bandwidth
    ``rate_mbit`` (β, Mbit/s)."""
    delay_ms: float
    rate_mbit: float

    @classmethod
    def parse(cls, text: str) -> "Link":
        """``DELAY_MS,RATE_MBIT``, e.g. ``25,100``; a ValueError names what was wrong."""
        try:
            d, r = (float(x) for x in str(text).split(","))
        except ValueError:
            raise ValueError(f"a link is DELAY_MS,RATE_MBIT (e.g. 25,100), got {text!r}") from None
        if not (0 <= d < float("inf") and 0 < r < float("inf")):
            raise ValueError(f"link delay must be >= 0 and rate > 0, got {text!r}")
        return cls(d, r)

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def seconds(self, rows: list[dict], size: int) -> float:
        """The α–β time of ledger ``rows`` (one rank's) on ``size`` ranks over this link."""
        return alpha_beta_seconds(rows, size, self.delay_ms / 1e3, self.bytes_per_s)

    def traffic_seconds(self, rounds: float, nbytes: float) -> float:
        """The α–β time of ``rounds`` message rounds carrying ``nbytes`` bytes."""
        return rounds * self.delay_ms / 1e3 + nbytes / self.bytes_per_s

    def __str__(self) -> str:
        return f"{self.delay_ms:g} ms, {self.rate_mbit:g} Mbit/s"


_comm_cpu = [0.0]
_comm_cpu_lock = threading.Lock()


def charge_comm_cpu(seconds: float) -> None:
    """Add CPU seconds spent inside a communication call (any thread, any communicator)."""
    with _comm_cpu_lock:
        _comm_cpu[0] += seconds


def comm_cpu_seconds() -> float:
    """CPU seconds this process's threads have spent inside communication calls so far (every
    :class:`~lowcomm.comm.comm.Comm` call charges its thread's CPU time; MPI busy-polls while it
    waits, so this is what to subtract from the process's CPU time to get its computation)."""
    with _comm_cpu_lock:
        return _comm_cpu[0]


def compute_cpu_clock() -> float:
    """CPU seconds of computation so far: the process's CPU time (all its threads, the training
    thread and the reducer's) minus :func:`comm_cpu_seconds`. Time the process spends waiting
    for a core, descheduled by other processes, does not count, so differences of this clock
    measure a run's computation whatever else the machine is running (cache and memory
    contention still slow it somewhat)."""
    return time.process_time() - comm_cpu_seconds()


@dataclass
class OpStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0

    def add(self, calls: int, sent: int, recv: int, seconds: float) -> None:
        self.calls += calls
        self.bytes_sent += sent
        self.bytes_recv += recv
        self.seconds += seconds


class Ledger:
    """Accumulates :class:`OpStats` keyed by ``(level, op)``; thread-safe.

    Inside :meth:`scope`, traffic recorded on the same thread is charged to the scope's op, so a
    ring all-reduce made of many ``sendrecv`` calls shows up as one ``allreduce.ring`` row
    carrying the exact bytes of its messages.

    Example::

        ledger = Ledger()
        with ledger.scope("allreduce.ring", "world"):
            ledger.record("sendrecv", "world", sent=1024, recv=1024)
        ledger.totals()["bytes_sent"]   # 1024
    """

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], OpStats] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    # recording ------------------------------------------------------------------------------
    def record(self, op: str, level: str, sent: int = 0, recv: int = 0, seconds: float = 0.0,
               calls: int = 1) -> None:
        scope = getattr(self._local, "scope", None)
        if scope is not None:
            scope[0] += sent
            scope[1] += recv
            return
        self._add(op, level, calls, sent, recv, seconds)

    def _add(self, op, level, calls, sent, recv, seconds) -> None:
        with self._lock:
            self._stats.setdefault((level, op), OpStats()).add(calls, sent, recv, seconds)

    @contextmanager
    def scope(self, op: str, level: str):
        """Charge everything recorded on this thread inside the block to one ``op`` call."""
        if getattr(self._local, "scope", None) is not None:  # nested: the outer scope owns it
            yield
            return
        self._local.scope = acc = [0, 0]
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._local.scope = None
            self._add(op, level, 1, acc[0], acc[1], time.perf_counter() - t0)

    # reading --------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(level=lv, op=op, **asdict(s)) for (lv, op), s in sorted(self._stats.items())]

    def totals(self) -> dict:
        out = OpStats()
        for r in self.rows():
            out.add(r["calls"], r["bytes_sent"], r["bytes_recv"], r["seconds"])
        return asdict(out)

    def rounds(self, size: int) -> int:
        """Total message rounds (the α–β model's latency count) of everything recorded."""
        return sum(latency_rounds(r["op"], size) * r["calls"] for r in self.rows())

    def by_level(self) -> dict[str, int]:
        """Bytes sent per level by this rank."""
        out: dict[str, int] = {}
        for r in self.rows():
            out[r["level"]] = out.get(r["level"], 0) + r["bytes_sent"]
        return out

    def get(self, op: str, level: str = "world") -> OpStats:
        with self._lock:
            s = self._stats.get((level, op), OpStats())
            return OpStats(s.calls, s.bytes_sent, s.bytes_recv, s.seconds)

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()

    def state_dict(self) -> dict:
        return {"rows": self.rows()}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self._stats = {(r["level"], r["op"]): OpStats(r["calls"], r["bytes_sent"], r["bytes_recv"],
                                                           r["seconds"]) for r in state["rows"]}
