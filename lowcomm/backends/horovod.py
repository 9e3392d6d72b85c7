"""Horovod as a second backend, initialised on lowcomm's own communicator.

Horovod (Sergeev & Del Balso 2018, arXiv 1802.05799) runs its own background thread that
negotiates ready tensors, fuses them and all-reduces them with MPI. lowcomm uses it as is,
through ``hvd.DistributedOptimizer``; the ledger is charged the bandwidth-optimal volume of the
gradient all-reduce each step, and the seconds the step waited for it.
"""
from __future__ import annotations

import time

import torch

from ..comm import Comm
from ..errors import LowcommError
from ..ledger import wire_bytes


def hvd_module():
    try:
        import horovod.torch as hvd
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise LowcommError("backend 'horovod' needs Horovod with PyTorch support; run "
                           "scripts/bootstrap.sh (make test/demo do) to build it") from e
    return hvd


def init(comm: Comm):
    """Initialise Horovod on ``comm`` (once per process) and return ``horovod.torch``."""
    hvd = hvd_module()
    if not hvd.is_initialized():
        hvd.init(comm=comm.mpi)
    if hvd.size() != comm.size or hvd.rank() != comm.rank:
        raise LowcommError(f"Horovod is initialised on {hvd.size()} ranks (this is rank "
                           f"{hvd.rank()}), but the communicator has {comm.size} (rank {comm.rank})")
    return hvd


class HorovodOptimizer:
    """``hvd.DistributedOptimizer`` (average over ranks) with lowcomm's ledger accounting."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 backward_passes_per_step: int = 1):
        hvd = init(comm)
        self.comm = comm
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), op=hvd.Average,
            backward_passes_per_step=backward_passes_per_step)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                               if p.requires_grad)

        def wrong_object(*_):
            raise LowcommError("with backend='horovod', call step() on the SyncDP object, not on "
                               "the wrapped optimizer (Horovod works on its own copy of it)")
        optimizer.register_step_pre_hook(wrong_object)

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.synchronize()
        self.comm.ledger.record("allreduce.horovod", self.comm.level,
                                *wire_bytes("allreduce", self._grad_bytes, self.comm.size),
                                seconds=time.perf_counter() - t0)

    def step(self, closure=None):
        self.synchronize()
        with self.optimizer.skip_synchronize():
            return self.optimizer.step(closure)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # Horovod's checks that no all-reduce is still pending
