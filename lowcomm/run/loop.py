"""The one training loop: every method, on any task, from Python, ``lowcomm train`` and
``lowcomm compare``.

:func:`run` trains a :class:`~lowcomm.tasks.Task` under the strategy that ``build`` makes and
writes ``config.json`` (the resolved config), ``metrics.jsonl`` (one line per logged step) and
``summary.json`` into the output folder from rank 0, and checkpoints into
``<out>/checkpoints`` (see :mod:`lowcomm.run.checkpoint`). Losses and byte counts are over all ranks;
the reductions that gather them run on a separate control communicator whose traffic is not
charged to the method. How the ranks keep step is a :mod:`~lowcomm.run.lockstep` object: every
rank together (:class:`~lowcomm.run.lockstep.Lockstep`), or, for the asynchronous parameter
server's workers, each on its own (:class:`~lowcomm.run.lockstep.Detached`) while its server
ranks serve (:mod:`lowcomm.run.serve`).

Reliability, per step boundary:

* ``checkpoint.every = N``: every N-th step all ranks write a checkpoint holding model,
  optimizer and strategy state (compressor residuals, outer optimizer, …), every RNG state,
  the ledger and the loop's own counters; the task's batches are a pure function of the step,
  so a resumed run replays exactly the batches it would have seen (``state_sha256`` in the
  summary is identical to an uninterrupted run's).
* SIGINT / SIGTERM: every rank finishes the step it is in, a final checkpoint is written, and
  the job exits with status 128 + signal. Ranks agree on the stop through non-blocking
  all-reduces of their stop flags, one started after every step and read
  :data:`~lowcomm.run.lockstep.STOP_VOTE_LAG` steps later (polled once per step meanwhile, which is what moves an
  MPI non-blocking collective along), so a signal that reaches only some ranks stops all of
  them at the same step, at most ``STOP_VOTE_LAG + 1`` steps after it came, and a run without
  signals pays no waiting for it: not even over a WAN, where a vote read one step later cost
  a round trip per step to a method that sends nothing else (no-comm, DiLoCo's inner steps).
* ``on_nonfinite``: a NaN/Inf loss or gradient either ends the job naming the rank, step and
  parameter (``"abort"``, the default; nothing non-finite is ever sent) or is skipped by all
  ranks together (``"skip"``: one 4-byte all-reduce per step to agree; counted in the summary).

Time: ``wall_s`` is measured wall-clock; ``compute_cpu_s`` the CPU seconds of computation in
the steps (:func:`lowcomm.comm.ledger.compute_cpu_clock`: the process's CPU time minus what its
communication calls took, summed step by step; in metrics lines the mean over ranks, in the
summary the largest rank's), which other processes on the machine do not inflate:
``lowcomm compare`` models wall-clock from it.

At the end the strategy's :meth:`~lowcomm.strategies.base.Strategy.finish` leaves one model on
every rank; the summary records its ``state_sha256`` and ``ranks_agree`` (every rank's hash
equal).
"""
from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from typing import Callable

from ..comm.comm import Comm
from ..comm.ledger import compute_cpu_clock
from ..strategies.base import Role
from ..tasks import Task
from .lockstep import STOP_VOTE_LAG, Detached, Lockstep
from .evaluate import nonfinite
from .folder import RunOptions, close_run, open_run
from .schedule import build_optimizer, lr_at, set_lr
from .signals import GraceCheck, StopFlag
from .snapshot import seed_all
from .memory import check_cap, measure
from .state import LoopState, Run

log = logging.getLogger("lowcomm.train")


def run(cfg, task: Task, build: Callable, comm: Comm, opts: RunOptions = RunOptions(),
        coordination: Callable | None = None) -> dict:
    """Train ``task`` under the strategy ``build(model, optimizer, comm, batches=, forward=)``
    makes (``batches``: this rank's training batches as :class:`RecentBatches`, ``forward``: the
    task's loss, for an outer loop's ``bn_recompute``); return (and write) the run summary. ``cfg`` is a resolved :class:`~lowcomm.run.config.Config`.

    ``opts`` (:class:`~lowcomm.run.folder.RunOptions`): ``resume``, the output folder of an
    earlier run of this config: continue from the newest intact checkpoint in its checkpoint
    folder (an error if there is none); ``out`` must not hold another run unless it is the one
    resumed, or ``overwrite`` (see :func:`lowcomm.run.folder.open_run`; ``run_id`` names the run
    there). ``coordination``:
    how the ranks keep step (a function of the :class:`~lowcomm.run.state.Run`; default
    :class:`~lowcomm.run.lockstep.Lockstep`, a fleet's datacenter passes its own)."""
    ctl, out, ckpt = open_run(cfg, comm, opts.out, opts.resume, opts.overwrite, opts.run_id)
    try:
        seed_all(cfg.seed)
        model = build_model(task, cfg)
        recent = RecentBatches(task, cfg, comm.rank, comm.size)
        strategy = build(model, build_optimizer(cfg, model.parameters()), comm, batches=recent,
                         forward=task.loss, criterion=task.criterion_fn, split=task.split_fn)
        r = Run(cfg, task, model, strategy, comm, ctl, out, ckpt, opts.progress, opts.resume)
        with settled_heap():
            if strategy.role is Role.SERVER:               # the parameter server's servers
                from .serve import serve
                return serve(r)
            coord = Detached(r) if strategy.role is Role.WORKER else (coordination or Lockstep)(r)
            recent.rank, recent.world = coord.batch_place()
            return train(r, coord)
    finally:
        close_run(out)


