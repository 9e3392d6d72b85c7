"""Hugging Face ``accelerate`` with any lowcomm method, launched with ``mpirun``.

:class:`Accelerator` is ``accelerate.Accelerator`` for a job where every rank runs the script
and a lowcomm method does the communication (accelerate itself runs one process per rank: no
``torch.distributed``, no DDP wrapper). What it changes, so that a script written for accelerate
runs as it would under ``accelerate launch``:

1. it calls :func:`init` before accelerate reads the environment (without it accelerate reads
   Open MPI's variables and fails: "MASTER_ADDR expected, but not set");
2. ``prepare()`` turns the torch optimizer into the method ``method=`` names (``"syncdp"``,
   ``"diloco:period=50"``, ... with ``compressor=``), built on the model prepared beside it (a
   method built beforehand is taken as it is), and shards the data loaders over the ranks;
3. ``accumulate()`` and ``no_sync()`` keep the method's exchange for the micro-batch that ends
   an optimizer step: the others accumulate local gradients only (DDP's ``no_sync``);
4. ``process_index``, ``num_processes``, ``is_main_process`` and ``is_local_main_process`` are the
   MPI ranks'; ``print``, ``save``, ``save_model`` act on the main rank only; ``gather``,
   ``reduce`` and ``wait_for_everyone`` go over MPI; a scheduler steps once per rank per
   optimizer step, as accelerate's does in a K-process job (unless ``split_batches``);
5. ``clip_grad_norm_``, also under ``mixed_precision="bf16"``, clips the gradients the method
   applies (SyncDP's: the average over the ranks); under ``"fp16"`` (a GPU's GradScaler, not
   tested here: on CPU accelerate makes none) they are unscaled once, before clipping;
6. ``save_state()`` writes accelerate's checkpoint from rank 0 and, from every rank, that rank's
   own model, method state and random generators (``lowcomm-rank<r>-of-<K>.pt``: DiLoCo's local
   models and error feedback differ between ranks); ``load_state()`` resumes each rank from its
   own, exactly;
7. :meth:`Accelerator.finish` (also called by ``end_training()``) ends the methods: the same
   model, buffers included, on every rank.

Example (``launchers/local.sh -n 2 python train.py``)::

    from lowcomm.integrations.accelerate import Accelerator

    accelerator = Accelerator(method="diloco:period=20", gradient_accumulation_steps=2)
    model, opt, data = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), data)
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
    accelerator.finish()                 # every rank holds the same model

The parameter server (its server ranks serve instead of training) and the sharding methods
(zero1, zero2, fsdp) are refused: use :mod:`lowcomm.integrations.transformers` or lowcomm's loop.
"""
from __future__ import annotations

import contextlib
import os

import accelerate
import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import recursively_apply

from ..comm.comm import Comm
from ..comm.ledger import Ledger
from ..errors import LowcommError
from ..run.snapshot import rng_state, set_rng_state
from ..strategies.base import Strategy
from .launcher import LAUNCHER_ENV, init, own_state_file, refuse_unsupported


