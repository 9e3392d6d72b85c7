"""The one training loop: every method, on any task, from Python, ``lowcomm train`` and
``lowcomm compare``.

:func:`run` trains a :class:`~lowcomm.tasks.Task` under the strategy that ``build`` makes and
writes ``config.json`` (the resolved config), ``metrics.jsonl`` (one line per logged step) and
``summary.json`` into the output folder from rank 0, and checkpoints into
``<out>/checkpoints`` (see :mod:`lowcomm.run.checkpoint`). Losses and byte counts are over all ranks;
the reductions that gather them run on a separate control communicator whose traffic is not
charged to the method. The asynchronous parameter server's server ranks serve from inside it
(:mod:`lowcomm.run.ps` keeps their bookkeeping), its workers take the same steps as
every other method's ranks.

Reliability, per step boundary:

* ``checkpoint.every = N``: every N-th step all ranks write a checkpoint holding model,
  optimizer and strategy state (compressor residuals, outer optimizer, …), every RNG state,
  the ledger and the loop's own counters; the task's batches are a pure function of the step,
  so a resumed run replays exactly the batches it would have seen (``params_sha256`` in the
  summary is identical to an uninterrupted run's).
* SIGINT / SIGTERM: every rank finishes the step it is in, a final checkpoint is written, and
  the job exits with status 128 + signal. Ranks agree on the stop through non-blocking
  all-reduces of their stop flags, one started after every step and read
  :data:`STOP_VOTE_LAG` steps later (polled once per step meanwhile, which is what moves an
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
every rank; the summary records its ``params_sha256`` and ``ranks_agree`` (every rank's hash
equal).
"""
from __future__ import annotations

import json
import logging
import signal
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from ..comm.comm import Comm
from ..errors import NonFiniteError
from ..errors import LowcommError
from ..comm.ledger import compute_cpu_clock
from .evaluate import allsum, evaluate, nonfinite, params_sha256
from .folder import close_run, open_run, write_text
from .schedule import build_optimizer, lr_at, set_lr
from .signals import Interrupted, StopFlag
from .snapshot import restore, seed_all, snapshot
from ..tasks import Task

log = logging.getLogger("lowcomm.train")


def agree(ctl: Comm, model: torch.nn.Module) -> tuple[str, bool]:
    """This rank's ``params_sha256`` and whether every rank's is the same."""
    digest = params_sha256(model)
    return digest, len(set(ctl.allgather_object(digest))) == 1


def run(cfg, task: Task, build: Callable, comm: Comm, out: str | Path | None = None,
        progress: bool = True, resume: str | Path | None = None, overwrite: bool = False,
        run_id: str | None = None) -> dict:
    """Train ``task`` under the strategy ``build(model, optimizer, comm)`` makes; return (and
    write) the run summary. ``cfg`` is a resolved :class:`~lowcomm.run.config.Config`.

    ``resume``: the output folder of an earlier run of this config; continue from the newest
    intact checkpoint in its checkpoint folder (an error if there is none). ``out`` must not
    hold another run unless it is the one resumed, or ``overwrite`` (see
    :func:`lowcomm.run.folder.open_run`; ``run_id`` names the run there)."""
    ctl, out, ckpt = open_run(cfg, comm, out, resume, overwrite, run_id)
    try:
        return _run(cfg, task, build, comm, ctl, out, ckpt, progress, resume)
    finally:
        close_run(out)


