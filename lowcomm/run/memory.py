"""Memory per rank as a result: what the model's parameters, gradients and optimizer state hold,
and the process's peak.

Tensors are counted by their storage, once each (a parameter that is a view of a method's flat
buffer counts the buffer's bytes once; a gradient that is a view of a reduction bucket counts
the bucket). A method adds what it holds beside the model and its optimizer through
:meth:`~lowcomm.strategies.capabilities.Capabilities.memory_tensors` (ZeRO-1's gradient buckets, an outer
loop's outer parameters and momentum). The peak is ``torch.cuda.max_memory_allocated`` on a CUDA
model, else the process's peak resident set size (which includes Python, torch and the data).
"""
from __future__ import annotations

import resource
import sys
import weakref
from contextlib import contextmanager

import torch

from ..errors import LowcommError
from ..strategies.sharded.partition import ShardedGrad

GIB = 1 << 30


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (FSDP2's), else ``t`` itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")   # none exists before it is imported
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (None, sharded placeholders and meta
    tensors — modules another pipeline stage holds — skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.is_meta or isinstance(t, ShardedGrad):
            continue
        t = local_part(t)
        s = t.untyped_storage()
        key = (s.data_ptr(), t.device)
        if key not in seen and s.nbytes():
            seen.add(key)
            total += s.nbytes()
    return total


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def peak_bytes(model: torch.nn.Module) -> tuple[int, str]:
    """(peak bytes, "cuda" or "rss") of this process."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(p.device)), "cuda"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss       # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "rss"


def measure(model: torch.nn.Module, method) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes (the method's own tensors
    included) and its peak memory."""
    extra = method.memory_tensors()
    optimizer = method.optimizer
    params = list(model.parameters())
    groups = [q for g in optimizer.param_groups for q in g["params"]]
    peak, source = peak_bytes(model)
    return {"param_bytes": storage_bytes(params + extra.get("param", [])),
            "grad_bytes": storage_bytes([p.grad for p in params] + [q.grad for q in groups]
                                        + extra.get("grad", [])),
            "optimizer_state_bytes": storage_bytes(state_tensors(optimizer) + extra.get("state", [])),
            "peak_bytes": peak, "peak_of": source}


class _Saved:
    """Live bytes of the tensors autograd saves for backward (the activations), and their peak."""

    def __init__(self, exclude: set):
        self.exclude, self.live, self.count, self.now, self.peak = exclude, {}, {}, 0, 0

    def pack(self, t: torch.Tensor):
        with torch.no_grad():
            s = local_part(t).untyped_storage()
        key = s.data_ptr()
        if t.is_meta or key in self.exclude or not s.nbytes():
            return t
        if key not in self.live:
            self.live[key] = s.nbytes()
            self.now += s.nbytes()
            self.peak = max(self.peak, self.now)
        self.count[key] = self.count.get(key, 0) + 1
        weakref.finalize(t, self._drop, key)
        return t

    def _drop(self, key) -> None:
        self.count[key] -= 1
        if not self.count[key]:
            self.now -= self.live.pop(key)
            del self.count[key]


@contextmanager
def saved_activations(model: torch.nn.Module):
    """Inside: the peak bytes of the tensors autograd saves for backward (``.peak``), each
    storage once, the model's parameters and buffers not counted (they are not activations):
    a forward and backward pass's activation memory, under any schedule (a pipeline's
    micro-batches free theirs as their backward passes run)."""
    exclude = {local_part(t).untyped_storage().data_ptr()
               for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    saved = _Saved(exclude)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        yield saved


def check_cap(mem: dict, max_gib: float, rank: int, step: int) -> None:
    """Fail clearly where this rank's peak memory is above ``max_gib`` (0: no cap)."""
    if max_gib and mem["peak_bytes"] > max_gib * GIB:
        raise LowcommError(f"rank {rank}: peak memory {mem['peak_bytes'] / GIB:.2f} GiB "
                           f"({mem['peak_of']}) after step {step} is above max_memory_gib = "
                           f"{max_gib:g} (parameters {mem['param_bytes'] / GIB:.2f}, gradients "
                           f"{mem['grad_bytes'] / GIB:.2f}, optimizer state "
                           f"{mem['optimizer_state_bytes'] / GIB:.2f} GiB)")


__all__ = ["GIB", "check_cap", "measure", "peak_bytes", "saved_activations", "storage_bytes"]
