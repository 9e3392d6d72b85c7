"""What every part of :class:`~lowcomm.comm.comm.Comm` shares: mpi4py imported on first use,
typed and raw buffers of tensors, timing charged to the ledger, non-blocking requests, and ending
the job."""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from ..ledger import charge_comm_cpu

if TYPE_CHECKING:
    from .core import Comm

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
_HALF_OPS: dict = {}                # torch dtype -> MPI.Op summing 16-bit floats, created on first use


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


def _reduce_op(op: str) -> bool:
    """Return True for an average, False for a sum; anything else is an error."""
    if op == "sum":
        return False
    if op in ("avg", "average", "mean"):
        return True
    raise ValueError(f"unknown reduction op {op!r}; use 'sum' or 'avg'")


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