def _run(cfg, task: Task, build: Callable, comm: Comm, ctl: Comm, out: Path | None, ckpt,
         progress: bool, resume: str | Path | None) -> dict:
    rank, K = comm.rank, comm.size
    seed_all(cfg.seed)
    model = task.model(cfg)
    optimizer = build_optimizer(cfg, model.parameters())
    strategy = build(model, optimizer, comm)
    if getattr(strategy, "is_server", None) is not None:   # the parameter server
        from .ps import run_async_ps
        return run_async_ps(cfg, task, model, strategy, comm, ctl, out, ckpt, progress, resume)
    if rank == 0 and task.describe_fn is not None:
        log.info("data: %s", task.describe_fn(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    held_out = task.eval_batches(cfg) if cfg.eval_batches else []

    first, skipped, wall_before, window, recent = 1, 0, 0.0, [], float("nan")
    resizes, samples_before = [], 0        # rank-count changes at a resume; samples before it
    compute = [0.0]                  # CPU seconds of computation in the steps (compute_cpu_clock)
    if resume:
        step, loop = restore(resume, cfg, comm, ctl, model, strategy, out)
        skipped, wall_before, window, recent = loop["skipped"], loop["wall_s"], loop["window"], loop["recent"]
        resizes = loop.get("resizes", [])
        samples_before = loop.get("samples", step * cfg.batch_size * (resizes[-1]["from"] if resizes else K))
        compute[0] = loop.get("compute_cpu_s", float("nan"))   # nan: a checkpoint from before it
        first = step + 1

    def save(step: int) -> Path:
        loop = {"skipped": skipped, "wall_s": wall_before + time.perf_counter() - t0,
                "window": list(window), "recent": recent, "resizes": resizes,
                "samples": samples_before + (step - first + 1) * cfg.batch_size * K,
                "compute_cpu_s": compute[0]}
        return ckpt.save(step, snapshot(model, strategy, comm, loop), cfg.to_dict())

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=first - 1, desc=cfg.method, unit="step",
                   dynamic_ncols=True, mininterval=1.0)
    metrics = open(out / "metrics.jsonl", "a" if resume else "w") if out and rank == 0 else None
    ctl.barrier()
    t0 = time.perf_counter()
    votes: deque = deque()           # (step to read it at, flags, request): the stop votes in flight
    try:
        with StopFlag() as stop:
            for step in range(first, cfg.steps + 1):
                c0 = compute_cpu_clock()
                loss, bad = train_step(cfg, task, model, strategy, step, rank, K)
                if cfg.on_nonfinite == "skip":
                    if allsum(ctl, [1.0 if bad else 0.0])[0] > 0:
                        if bad:
                            log.warning("rank %d step %d: %s is not finite; all ranks skip the step",
                                        rank, step, bad)
                        strategy.skip()
                        skipped += 1
                        bad = "skipped"
                elif bad:
                    raise NonFiniteError(rank, bad, step)
                if bad != "skipped":
                    set_lr(optimizer, lr_at(cfg, step))
                    strategy.step()
                    window.append(loss.item())
                compute[0] += compute_cpu_clock() - c0
                if step % cfg.log_every == 0 or step == cfg.steps:
                    tot = comm.ledger.totals()
                    loss_sum, n, sent, comm_s, rounds, cpu = allsum(ctl, [
                        sum(window), len(window), tot["bytes_sent"], tot["seconds"], comm.ledger.rounds(K),
                        compute[0]])
                    recent = loss_sum / n if n else float("nan")
                    window = []
                    line = {"step": step, "loss": recent, "bytes": int(sent),
                            "wall_s": wall_before + time.perf_counter() - t0,
                            "comm_s": comm_s / K, "rounds": rounds / K, "compute_cpu_s": cpu / K,
                            "lr": optimizer.param_groups[0]["lr"]}
                    line.update(strategy.metrics(ctl))
                    if held_out and cfg.eval_every and step % cfg.eval_every == 0:
                        line["eval_loss"] = evaluate(model, task, held_out, ctl)
                    if metrics:
                        _append(metrics, json.dumps(line) + "\n")
                    if bar:
                        bar.set_postfix(loss=f"{recent:.3f}", MB=f"{sent / 1e6:.1f}")
                if bar:
                    bar.update(1)
                if ckpt and cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.steps:
                    save(step)
                for _, _, request in votes:   # a poll moves each vote on (MPI progresses in calls)
                    request.test()
                if votes and votes[0][0] == step:   # started STOP_VOTE_LAG steps ago: done by now
                    _, flags, request = votes.popleft()
                    request.wait()
                    if flags.item() > 0:
                        signum = stop.signum or signal.SIGTERM   # ranks the signal missed
                        raise Interrupted(signum, step, save(step) if ckpt else None)
                flags = torch.tensor([1 if stop.signum else 0], dtype=torch.int32)
                votes.append((step + STOP_VOTE_LAG, flags, ctl.iallreduce_(flags) if K > 1 else _Done()))
            for _, _, request in votes:
                request.wait()
        wall = wall_before + time.perf_counter() - t0
    except BaseException:
        _ABANDONED.extend(votes)    # MPI may still write into their buffers: never free them
        raise
    finally:
        if bar:
            bar.close()
        if metrics:
            metrics.close()
        strategy.close()
    extra = strategy.metrics(ctl, final=True)
    strategy.finish()
    eval_loss = evaluate(model, task, held_out, ctl) if held_out else float("nan")
    levels = sorted(set().union(*ctl.allgather_object(list(comm.ledger.by_level()))))
    per_level = allsum(ctl, [comm.ledger.by_level().get(lv, 0) for lv in levels])
    digest, same = agree(ctl, model)
    summary = {
        "method": cfg.method, "task": task.where, "ranks": K, "steps": cfg.steps, "params": n_params,
        "final_loss": recent, "eval_loss": eval_loss,
        "bytes_total": int(sum(per_level)), "bytes_by_level": {lv: int(b) for lv, b in zip(levels, per_level)},
        "bytes_per_step_per_rank": sum(per_level) / K / cfg.steps,
        "wall_s": max(ctl.allgather_object(wall)),
        "compute_cpu_s": max(ctl.allgather_object(compute[0])),
        "samples": samples_before + (cfg.steps - first + 1) * cfg.batch_size * K,
        "resizes": resizes,             # [{"step", "from", "to"}]: resumed on another rank count
        "skipped_steps": skipped,
        **extra,
        "params_sha256": digest,
        "ranks_agree": same,
        "ledger_rank0": comm.ledger.rows(),
        "config": cfg.to_dict(),
    }
    if out and rank == 0:
        write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _append(f, line: str) -> None:
    """Append a metrics line; a full disk is an error naming the file."""
    try:
        f.write(line)
        f.flush()
    except OSError as e:
        raise LowcommError(f"cannot write {f.name}: {e.strerror or e}") from e


def train_step(cfg, task: Task, model, strategy, step: int, rank: int, world: int):
    """One forward/backward of ``rank``'s batch at ``step``: returns (loss, what is non-finite
    on this rank or None). The strategy's ``step()`` is the caller's."""
    batch = task.batch(step, rank, world, cfg)
    strategy.zero_grad()
    loss = task.loss(model, batch)
    loss.backward()
    return loss, nonfinite(loss, model)


#: steps between starting a stop vote and reading it: an all-reduce of 4 ranks takes 2 rounds,
#: each moved on by one poll per step, so over a link whose round trip is longer than a step a
#: vote read one step later blocked (measured: 25 ms / 100 Mbit/s, 4 ranks, no-comm run)
STOP_VOTE_LAG = 4

#: stop votes still in flight when a run raised (a crash, an injected fault, a user's error in
#: ``loss``): freeing their buffer while MPI may still write into it would corrupt the heap
_ABANDONED: list = []


class _Done:
    """A completed request (one rank: nothing to agree with)."""

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True
