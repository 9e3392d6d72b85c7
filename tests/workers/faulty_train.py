"""``lowcomm train`` with one injected fault: ``LOWCOMM_FAULT=kind:rank:step``.

``LOWCOMM_FAULT_ONCE=FILE`` makes it happen once over relaunches (a supervised run).
kinds: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself), ``term`` (SIGTERM itself, only that
rank), ``nan-loss`` (the loss is NaN), ``nan-grad`` (one parameter's gradient is Inf while the
loss stays finite). The fault happens in the forward pass of ``step`` on ``rank``; everything
else is the real CLI, so what the test sees is what a user would see.
"""
import os
import signal

import torch

from lowcomm.tasks import Task
from lowcomm.cli.main import launcher_rank, main

kind, fault_rank, fault_step = os.environ["LOWCOMM_FAULT"].split(":")
fault_rank, fault_step = int(fault_rank), int(fault_step)
real_loss, real_batch, calls = Task.loss, Task.batch, [0]


def _already() -> bool:
    """``LOWCOMM_FAULT_ONCE=FILE``: the fault happens once over relaunches (the file marks it)."""
    marker = os.environ.get("LOWCOMM_FAULT_ONCE")
    if not marker:
        return False
    if os.path.exists(marker):
        return True
    open(marker, "w").close()
    return False


def loss(self, model, batch):
    """The task's loss, with the fault at ``fault_step`` on ``fault_rank``."""
    out = real_loss(self, model, batch)
    if launcher_rank() != fault_rank or not model.training:
        return out
    calls[0] += 1
    if calls[0] == fault_step and not _already():
        if kind in ("kill", "stop", "term"):
            os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP,
                                  "term": signal.SIGTERM}[kind])
        elif kind == "nan-loss":
            out = out * float("nan")
        elif kind == "nan-grad":
            p = next(model.parameters())
            p.register_hook(lambda g: torch.full_like(g, float("inf")) if calls[0] == fault_step else g)
    return out


def batch(self, step, rank, world, cfg):
    """The task's batch; with ``LOWCOMM_FAULT_AT=batch`` a ``kill`` happens when ``fault_rank``
    draws the batch of ``fault_step`` (a pipeline computes its loss in its schedule, not through
    the task's loss)."""
    if os.environ.get("LOWCOMM_FAULT_AT") == "batch" and kind == "kill" and \
            launcher_rank() == fault_rank and step == fault_step and not _already():
        os.kill(os.getpid(), signal.SIGKILL)
    return real_batch(self, step, rank, world, cfg)


Task.loss = loss        # every task's loss, as the loop calls it
Task.batch = batch
main()