def build_model(task: Task, cfg, device="cpu"):
    """The task's model: on the meta device, each rank to materialise its own part with the
    values a whole build gives, where the run's method builds so
    (:func:`~lowcomm.run.registry.deferred_build`); else whole, on ``device``."""
    from ..parallel.deferred import build_deferred
    from .registry import deferred_build
    key = deferred_build(cfg)
    if key:
        return build_deferred(lambda: task.model(cfg), key, device)
    return task.model(cfg).to(device)


class RecentBatches:
    """This rank's training batches of the steps up to ``t``, newest first (a function of the
    step, as the task's batches are): what an outer loop recomputes BatchNorm's statistics on
    (``bn_recompute``). ``rank``, ``world``: the rank's place among the batches, which the
    coordination sets (a fleet's datacenter places its ranks in the whole fleet)."""

    def __init__(self, task: Task, cfg, rank: int, world: int):
        self.task, self.cfg, self.rank, self.world = task, cfg, rank, world

    def __call__(self, t: int):
        return (self.task.batch(s, self.rank, self.world, self.cfg) for s in range(t, 0, -1))


@contextmanager
def settled_heap():
    """The set-up's garbage collected once and what survives frozen (:func:`gc.freeze`) while
    the steps run, so that the collector's full passes during training scan only what training
    allocated.

    By the end of the set-up (torch, the model, the data) a full pass took 85–105 ms, and one
    ran during a 300-step run on each rank, each at a step of its own: a method that keeps the
    ranks in step then waits for every rank's pause, where ranks that never wait pay only their
    own (measured: streaming DiLoCo over a WAN, 2 ranks of 30 ms steps). Frozen, such a pass
    took 0.3 ms. Objects the caller froze before stay frozen."""
    ours = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def train(r: Run, coord) -> dict:
    """The one step loop, for every method: steps until ``coord`` says the run is over, then
    ``coord.finish`` delivers the model and the summary."""
    state = coord.start()
    grace = GraceCheck(STOP_VOTE_LAG, warn=r.comm.rank == 0)    # mpirun's SIGKILL vs slow steps
    try:
        with StopFlag() as flag:
            for step in coord.steps(state.step + 1):
                take_step(r, coord, state, step)
                coord.after_step(state)
                grace.step_done()
                if coord.checkpoint_due(step):
                    coord.save(step)
                if coord.stop(state, flag):
                    break
            coord.end_steps(flag.signum)
        state.wall_s = coord.wall()
    except BaseException:
        coord.abandon()
        raise
    finally:
        coord.close()
        r.strategy.close()
    return coord.finish(state)


def take_step(r: Run, coord, state: LoopState, step: int) -> None:
    """Step ``step``: forward/backward of this rank's batch, then the method's step — or a skip
    where ``coord`` says so (a non-finite loss or gradient), or a pass where the method says
    this rank does not compute the step (:meth:`~lowcomm.strategies.capabilities.Capabilities.takes_step`)."""
    c0 = compute_cpu_clock()
    if not r.strategy.takes_step():          # dynamic local updates: passed, not computed
        if coord.skip_step(None, step):      # its vote still counts: all skip a non-finite step
            r.strategy.skip()
            state.skipped += 1
        else:
            r.strategy.pass_step()
            state.passed += 1
        state.step = step
        return
    loss, bad = train_step(r, coord, step)
    if coord.skip_step(bad, step):
        r.strategy.skip()
        state.skipped += 1
    else:
        set_lr(r.strategy, lr_at(r.cfg, step))
        r.strategy.step()
        state.window.append(loss.item())
        if not state.memory:                 # the gradients and optimizer state exist now
            state.memory = measure(r.model, r.strategy)
            check_cap(state.memory, r.cfg.max_memory_gib, r.comm.rank, step)
    state.compute_cpu_s += compute_cpu_clock() - c0
    state.step = step
    state.samples += coord.samples_per_step


def train_step(r: Run, coord, step: int):
    """One forward/backward of this rank's batch at ``step``: returns (loss, what is non-finite
    on this rank or None). The strategy's ``step()`` is the caller's."""
    batch = r.task.batch(step, *coord.batch_place(), r.cfg)
    r.strategy.zero_grad()
    loss = r.strategy.forward_backward(r.task.loss, batch, coord.on_loss)
    return loss, nonfinite(loss, r.model) or r.strategy.local_nonfinite()


__all__ = ["STOP_VOTE_LAG", "run", "take_step", "train", "train_step"]
