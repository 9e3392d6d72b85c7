"""The Hugging Face ``transformers.Trainer`` with any lowcomm method, launched with ``mpirun``.

Under ``mpirun`` every rank runs the user's script; lowcomm's method (an optimizer) does the
communication, so the Trainer must not start ``torch.distributed`` itself — accelerate would,
having read Open MPI's environment (and fail: "MASTER_ADDR expected, but not set"). Two pieces:

* :func:`init`, first (before ``TrainingArguments``): MPI up, and the launcher's world-size and
  rank variables moved out of accelerate's sight (kept in :data:`LAUNCHER_ENV`), so each rank's
  Trainer runs as a single process; with CUDA, each rank takes its node-local GPU.
* :class:`Trainer`, a ``transformers.Trainer`` given ``optimizers=(method, None)``: it shards
  the training data over the ranks (``DistributedSampler``: every rank takes the same number of
  steps), runs gradient accumulation's early micro-batches under the method's ``no_sync()``,
  evaluates each rank on its share of the evaluation set and averages the metrics over the ranks,
  logs and saves from the first training rank only, and ends the method when ``train()`` returns — the same model,
  buffers included, on every rank. The Trainer's own scheduler, gradient clipping, gradient
  accumulation, evaluation and logging work as usual: the method *is* the optimizer.

Example (``launchers/local.sh -n 2 python train.py``)::

    import lowcomm, torch, transformers
    from lowcomm.integrations import transformers as lt

    lt.init()                                          # before TrainingArguments
    args = transformers.TrainingArguments("out", max_steps=100, learning_rate=5e-4,
                                          lr_scheduler_type="cosine", report_to="none")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64))
    method = lowcomm.build("diloco:period=20", model, torch.optim.AdamW(model.parameters()))
    trainer = lt.Trainer(model=model, args=args, train_dataset=data, optimizers=(method, None))
    trainer.train()                                    # every rank ends with the same model

With the parameter server (``async-ps``), server ranks serve inside ``train()`` and the data is
sharded over the workers. A checkpoint the Trainer writes holds, beside the first training rank's
files, every training rank's own model and method state (``lowcomm-rank<r>-of-<K>.pt``: DiLoCo's
local models, error feedback, gossip's models differ between ranks), which
``resume_from_checkpoint`` loads on each rank, so the resume is exact (the parameter server's
server ranks keep no Trainer checkpoint).
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import transformers
from torch.utils.data import DistributedSampler

from ..comm.ledger import Ledger
from ..strategies.base import Role, Strategy
from .launcher import (LAUNCHER_ENV, LAUNCHER_VARS, clips_itself, gathers_model, init,
                       own_state_file, refuse_passing)

class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for a run launched with mpirun whose optimizer is a lowcomm
    method (``optimizers=(method, None)``): see the module docstring for what it adds."""

    def __init__(self, *args, **kwargs):
        method = (kwargs.get("optimizers") or (None, None))[0]
        if not isinstance(method, Strategy):
            raise TypeError("lowcomm's Trainer takes optimizers=(a lowcomm method, None), e.g. "
                            "lowcomm.build(\"syncdp\", model, torch.optim.AdamW(...)); got "
                            f"{type(method).__name__}")
        refuse_passing(method, "the Trainer")
        init(method.comm)
        self.method, self.comm = method, method.comm
        self._gathered = None          # a sharded model's whole state while rank 0 writes it
        self.is_server = method.role is Role.SERVER
        # the ranks that train (all, or the parameter server's workers), for data and metrics
        ctl = self.comm.dup(Ledger(), "control")        # metrics and bookkeeping: not charged
        self._trainers = ctl.split(1 if self.is_server else 0) if method.role is not Role.PLAIN \
            else ctl
        super().__init__(*args, **kwargs)
        if not self._first:
            for cb in list(self.callback_handler.callbacks):
                if isinstance(cb, (transformers.trainer_callback.ProgressCallback,
                                   transformers.trainer_callback.PrinterCallback)) or \
                        type(cb).__module__.startswith("transformers.integrations"):
                    self.remove_callback(cb)

    @property
    def _first(self) -> bool:
        """This rank logs and writes: the first rank that trains."""
        return not self.is_server and self._trainers.rank == 0

    # data ---------------------------------------------------------------------------------------
    def _sampler(self, dataset, shuffle: bool):
        if dataset is None or not hasattr(dataset, "__len__"):
            return None
        t = self._trainers
        return DistributedSampler(dataset, num_replicas=t.size, rank=t.rank, shuffle=shuffle,
                                  seed=self.args.seed, drop_last=self.args.dataloader_drop_last)

    def _get_train_sampler(self, train_dataset=None):
        return self._sampler(train_dataset if train_dataset is not None else self.train_dataset, True)

    def _get_eval_sampler(self, eval_dataset):
        return self._sampler(eval_dataset, False)

    # training ---------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Early micro-batches of gradient accumulation exchange nothing (the method's
        ``no_sync()``); the last one's backward exchanges the sum."""
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.method.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        """A method that shards the gradients (zero1, zero2) clips by its own global norm."""
        if clips_itself(self.method):
            return self.method.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and clips_itself(self.method):
            grad_norm = self.method.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def train(self, *args, **kwargs):
        """Train, then end the method: every rank holds the same model (parameters and
        buffers). Server ranks of the parameter server serve until the workers are done."""
        if self.is_server:
            self.method.serve()
            self.method.finish()
            return transformers.trainer_utils.TrainOutput(0, float("nan"), {})
        out = super().train(*args, **kwargs)
        self.method.finish()
        return out

    # evaluation -------------------------------------------------------------------------------
    def evaluation_loop(self, *args, **kwargs):
        """Each training rank evaluates its share; numeric metrics are averaged over them."""
        out = super().evaluation_loop(*args, **kwargs)
        keys = sorted(k for k, v in out.metrics.items()
                      if isinstance(v, (int, float)) and math.isfinite(v))
        if self._trainers.size > 1 and keys:
            total = torch.tensor([float(out.metrics[k]) for k in keys], dtype=torch.float64)
            self._trainers.allreduce_(total, "avg")
            out.metrics.update({k: float(v) for k, v in zip(keys, total.tolist())})
        return out

    # saving -------------------------------------------------------------------------------------
    def _own_state(self, checkpoint: str) -> str:
        return own_state_file(checkpoint, self.comm)

    @contextlib.contextmanager
    def _whole_model(self):
        """Where the method shards the model (fsdp), its whole state dict gathered by every
        rank together, for rank 0's :meth:`_save` to write inside; else nothing to do."""
        own = not self.method.closed and gathers_model(self.method)
        self._gathered = self.method.full_model_state_dict() if own else None
        try:
            yield
        finally:
            self._gathered = None

    def _save(self, output_dir=None, state_dict=None):
        return super()._save(output_dir, self._gathered if state_dict is None else state_dict)

    def _save_checkpoint(self, model, trial):
        """Rank 0 writes the Trainer's checkpoint (the whole model: a sharded one is gathered
        by every rank first); every training rank adds its own model and method state (they
        differ between ranks under DiLoCo, gossip, error feedback; fsdp's are its shards)."""
        with self._whole_model():
            if self._first:
                super()._save_checkpoint(model, trial)
        s = self._trainers.bcast_object((self.state.best_metric, self.state.best_model_checkpoint,
                                         self.state.best_global_step))
        self.state.best_metric, self.state.best_model_checkpoint, self.state.best_global_step = s
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if os.path.isdir(folder):            # (save_strategy "best" may write none)
            torch.save({"model": self.method.model_state_dict(),
                        "method": self.method.state_dict()},
                       self._own_state(folder))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """A sharded model (fsdp) takes its shards from this rank's own file (in
        :meth:`_load_optimizer_and_scheduler`), not the whole model rank 0 wrote."""
        if self.method.shards_model and model is None and \
                os.path.isfile(self._own_state(resume_from_checkpoint)):
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Each rank resumes from its own model and method state (rank 0's optimizer.pt would
        be another rank's method state: refused where it differs between ranks)."""
        mine = self._own_state(checkpoint) if checkpoint else None
        if mine is None or not os.path.isfile(mine):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = torch.load(mine, map_location="cpu", weights_only=True)
        self.method.load_model_state_dict(state["model"])
        self.method.load_state_dict(state["method"])
        sched = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Rank 0 writes the model (every rank holds the same one after ``train()``; a model
        still sharded, fsdp's before ``train()`` ends, is gathered by every rank first)."""
        if _internal_call:                   # inside rank 0's checkpoint: gathered already
            return super().save_model(output_dir, _internal_call)
        with self._whole_model():
            if self._first:
                super().save_model(output_dir, _internal_call)


__all__ = ["LAUNCHER_ENV", "LAUNCHER_VARS", "Trainer", "init"]
