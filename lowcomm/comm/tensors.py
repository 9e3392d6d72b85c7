"""What :class:`~lowcomm.comm.comm.Comm` works out about tensors and calls before and after MPI:
sizes and names for messages, the reduction op, the shape signature every rank compares, the
timing of a call, and the staging of a tensor into contiguous host memory.

Nothing here calls MPI (mpi4py is used from :mod:`lowcomm.comm.comm` alone).
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

from ..errors import CommError
from .ledger import charge_comm_cpu

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
                torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
                torch.bool: 10}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
META_LEN = 12          # dtype, numel, ndim, 6 dims, hash of further dims, op hash, root


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def describe(t: torch.Tensor) -> str:
    """``t``'s dtype and shape for an error message, e.g. ``float32[2, 3]``."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def reduce_op(op: str) -> bool:
    """Return True for an average, False for a sum; anything else is an error."""
    if op == "sum":
        return False
    if op in ("avg", "average", "mean"):
        return True
    raise ValueError(f"unknown reduction op {op!r}; use 'sum' or 'avg'")


def displacements(sizes: list[int]) -> list[int]:
    """Where each of ``sizes``' blocks starts when they are laid end to end."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()


class Traffic(NamedTuple):
    """The bytes a non-blocking op sends and receives; ``charged``: charged to the ledger when
    the op was posted (not again when it completes)."""
    sent: int
    recv: int
    charged: bool = False


def clock() -> tuple[float, float]:
    """Start of a timed MPI call: (wall, this thread's CPU time)."""
    return time.perf_counter(), time.thread_time()


def since(t0: tuple[float, float]) -> float:
    """Wall seconds since :func:`clock`; the thread's CPU seconds in between go to
    :func:`~lowcomm.comm.ledger.charge_comm_cpu` (MPI busy-polls while it waits)."""
    charge_comm_cpu(time.thread_time() - t0[1])
    return time.perf_counter() - t0[0]


def shape_meta(op: str, t: torch.Tensor, root: int) -> np.ndarray:
    """The signature of a collective call that every rank must share: ``t``'s dtype, size and
    shape, ``op`` and ``root`` as :data:`META_LEN` int64s."""
    meta = np.full(META_LEN, -1, dtype=np.int64)
    shape = list(t.shape)
    meta[0], meta[1], meta[2] = _DTYPE_CODES.get(t.dtype, 0), t.numel(), len(shape)
    meta[3:3 + min(6, len(shape))] = shape[:6]
    meta[9] = zlib.crc32(repr(shape[6:]).encode())
    meta[10] = zlib.crc32(op.encode())
    meta[11] = root
    return meta


def mismatch(table: np.ndarray, meta: np.ndarray) -> str | None:
    """None when every row of ``table`` (one :func:`shape_meta` per rank) is the same; else
    what each rank passed, relative to this rank's ``meta``."""
    if (table == table[0]).all():
        return None
    parts = []
    for r, row in enumerate(table):
        ops = "same op" if row[10] == meta[10] else "another op"
        dims = [int(d) for d in row[3:3 + min(6, int(row[2]))]]
        dt = str(_CODE_DTYPES.get(int(row[0]), "?")).replace("torch.", "")
        parts.append(f"rank {r}: {dt}{dims} ({ops}{', root %d' % row[11] if row[11] >= 0 else ''})")
    return "ranks passed different tensors: " + "; ".join(parts)


def host_only(op: str, rank: int, *ts: torch.Tensor) -> None:
    """Point-to-point and non-blocking calls take contiguous CPU tensors as they are."""
    for t in ts:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise CommError(op, rank, f"needs contiguous CPU tensors, got {describe(t)} on "
                            f"{t.device}; stage with Comm.staged()", nbytes(t))


def check_fits(op: str, rank: int, t: torch.Tensor, size: int, what: str) -> None:
    """Raise :class:`CommError` unless ``t`` is a contiguous CPU tensor of ``size`` bytes, the
    size of ``what``."""
    host_only(op, rank, t)
    if nbytes(t) != size:
        raise CommError(op, rank, f"{what} holds {size} bytes, the buffer {describe(t)} "
                        f"{nbytes(t)}", nbytes(t))


def check_counts(op: str, rank: int, t: torch.Tensor, counts: list[int], size: int) -> None:
    """Raise :class:`CommError` unless ``counts`` (one per rank) split ``t``'s elements."""
    if sum(counts) != t.numel() or len(counts) != size:
        raise CommError(op, rank, f"counts {list(counts)} do not split {describe(t)} over "
                        f"{size} ranks", nbytes(t))


@contextmanager
def staged(t: torch.Tensor, pinned: dict, read: bool = True, write: bool = True):
    """Yield a contiguous 1-D CPU tensor holding ``t``'s values; copy it back on exit.

    A contiguous CPU tensor is used in place. A CUDA tensor goes through a pinned host buffer
    kept in ``pinned`` (by dtype and size) for the next call, after synchronising the current
    stream.
    """
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous():
        yield t.reshape(-1)
        return
    if t.device.type == "cpu":
        host = t.reshape(-1).clone() if read else torch.empty(t.numel(), dtype=t.dtype)
    else:
        key = (t.dtype, t.numel())
        host = pinned.get(key)
        if host is None:
            host = pinned[key] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        if read:
            host.copy_(t.reshape(-1), non_blocking=True)
            torch.cuda.current_stream(t.device).synchronize()
    yield host
    if write:
        t.copy_(host.view(t.shape))
