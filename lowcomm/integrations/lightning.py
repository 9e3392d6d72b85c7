"""PyTorch Lightning with any lowcomm method, launched with ``mpirun``: :class:`LowcommStrategy`.

``Trainer(strategy=LowcommStrategy("diloco:period=50"))`` runs one process per rank, the ranks
being the MPI job's; the optimizer ``configure_optimizers`` returns becomes the method (its LR
schedulers keep driving it: the method shares the optimizer's ``param_groups``). What the
strategy does, in Lightning's terms:

1. ranks, ``barrier``, ``broadcast``, ``all_gather`` and ``reduce`` (``self.log(...,
   sync_dist=True)``) go over MPI; rank 0 is global zero (it logs and writes checkpoints); the
   training and validation data are sharded over the ranks (a ``DistributedSampler``);
2. ``accumulate_grad_batches`` keeps the method's exchange for the micro-batch that ends an
   optimizer step (the others run under the method's ``no_sync()``);
3. ``gradient_clip_val`` under ``precision="bf16-mixed"`` or ``"16-mixed"`` clips the gradients
   the method applies (with ``16-mixed`` they are unscaled first, and the method then does not
   unscale them again);
4. a checkpoint is Lightning's file, written by rank 0, plus every rank's own model and method
   state beside it (``<file>.lowcomm-rank<r>-of-<K>.pt``: DiLoCo's local models and error
   feedback differ between ranks); ``fit(ckpt_path=...)`` resumes each rank from its own, so a
   resume at an epoch boundary is exact;
5. when training ends, the method ends: the same model, buffers included, on every rank.

Example (``launchers/local.sh -n 2 python train.py``)::

    import lightning as L
    from lowcomm.integrations.lightning import LowcommStrategy

    trainer = L.Trainer(strategy=LowcommStrategy("syncdp", compressor="int8"), accelerator="cpu",
                        devices=1, max_steps=100, precision="bf16-mixed", gradient_clip_val=1.0,
                        accumulate_grad_batches=4)
    trainer.fit(module, data)                     # every rank ends with the same model

``devices=1``: each rank drives one device (with CUDA, its node-local GPU). The parameter server
and the sharding methods (zero1, zero2, fsdp) are refused: use
:mod:`lowcomm.integrations.transformers` or lowcomm's own loop.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_only

from ..comm.comm import Comm
from ..comm.ledger import Ledger
from ..errors import LowcommError
from ..strategies.base import Strategy
from .launcher import init, refuse_unsupported


class MPIRanks(ClusterEnvironment):
    """Lightning's view of the MPI job: ranks and node-local ranks from lowcomm's Comm; the
    processes are mpirun's (nothing for Lightning to start or connect)."""

    def __init__(self, comm: Comm):
        self.comm, self._local = comm, comm.split_shared()
        leaders = sorted(r for r in comm.allgather_object(comm.rank if self._local.rank == 0 else None)
                         if r is not None)
        self._node = leaders.index(self._local.bcast_object(comm.rank))

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"                  # unused: nothing connects through torch.distributed

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False                        # chosen by LowcommStrategy, never auto-detected

    def world_size(self) -> int:
        return self.comm.size

    def set_world_size(self, size: int) -> None:
        if size != self.comm.size:
            raise LowcommError(f"Lightning asked for {size} processes; the MPI job has "
                               f"{self.comm.size} (launch with mpirun -n {size}, devices=1)")

    def global_rank(self) -> int:
        return self.comm.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self.comm.rank:
            raise LowcommError(f"Lightning set global rank {rank} on MPI rank {self.comm.rank}")

    def local_rank(self) -> int:
        return self._local.rank

    def node_rank(self) -> int:
        return self._node


class _MethodMixedPrecision(MixedPrecision):
    """Lightning's mixed precision for a lowcomm method, which can unscale inside its own step
    (``_step_supports_amp_scaling``, so that a GradScaler's skip is agreed by the ranks):
    Lightning refuses to clip for such an optimizer. Here the gradients are unscaled before
    clipping (``16-mixed``) and the method finds them unscaled; under ``bf16-mixed`` nothing is
    scaled, so clipping is plain."""

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        out = closure()
        skip = out is None and model.automatic_optimization    # backward skipped
        if skip:
            self._after_closure(model, optimizer)
            return out
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        step = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
        kwargs = {} if gradient_clip_algorithm is None else \
            {"gradient_clip_algorithm": gradient_clip_algorithm}
        Precision.clip_gradients(self, optimizer, clip_val, **kwargs)