class _RankScheduler(AcceleratedScheduler):
    """accelerate's scheduler wrapper, stepping once per rank per optimizer step as it does
    in a K-process job (each rank's loader holds 1/K of the data)."""

    ranks = 1

    def step(self, *args, **kwargs):
        every = self.step_with_optimizer and not self.split_batches and \
            self.gradient_state.sync_gradients
        for _ in range(self.ranks if every else 1):
            super().step(*args, **kwargs)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ranks are the MPI job's and whose optimizer is a lowcomm
    method (see the module docstring).

    Args:
        method: the method every plain torch optimizer given to ``prepare()`` becomes, as a
            spec (``"syncdp"``, ``"diloco:period=20"``; :func:`lowcomm.build`); None: give
            ``prepare()`` a method built yourself.
        compressor: the gradient compressor's name (``"int8"``, ``"powersgd"``) or settings.
        comm: the communicator (default: the world).
        args, kwargs: ``accelerate.Accelerator``'s.
    """

    def __init__(self, *args, method: str | None = None, compressor=None,
                 comm: Comm | None = None, **kwargs):
        self.comm = init(comm)
        self.method_spec, self.compressor = method, compressor
        self.methods: list[Strategy] = []
        self._saving = False
        self._ctl = self.comm.dup(Ledger(), "control")        # bookkeeping: not charged
        self._local = self.comm.split_shared()
        super().__init__(*args, **kwargs)
        if self.state.num_processes > 1:
            raise LowcommError("accelerate runs several processes per rank here (its state was "
                               "set up before lowcomm's Accelerator): lowcomm's method does the "
                               "communication; build lowcomm's Accelerator first")

    # ranks --------------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.comm.size

    @property
    def process_index(self) -> int:
        return self.comm.rank

    @property
    def local_process_index(self) -> int:
        return self._local.rank

    @property
    def is_main_process(self) -> bool:
        return self.comm.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self._local.rank == 0

    def print(self, *args, **kwargs):
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self):
        if not self._saving:                 # (rank 0 alone inside save_state)
            self._ctl.barrier()

    def gather(self, tensor):
        """Every rank's tensors concatenated along the first dimension (in rank order)."""
        def one(t):
            g = self._ctl.allgather(t.detach().reshape(1) if t.dim() == 0 else t.detach().contiguous())
            return g.reshape(-1, *g.shape[2:])
        return recursively_apply(one, tensor, error_on_other_type=True)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        """The sum (``"sum"``) or mean (``"mean"``) over the ranks, times ``scale``."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduce: reduction must be 'sum' or 'mean', got {reduction!r}")

        def one(t):
            out = t.detach().clone().contiguous()
            self._ctl.allreduce_(out, "avg" if reduction == "mean" else "sum")
            return out * scale
        return recursively_apply(one, tensor, error_on_other_type=True)

    def save(self, obj, f, safe_serialization=False):
        if self.is_main_process:
            super().save(obj, f, safe_serialization=safe_serialization)

    def save_model(self, model, save_directory, *args, **kwargs):
        if self.is_main_process:
            super().save_model(model, save_directory, *args, **kwargs)

    # methods ------------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """accelerate's ``prepare``, after turning each plain torch optimizer into the method
        (``method=``) on the model among ``args`` that holds its parameters."""
        args = list(args)
        models = [a for a in (*args, *self._models) if isinstance(a, torch.nn.Module)]
        for i, obj in enumerate(args):
            if not isinstance(obj, torch.optim.Optimizer) or isinstance(obj, Strategy):
                continue
            if self.method_spec is None:
                raise LowcommError(
                    f"prepare() was given a plain {type(obj).__name__}: with it every rank would "
                    "train alone; name the method, Accelerator(method=\"syncdp\") (or "
                    "\"diloco:period=...\"), or give prepare() a method built with lowcomm.build()")
            model = self._model_of(obj, models)
            if self.device_placement:
                model.to(self.device)
            from ..run.registry import build
            args[i] = build(self.method_spec, model, obj, self.comm, compressor=self.compressor)
        for obj in args:
            if isinstance(obj, Strategy) and obj not in self.methods:
                try:
                    refuse_unsupported(obj, "lowcomm's Accelerator")
                except LowcommError:
                    obj.close()
                    raise
                self.methods.append(obj)
        return super().prepare(*args, device_placement=device_placement)

    @staticmethod
    def _model_of(optimizer, models) -> torch.nn.Module:
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for m in models:
            if mine <= {id(p) for p in m.parameters()}:
                return m
        raise LowcommError(f"prepare() was given a {type(optimizer).__name__} whose parameters "
                           "belong to no model given to prepare() (in this call or before): "
                           "give prepare() the model beside its optimizer")

    def prepare_scheduler(self, scheduler):
        out = super().prepare_scheduler(scheduler)
        if type(out) is AcceleratedScheduler:
            out.__class__ = _RankScheduler      # (a subclass adding one method, no state)
            out.ranks = self.comm.size
        return out

    @contextlib.contextmanager
    def _local_only(self):
        with contextlib.ExitStack() as stack:
            for m in self.methods:
                stack.enter_context(m.no_sync())
            yield

    @contextlib.contextmanager
    def no_sync(self, model):
        """Backward passes inside accumulate local gradients only: the methods exchange
        nothing until a backward outside (DDP's ``no_sync``)."""
        with super().no_sync(model), self._local_only():
            yield

    @contextlib.contextmanager
    def accumulate(self, *models):
        """accelerate's gradient accumulation: micro-batches that end no optimizer step
        exchange nothing; the one that does exchanges the accumulated gradients once."""
        with super().accumulate(*models):
            if self.sync_gradients:
                yield
            else:
                with self._local_only():
                    yield

    def finish(self) -> None:
        """End every method prepared (all ranks together): the same model on every rank."""
        for m in self.methods:
            if not m.closed:
                m.finish()

    def end_training(self):
        self.finish()
        super().end_training()

    # checkpoints --------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs):
        """accelerate's checkpoint, written by rank 0, and every rank's own model, method state
        and random generators beside it (:func:`~lowcomm.integrations.launcher.own_state_file`).
        Returns the folder."""
        folder = None
        if self.is_main_process:
            self._saving = True
            try:
                folder = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
            finally:
                self._saving = False
        folder, iteration = self._ctl.bcast_object((folder, self.project_configuration.iteration))
        self.project_configuration.iteration = iteration
        torch.save(self._own_state(), own_state_file(folder, self.comm))
        self._ctl.barrier()
        return folder

    def _own_state(self) -> dict:
        rng = rng_state()
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"models": [m.state_dict() for m in self._models],
                "methods": [m.state_dict() for m in self.methods], "rng": rng}

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs):
        """accelerate's checkpoint (schedulers, scaler, samplers, step), then this rank's own
        models, method states and random generators; a checkpoint without this rank's file
        (another rank count) is refused."""
        if input_dir is None:
            raise LowcommError("load_state: give the checkpoint folder save_state() returned "
                               "(input_dir=...)")
        mine = own_state_file(input_dir, self.comm)
        if not os.path.isfile(mine):
            raise LowcommError(f"load_state: rank {self.comm.rank} of {self.comm.size} finds no "
                               f"{os.path.basename(mine)} in {input_dir}: the checkpoint was "
                               "saved by another number of ranks or not by lowcomm's Accelerator")
        wrapped = [o for o in self._optimizers if isinstance(o.optimizer, Strategy)]
        self._optimizers = [o for o in self._optimizers if o not in wrapped]
        try:                    # rank 0's optimizer.bin is another rank's method state: skipped
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            self._optimizers = [*self._optimizers, *wrapped]
        state = torch.load(mine, map_location="cpu", weights_only=False)
        for model, saved in zip(self._models, state["models"]):
            model.load_state_dict(saved)
        for method, saved in zip(self.methods, state["methods"]):
            method.load_state_dict(saved)
        set_rng_state(state["rng"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])


__all__ = ["Accelerator", "LAUNCHER_ENV", "init"]
