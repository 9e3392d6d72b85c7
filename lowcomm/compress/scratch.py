"""Reused per-thread work buffers for the compressors' hot paths.

A fresh 16 MiB tensor per call costs page faults on every touch (the CPU allocator returns large
blocks to the system), so each pass that only needs a temporary writes into a buffer kept here,
by (purpose, dtype, device), grown on demand. A scratch buffer never escapes: no payload, result
or state may hold one (the next call overwrites it).
"""
from __future__ import annotations

import threading

import torch

_local = threading.local()

#: elements per block of a blocked pass (1 MiB of float32: the block's temporaries stay in cache,
#: and a 16 MiB bucket takes 16 blocks, so the per-op overhead stays small)
BLOCK = 1 << 18


def scratch(purpose: str, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D tensor of ``n`` elements of ``dtype`` on ``device``, reused by later calls with the
    same ``purpose`` in this thread (its contents are undefined)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (purpose, dtype, torch.device(device))
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = bufs[key] = torch.empty(max(n, 1), dtype=dtype, device=device)
    return buf[:n]


def blocks(n: int, step: int = BLOCK):
    """``(lo, hi)`` bounds of consecutive blocks of at most ``step`` elements covering ``n``."""
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


def l1_norm(x: torch.Tensor, step: int = BLOCK) -> torch.Tensor:
    """``‖x‖₁`` of flat ``x`` (a 0-d tensor of x's dtype), |x| taken block by block in a cached
    buffer: one read of x (``x.abs().sum()`` writes and re-reads a full temporary, and
    ``vector_norm(x, 1)`` is not vectorised on the CPU)."""
    n = x.numel()
    if n <= step or x.device.type != "cpu":
        return x.abs().sum()
    buf = scratch("l1", step, x.dtype, x.device)
    parts = [torch.abs(x[lo:hi], out=buf[:hi - lo]).sum() for lo, hi in blocks(n, step)]
    return torch.stack(parts).sum()