class LowcommStrategy(ParallelStrategy):
    """A Lightning strategy whose ranks are the MPI job's and whose optimizer is a lowcomm
    method (see the module docstring).

    Args:
        method: the method's spec (``"syncdp"``, ``"diloco:period=50"``; :func:`lowcomm.build`).
        compressor: the gradient compressor's name (``"int8"``, ``"powersgd"``) or settings.
        comm: the communicator (default: the world).
        options: more of the method's settings (they win over the spec's).
        accelerator, checkpoint_io, precision_plugin: Lightning's, as for its other strategies.
    """

    strategy_name = "lowcomm"

    def __init__(self, method: str = "syncdp", compressor=None, comm: Comm | None = None,
                 accelerator=None, checkpoint_io=None, precision_plugin=None, **options):
        self.comm = init(comm)
        from ..run.registry import parse_spec
        parse_spec(method, "method")                  # a wrong spec fails here, naming it
        self.method_spec, self.compressor, self.options = method, compressor, options
        self.methods: list[Strategy] = []
        self._ctl = self.comm.dup(Ledger(), "control")           # bookkeeping: not charged
        super().__init__(accelerator=accelerator, parallel_devices=None,
                         cluster_environment=MPIRanks(self.comm), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)

    # ranks --------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return devices[0]

    @property
    def is_distributed(self) -> bool:       # Lightning then shards the data (DistributedSampler)
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.comm.size, "rank": self.comm.rank}

    def setup_environment(self) -> None:
        rank_zero_only.rank = self.comm.rank
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def barrier(self, name: str | None = None) -> None:
        self._ctl.barrier()

    def broadcast(self, obj, src: int = 0):
        return self._ctl.bcast_object(obj, src)

    def all_gather(self, tensor: torch.Tensor, group=None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (rank order)."""
        if sync_grads:
            raise LowcommError("all_gather(sync_grads=True) is not supported by LowcommStrategy "
                               "(gradients flow through lowcomm's method, not the gather)")
        return self._ctl.allgather(tensor.detach().contiguous())

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """The mean (``"mean"``, ``"avg"``) or sum (``"sum"``) over the ranks; non-tensors pass
        through."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        if op not in ("mean", "avg", "sum"):
            raise LowcommError(f"reduce: reduce_op must be 'mean' or 'sum', got {reduce_op!r}")
        out = tensor.detach().clone().contiguous()
        if not out.is_floating_point() and op != "sum":
            out = out.double()
        self._ctl.allreduce_(out, "sum" if op == "sum" else "avg")
        return out

    # the method ---------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        p = self.precision_plugin
        if type(p) is MixedPrecision:
            self.precision_plugin = _MethodMixedPrecision(p.precision, p.device, p.scaler)
        super().setup(trainer)

    def setup_optimizers(self, trainer) -> None:
        """``configure_optimizers``' optimizer (and schedulers), the optimizer made the method."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise LowcommError(f"LowcommStrategy takes one optimizer from configure_optimizers, "
                               f"got {len(self.optimizers)}: each method exchanges the whole model")
        from ..run.registry import build
        method = build(self.method_spec, self.lightning_module, self.optimizers[0], self.comm,
                       compressor=self.compressor, **self.options)
        try:
            refuse_unsupported(method, "LowcommStrategy")
        except LowcommError:
            method.close()
            raise
        self.methods = [method]
        self.optimizers = [method]

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True                  # the model is restored after the method is built on it

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Backward passes of micro-batches that end no optimizer step exchange nothing."""
        with contextlib.ExitStack() as stack:
            for m in self.methods:
                stack.enter_context(m.no_sync())
            yield None

    def on_train_end(self) -> None:
        """Training is over: the method ends, leaving the same model on every rank."""
        for m in self.methods:
            if not m.closed:
                m.finish()
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        for m in self.methods:
            m.close()
        super().on_exception(exception)

    # checkpoints --------------------------------------------------------------------------------
    def _own_file(self, filepath) -> str:
        return f"{os.fspath(filepath)}.lowcomm-rank{self.comm.rank}-of-{self.comm.size}.pt"

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """Lightning's checkpoint from rank 0; this rank's model and method state beside it."""
        super().save_checkpoint(checkpoint, filepath, storage_options)
        own = {k: checkpoint[k] for k in ("state_dict", "optimizer_states") if k in checkpoint}
        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(filepath))), exist_ok=True)
        torch.save(own, self._own_file(filepath))

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._own_file(filepath))

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's checkpoint with this rank's own model and method state in it (when the
        checkpoint was written on as many ranks)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        own = self._own_file(checkpoint_path)
        if os.path.isfile(own):
            checkpoint.update(torch.load(own, map_location="cpu", weights_only=False))
        return checkpoint

    def teardown(self) -> None:
        for m in self.methods:
            m.close()
        super().teardown()


__all__ = ["LowcommStrategy", "MPIRanks"]
