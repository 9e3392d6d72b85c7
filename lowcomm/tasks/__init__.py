"""Tasks: the user's problem, as four functions every method trains through one loop.

A task is a Python file or an importable module that defines::

    def model(cfg) -> torch.nn.Module                 # built on every rank from the same seed
    def loss(model, batch) -> torch.Tensor            # a scalar
    def batch(step, rank, world, cfg)                 # rank's batch at step (1-based): a pure
                                                      # function of its arguments (exact resume)
    def eval_batches(cfg)                             # optional: held-out batches, the same on
                                                      # every rank
    def criterion(output, target) -> torch.Tensor     # optional: the loss of the model's output
                                                      # (pipeline parallelism computes it on the
                                                      # last stage)
    def split(batch) -> (inputs, target)              # optional: the model's positional inputs
                                                      # (a tuple) and the target (default: a pair
                                                      # (x, y) is ((x,), y))

``cfg`` is the resolved :class:`~lowcomm.run.config.Config`; the ``[task]`` table's options are in
``cfg.task.options``. A batch is whatever ``loss`` takes (a tensor, a tuple, a dict). Select a
task with ``task = "path/to/task.py"`` or ``task = "package.module"``; the default is the
built-in byte-level LM, :mod:`lowcomm.tasks.bytelm`. :func:`dataset_batches` turns a map-style
``torch.utils.data.Dataset`` into a ``batch`` function.

Example (``my_task.py``)::

    import torch
    from lowcomm.tasks import dataset_batches

    data = torch.utils.data.TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    def model(cfg): return torch.nn.Linear(8, 1)
    def loss(model, batch): x, y = batch; return torch.nn.functional.mse_loss(model(x), y)
    batch = dataset_batches(data)
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import LowcommError
from .dataset import dataset_batches, dataset_eval_batches


class TaskError(LowcommError):
    """A task is missing a function or one of its functions returned the wrong thing; the
    message names the task and the function."""


@dataclass
class Task:
    """A loaded task: its four functions and where they come from (for error messages)."""
    where: str
    model_fn: Callable
    loss_fn: Callable
    batch_fn: Callable
    eval_fn: Callable | None = None
    describe_fn: Callable | None = None    # optional describe(cfg) -> str: a line for the log
    tokens_fn: Callable | None = None      # optional tokens(cfg) -> int: tokens in one sample
    criterion_fn: Callable | None = None   # optional criterion(output, target): the loss of an output
    split_fn: Callable | None = None       # optional split(batch) -> (inputs tuple, target)

    def tokens_per_sample(self, cfg) -> int | None:
        """The tokens in one sample (``tokens(cfg)``), or None where the task does not say."""
        if self.tokens_fn is None:
            return None
        n = self._call("tokens", self.tokens_fn, cfg)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise TaskError(f"{self.where}: tokens(cfg) must return a whole number >= 1, got {n!r}")
        return n

    def model(self, cfg) -> torch.nn.Module:
        m = self._call("model", self.model_fn, cfg)
        if not isinstance(m, torch.nn.Module):
            raise TaskError(f"{self.where}: model(cfg) must return a torch.nn.Module, got "
                            f"{type(m).__name__}")
        if not any(p.requires_grad for p in m.parameters()):
            raise TaskError(f"{self.where}: model(cfg) returned a module with no trainable parameters")
        return m

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        """The task's loss; while gradients are on (training) it must be one that backward can
        go through, i.e. computed from the model's parameters by autograd."""
        value = self._call("loss", self.loss_fn, model, batch)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            got = (f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise TaskError(f"{self.where}: loss(model, batch) must return a floating-point "
                            f"scalar tensor, got {got}")
        if torch.is_grad_enabled() and value.grad_fn is None and not value.requires_grad:
            raise TaskError(f"{self.where}: loss(model, batch) returned a tensor without grad_fn: "
                            "it is not computed from the model's parameters by autograd (detached, "
                            "made under torch.no_grad(), or rebuilt from a number?), so training "
                            "cannot take its gradient")
        return value.reshape(())

    def batch(self, step: int, rank: int, world: int, cfg):
        b = self._call("batch", self.batch_fn, step, rank, world, cfg)
        if b is None:
            raise TaskError(f"{self.where}: batch(step={step}, rank={rank}, world={world}, cfg) "
                            "returned None")
        return b

    def eval_batches(self, cfg):
        """The held-out batches (a list; empty when the task has none)."""
        if self.eval_fn is None:
            return []
        out = self._call("eval_batches", self.eval_fn, cfg)
        try:
            return list(out)
        except TypeError:
            raise TaskError(f"{self.where}: eval_batches(cfg) must return an iterable of batches, "
                            f"got {type(out).__name__}") from None

    def _call(self, name: str, fn: Callable, *args):
        try:
            return fn(*args)
        except (TaskError, LowcommError):
            raise
        except Exception as e:
            raise TaskError(f"{self.where}: {name}() raised {type(e).__name__}: {e}") from e


def from_functions(model: Callable, loss: Callable, batch: Callable,
                   eval_batches: Callable | None = None, name: str = "python task") -> Task:
    """A task from Python callables (the :func:`lowcomm.train` entry point takes these)."""
    for fname, fn in (("model", model), ("loss", loss), ("batch", batch)):
        if not callable(fn):
            raise TaskError(f"{name}: {fname} must be callable, got {type(fn).__name__}")
    if eval_batches is not None and not callable(eval_batches):
        raise TaskError(f"{name}: eval_batches must be callable or None")
    return Task(name, model, loss, batch, eval_batches)


def _module(name: str):
    if name.endswith(".py") or "/" in name or Path(name).is_file():
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {name!r} not found")
        key = f"lowcomm_task_{abs(hash(str(path)))}"
        if key in sys.modules:
            return sys.modules[key], str(path)
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[key]
            raise TaskError(f"task file {name}: importing it raised {type(e).__name__}: {e}") from e
        return module, str(path)
    try:
        return importlib.import_module(name), name
    except ModuleNotFoundError as e:
        raise TaskError(f"task {name!r}: no such file or module ({e})") from e


def load_task(name: str) -> Task:
    """The task in file ``name`` (``*.py`` or a path) or module ``name``; an error names what
    is missing."""
    module, where = _module(name)
    fns = {}
    for fname in ("model", "loss", "batch", "eval_batches", "describe", "tokens", "criterion",
                  "split"):
        fn = getattr(module, fname, None)
        if fn is None and fname in ("model", "loss", "batch"):
            raise TaskError(f"task {where}: defines no function {fname}() (a task defines model(cfg), "
                            "loss(model, batch), batch(step, rank, world, cfg) and optionally "
                            "eval_batches(cfg))")
        if fn is not None and not callable(fn):
            raise TaskError(f"task {where}: {fname} must be a function, got {type(fn).__name__}")
        fns[fname] = fn
    return Task(where, fns["model"], fns["loss"], fns["batch"], fns["eval_batches"], fns["describe"],
                fns["tokens"], fns["criterion"], fns["split"])


__all__ = ["Task", "TaskError", "dataset_batches", "dataset_eval_batches", "from_functions",
           "load_task"]
