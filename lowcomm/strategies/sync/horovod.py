"""Horovod as a second backend, initialised on lowcomm's own communicator.

Horovod (Sergeev & Del Balso 2018, arXiv 1802.05799) runs its own background thread that
negotiates ready tensors, fuses them and all-reduces them with MPI. lowcomm uses it as is,
through ``hvd.DistributedOptimizer``; the ledger is charged the bandwidth-optimal volume of the
gradient all-reduce each step, and the seconds the step waited for it.
"""
from __future__ import annotations

import time

import torch

from ...comm.comm import Comm
from ...errors import LowcommError
from ...comm.ledger import wire_bytes
from ..base import Strategy
from ..passes import BackwardPasses
from ..buffers import Buffers


def hvd_module():
    try:
        import horovod.torch as hvd
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise LowcommError("backend 'horovod' needs Horovod with PyTorch support, which this "
                           f"environment lacks ({e}): build it against your torch and MPI with "
                           "scripts/build_horovod.sh (the install guide's 'Horovod' section; "
                           "make setup does it on a fresh machine)") from e
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


def check_compressor(compressor) -> None:
    """Raise unless Horovod's static ``compression=`` interface can run ``compressor`` (None:
    dense): its payloads are summed on the wire, it keeps no state (no error feedback, no
    generator: Horovod calls it without a key or a rank), and its payload is one tensor of a
    dtype Horovod 0.28.1 reduces (no bfloat16)."""
    if compressor is None:
        return
    why = None
    if not compressor.summable:
        why = "its payloads cannot be summed by an all-reduce"
    elif compressor.state_dict():
        why = "it keeps state (error feedback, a generator) that Horovod's interface cannot carry"
    else:
        payload, _ = compressor.compress(torch.zeros(8), "horovod")
        if len(payload) != 1 or payload[0].numel() != 8:
            why = "its payload is not one tensor shaped like the gradient"
        elif payload[0].dtype == torch.bfloat16:
            why = "it sends bfloat16, which Horovod 0.28.1 cannot reduce"
    if why:
        raise LowcommError(f"compressor {compressor.name!r} cannot run on the horovod backend: {why}; "
                           f"use strategy.backend = \"mpi\" (or compressor.name = \"fp16\")")


class HorovodCompression:
    """A lowcomm compressor behind Horovod's ``compress(tensor) -> (tensor, ctx)`` /
    ``decompress(tensor, ctx)`` interface (one payload tensor, shaped like the gradient)."""

    def __init__(self, compressor):
        check_compressor(compressor)
        self.compressor = compressor

    def compress(self, tensor: torch.Tensor):
        payload, ctx = self.compressor.compress(tensor.reshape(-1), "horovod")   # one tensor (checked)
        return payload[0].view(tensor.shape), (ctx, tensor.shape)

    def decompress(self, tensor: torch.Tensor, ctx):
        inner, shape = ctx
        return self.compressor.decompress([tensor.reshape(-1)], inner).view(shape)


class HorovodDP(Strategy):
    """Synchronous data parallelism through Horovod: ``hvd.DistributedOptimizer`` (average over
    ranks) on lowcomm's communicator, with lowcomm's ledger accounting. The same update as
    :class:`~lowcomm.strategies.sync.syncdp.SyncDP`, so the two stand in for each other.

    With a (summable, stateless) ``compressor`` the gradients travel in its payload format
    through Horovod's ``compression=`` hook; they are divided by K before the sum
    (``gradient_predivide_factor = K``) so a 16-bit sum cannot overflow, as lowcomm's own
    :class:`~lowcomm.compress.cast.Cast` does. The ledger is charged the payload's bytes.

    Example::

        opt = HorovodDP(model, torch.optim.SGD(model.parameters(), lr=0.1))
        opt.zero_grad(); loss.backward(); opt.step()
    """

    name = "syncdp(horovod)"
    per_rank_state = False      # the optimizer's state only: a replica
    lockstep = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, backward_passes_per_step: int = 1, compressor=None):
        super().__init__(model, optimizer, comm)
        comm = self.comm
        compression = HorovodCompression(compressor) if compressor is not None else None  # checks it
        hvd = init(comm)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        with self.guard.own_step():     # Horovod steps the optimizer once to create its state
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        extra = {}
        if compressor is not None:
            extra = {"compression": compression,
                     "gradient_predivide_factor": float(comm.size)}
        self._hvd = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), op=hvd.Average,
            backward_passes_per_step=backward_passes_per_step, **extra)
        self._share(self._hvd)                  # Horovod steps its own copy of the optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        if compressor is None:
            self._grad_bytes = sum(p.numel() * p.element_size() for p in params)
        else:   # the payload of each gradient, as Horovod will all-reduce it
            self._grad_bytes = sum(t.numel() * t.element_size() for p in params
                                   for t in compressor.compress(torch.zeros(p.numel(), dtype=p.dtype),
                                                                "horovod")[0])
        self.buffers = Buffers(model)
        self.passes = BackwardPasses(int(backward_passes_per_step), self.synchronize)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, _param) -> None:
        self.passes.exchanging()      # Horovod's own hooks send; this queues the pass's end

    def synchronize(self) -> None:
        """Wait for Horovod's all-reduces (launched by its own gradient hooks) and write the
        averages into ``p.grad``; at the end of every ``backward_passes_per_step``-th backward."""
        t0 = time.perf_counter()
        self._hvd.synchronize()
        self.comm.ledger.record("allreduce.horovod", self.comm.level,
                                *wire_bytes("allreduce", self._grad_bytes, self.comm.size),
                                seconds=time.perf_counter() - t0)

    def no_sync(self):
        raise LowcommError("backend='horovod' accumulates gradients with "
                           "backward_passes_per_step = N (Horovod has no no_sync); set it to the "
                           "number of backward() calls per step")

    def _step(self, closure=None):
        self.passes.before_step()
        with self._hvd.skip_synchronize():
            loss = self._hvd.step(closure)
        self.buffers.broadcast(self.comm)
        return loss

    def skip(self) -> None:
        self.passes.before_step()
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._hvd.zero_grad()  # Horovod's checks that no all-reduce is still pending

    def _state_dict(self) -> dict:
        return {"optimizer": self._hvd.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self._hvd.load_state_dict(state["optimizer"])

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
