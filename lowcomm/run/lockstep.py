"""How the ranks of a run keep step with each other around the one step loop
(:func:`lowcomm.run.loop.train`): where a rank's batches come from, how a non-finite step is
skipped, when to log, evaluate, checkpoint and stop, and how the run ends.

* :class:`Lockstep` — every rank takes every step together (every method but the parameter
  server's workers): losses, bytes and evaluations are reduced over the ranks on the uncharged
  control communicator (a metrics line's sums by a non-blocking all-reduce, written
  :data:`METRICS_LAG` steps later, so that logging never makes the ranks wait for each other),
  a skip or a stop is agreed by every rank, rank 0 writes the metrics and the summary.
* :class:`Detached` — a parameter-server worker: its own batches (worker index of W workers),
  its own skips, steps until a server says the budget is spent or a signal came; the servers
  log (:mod:`lowcomm.run.serve`), and at the end it reports to rank 0 and takes the run's model.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import time
from collections import deque

import torch

from ..comm.ledger import Link
from .memory import peak_bytes
from ..errors import ConfigError, LowcommError, NonFiniteError
from ..settings import NonFinite
from .ending import report_to_rank0, skip_mpi_finalize, stopped, take_final_model
from .evaluate import allsum, evaluate, evaluation_sums, mean_loss, state_sha256
from .folder import write_summary
from .signals import Interrupted
from .snapshot import restore, snapshot
from .state import LoopState, Run

log = logging.getLogger("lowcomm.train")

#: steps between starting a stop vote and reading it: an all-reduce of 4 ranks takes 2 rounds,
#: each moved on by one poll per step, so over a link whose round trip is longer than a step a
#: vote read one step later blocked (measured: 25 ms / 100 Mbit/s, 4 ranks, no-comm run)
STOP_VOTE_LAG = 4

#: steps between starting a metrics line's all-reduce and writing the line: read at once, it
#: made every rank wait for the slowest and a round trip each ``log_every`` steps (measured: 25
#: ms / 100 Mbit/s, 2 datacenters × 1 rank, 0.8 s of a 10 s run of streaming DiLoCo)
METRICS_LAG = STOP_VOTE_LAG

#: stop votes and metrics lines still in flight when a run raised (a crash, an injected fault, a user's error in
#: ``loss``): freeing their buffer while MPI may still write into it would corrupt the heap
_ABANDONED: list = []


class Coordination:
    """What every kind shares — the loop's ranks (:class:`Lockstep`, :class:`Detached`) and the
    parameter server's servers (:class:`lowcomm.run.serve.Serving`): the loop's counters, the
    resume, the clock, the checkpoints, and rank 0's progress bar and metrics file."""

    def __init__(self, r: Run):
        self.r = r
        self.state = LoopState()
        self.wall_before = 0.0
        self.t0 = time.perf_counter()
        self.bar = self.metrics = None

    def start(self) -> LoopState:
        """A fresh state, or the resumed run's; then every rank starts the clock together."""
        r = self.r
        if r.cfg.checkpoint.format == "dcp" and r.ckpt is not None:
            r.strategy.distributed_model_state()      # a method that keeps none says so now
        if r.resume:
            step, loop = restore(r.resume, r.cfg, r.comm, r.ctl, r.model, r.strategy, r.out)
            self.wall_before = self.resumed(step, loop)
        r.ctl.barrier()
        self.t0 = time.perf_counter()
        return self.state

    def resumed(self, step: int, loop: dict) -> float:
        """Take the loop's counters the checkpoint at ``step`` saved; return the wall-clock
        seconds the run had taken before."""
        self.state = LoopState.from_dict(loop, step)
        return self.state.wall_s

    def batch_place(self) -> tuple[int, int]:
        """This rank's place among the step's batches: (index, count)."""
        return self.rank, self.world

    def on_loss(self, loss: torch.Tensor) -> None:
        """Called with this rank's loss before its backward pass (nothing by default)."""

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.t0

    def loop_state(self) -> dict:
        """The loop's counters a checkpoint saves, the clock brought up to now."""
        self.state.wall_s = self.wall()
        return self.state.to_dict()

    def save(self, step: int):
        """Write this rank's checkpoint at ``step`` (collective); returns its folder."""
        r = self.r
        dcp = r.cfg.checkpoint.format == "dcp"
        return r.ckpt.save(step, snapshot(r.model, r.strategy, r.comm, self.loop_state(),
                                          with_model=not dcp), r.cfg.to_dict(),
                           r.strategy.distributed_model_state() if dcp else None)

    def open_log(self, initial: int) -> None:
        """Rank 0: the progress bar (from step ``initial``) and ``metrics.jsonl`` (appended to
        when resumed)."""
        r = self.r
        if r.comm.rank != 0:
            return
        if r.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=r.cfg.steps, initial=initial, desc=r.cfg.method, unit="step",
                            dynamic_ncols=True, mininterval=1.0)
        if r.out:
            self.metrics = open(r.out / "metrics.jsonl", "a" if r.resume else "w")

    def write_metrics(self, line: dict) -> None:
        """Rank 0: append a metrics line; a full disk is an error naming the file."""
        if self.metrics:
            _append(self.metrics, json.dumps(line) + "\n")

    def abandon(self) -> None:
        """The run raised: keep whatever MPI may still write into."""

    def close(self) -> None:
        """Close the progress bar and the metrics file (whose last flush may meet a full disk:
        an error naming the file, as every metrics write)."""
        if self.bar:
            self.bar.close()
        if self.metrics:
            f, self.metrics = self.metrics, None
            try:
                f.close()
            except OSError as e:
                raise LowcommError(f"cannot write {f.name}: {e.strerror or e}") from e


class Lockstep(Coordination):
    """Every rank takes every step together (see the module docstring)."""

    def __init__(self, r: Run):
        super().__init__(r)
        self.rank, self.world = r.comm.rank, r.comm.size
        self.samples_per_step = r.cfg.batch_size * self.batch_place()[1]
        self.votes: deque = deque()          # (step to read it at, flags, request)
        self.lines: deque = deque()          # (step to write it at, sums, request, line)
        self.budget = Budget(r) if r.cfg.budget.seconds else None

    def batch_place(self) -> tuple[int, int]:
        """The method's (the stages of one pipeline share one batch)."""
        return self.r.strategy.batch_place()

    def start(self) -> LoopState:
        r = self.r
        if r.comm.rank == 0 and r.task.describe_fn is not None:
            log.info("data: %s", r.task.describe_fn(r.cfg))
        state = super().start()
        if self.budget:
            self.budget.start(state)
        self.open_log(state.step)
        return state

    def steps(self, first: int):
        """Up to ``steps``, or until the time budget is spent."""
        step = first
        while step <= self.r.cfg.steps and not (self.budget and self.budget.spent):
            yield step
            step += 1

    def skip_step(self, bad: str | None, step: int) -> bool:
        """``on_nonfinite = "skip"``: every rank skips when any rank's step is not finite (a
        4-byte vote per step); else a non-finite value ends the job naming rank and step."""
        r = self.r
        if r.cfg.on_nonfinite is not NonFinite.SKIP:
            if bad:
                raise NonFiniteError(self.rank, bad, step)
            return False
        if allsum(r.ctl, [1.0 if bad else 0.0])[0] == 0:
            return False
        if bad:
            log.warning("rank %d step %d: %s is not finite; all ranks skip the step", self.rank, step, bad)
        return True

    def after_step(self, state: LoopState) -> None:
        cfg, step = self.r.cfg, state.step
        mark = self.budget.advance(state) if self.budget else False
        self._write_lines(state, due=step)
        if mark or step % cfg.log_every == 0 or step == cfg.steps:
            self._log(state, at_mark=mark)
        if self.bar:
            self.bar.update(1)

    def _log(self, state: LoopState, at_mark: bool = False) -> None:
        """Start one metrics line: losses, bytes, seconds and rounds — and every ``eval_every``
        steps and ``at_mark`` of a time budget the held-out loss of each rank's share of the
        eval batches — summed over every rank by a non-blocking all-reduce that
        :meth:`_write_lines` completes :data:`METRICS_LAG` steps later (the strategy's fields are
        taken now)."""
        r = self.r
        tot = r.comm.ledger.totals()
        evaluating = bool(r.held_out) and bool(at_mark or r.cfg.eval_every and
                                               state.step % r.cfg.eval_every == 0)
        held_out = evaluation_sums(r.model, r.task, r.held_out, r.ctl,
                                   r.strategy.collective_forward,
                                   lambda b: r.strategy.evaluate(r.task.loss, b)) \
            if evaluating else [0.0, 0.0]
        sums = torch.tensor([sum(state.window), len(state.window), tot["bytes_sent"],
                             tot["seconds"], r.comm.ledger.rounds(self.world),
                             state.compute_cpu_s, *held_out], dtype=torch.float64)
        state.window = []
        line = {"step": state.step, "wall_s": self.wall(), "lr": r.strategy.param_groups[0]["lr"]}
        if self.budget:
            line["modelled_s"] = self.budget.spent_s
        line.update(r.strategy.metrics(r.ctl))
        line.update(self.line_extra())
        request = r.ctl.iallreduce_(sums) if self.world > 1 else _Done()
        self.lines.append((state.step + METRICS_LAG, sums, request, line))

    def _write_lines(self, state: LoopState, due: float = float("inf")) -> None:
        """Write every pending metrics line due by step ``due`` (all of them by default), in
        order; the others' all-reduces are moved on (MPI progresses in calls)."""
        while self.lines and self.lines[0][0] <= due:
            _, sums, request, line = self.lines.popleft()
            request.wait()
            self._write_line(state, sums.tolist(), line)
        for _, _, request, _ in self.lines:
            request.test()

    def _write_line(self, state: LoopState, sums: list[float], line: dict) -> None:
        K = self.world
        loss_sum, n, sent, comm_s, rounds, cpu, eval_sum, eval_n = sums
        state.recent = loss_sum / n if n else float("nan")
        line = {"step": line["step"], "loss": state.recent, "bytes": int(sent),
                "wall_s": line["wall_s"], "comm_s": comm_s / K, "rounds": rounds / K,
                "compute_cpu_s": cpu / K, **{k: v for k, v in line.items() if k not in ("step", "wall_s")}}
        if eval_n:                                   # an evaluation's line (its batches, counted)
            line["eval_loss"] = mean_loss(eval_sum, eval_n)
        self.write_metrics(line)
        if self.bar:
            self.bar.set_postfix(loss=f"{state.recent:.3f}", MB=f"{sent / 1e6:.1f}")

    def line_extra(self) -> dict:
        """Fields a kind of coordination adds to each metrics line (none here)."""
        return {}

    def summary_extra(self) -> dict:
        """Fields a kind of coordination adds to the summary (none here)."""
        return {}

    def checkpoint_due(self, step: int) -> bool:
        cfg = self.r.cfg
        return bool(self.r.ckpt and cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                    and step < cfg.steps)

    def stop(self, state: LoopState, flag) -> bool:
        """Start this step's stop vote, read the one started :data:`STOP_VOTE_LAG` steps ago;
        a stop writes a checkpoint on every rank and raises :class:`Interrupted`."""
        step = state.step
        for _, _, request in self.votes:      # a poll moves each vote on (MPI progresses in calls)
            request.test()
        if self.votes and self.votes[0][0] == step:
            _, flags, request = self.votes.popleft()
            request.wait()
            if flags.item() > 0:
                signum = flag.signum or signal.SIGTERM   # ranks the signal missed
                self._write_lines(state)
                raise Interrupted(signum, step, self.save(step) if self.r.ckpt else None)
        flags = torch.tensor([1 if flag.signum else 0], dtype=torch.int32)
        self.votes.append((step + STOP_VOTE_LAG, flags,
                           self.r.ctl.iallreduce_(flags) if self.world > 1 else _Done()))
        return False

    def end_steps(self, signum: int) -> None:
        for _, _, request in self.votes:
            request.wait()
        self._write_lines(self.state)

    def save(self, step: int):
        """A checkpoint comes after every metrics line up to its step (a resumed run appends
        the lines after it)."""
        self._write_lines(self.state)
        return super().save(step)

    def abandon(self) -> None:
        _ABANDONED.extend(self.votes)         # MPI may still write into their buffers
        _ABANDONED.extend(self.lines)

    def finish(self, state: LoopState) -> dict:
        """Deliver one model on every rank and write the summary (rank 0)."""
        r = self.r
        wall = self.wall()
        extra = r.strategy.metrics(r.ctl, final=True)
        r.strategy.finish()
        eval_loss = evaluate(r.model, r.task, r.held_out, r.ctl) if r.held_out else float("nan")
        by_level = r.comm.ledger.by_level()
        digest = state_sha256(r.model)
        mem = dict(state.memory, peak_bytes=peak_bytes(r.model)[0]) if state.memory else {}
        every = r.ctl.allgather_object((by_level, wall, state.compute_cpu_s, digest, mem))   # one gather
        levels = sorted(set().union(*[b for b, _, _, _, _ in every]))
        per_level = [sum(b.get(lv, 0) for b, _, _, _, _ in every) for lv in levels]
        return write_summary(r, {
            "final_loss": state.recent, "eval_loss": eval_loss,
            "bytes_total": int(sum(per_level)),
            "bytes_by_level": {lv: int(b) for lv, b in zip(levels, per_level)},
            "bytes_per_step_per_rank": sum(per_level) / self.world / max(state.step, 1),
            "steps_done": state.step,
            **({"budget": self.budget.summary()} if self.budget else {}),
            "wall_s": max(w for _, w, _, _, _ in every),
            "compute_cpu_s": max(c for _, _, c, _, _ in every),
            "samples": state.samples, "resizes": state.resizes, "skipped_steps": state.skipped,
            "passed_steps": state.passed,
            **extra, **self.summary_extra(),
            "state_sha256": digest,
            "ranks_agree": len({d for _, _, _, d, _ in every}) == 1,
            "memory_by_rank": [m for *_, m in every],
            "ledger_rank0": r.comm.ledger.rows()}, write=r.comm.rank == 0)


class Detached(Coordination):
    """A parameter-server worker (see the module docstring)."""

    def __init__(self, r: Run):
        super().__init__(r)
        if r.cfg.budget.seconds:
            raise ConfigError("budget.seconds", "the parameter server's workers keep no common "
                              "clock to spend a time budget on; give it steps")
        ps = r.strategy
        self.rank, self.world = ps.index, ps.workers        # batches: worker w of W
        self.samples_per_step = r.cfg.batch_size
        self.signum = 0

    def steps(self, first: int):
        return itertools.count(first)              # until a server says the budget is spent

    def on_loss(self, loss: torch.Tensor) -> None:
        """The servers log the loss of every gradient; a non-finite loss with nothing to skip
        ends the job before its gradient could be pushed from inside the backward pass."""
        value = loss.item()
        self.r.strategy.note_loss(value)
        if value != value or value in (float("inf"), float("-inf")):
            if self.r.cfg.on_nonfinite is not NonFinite.SKIP:
                raise NonFiniteError(self.r.comm.rank, "the loss", self.state.step + 1)

    def skip_step(self, bad: str | None, step: int) -> bool:
        """This worker alone skips (its clock advances without a gradient)."""
        if not bad:
            return False
        if self.r.cfg.on_nonfinite is not NonFinite.SKIP:
            raise NonFiniteError(self.r.comm.rank, bad, step)
        log.warning("rank %d step %d: %s is not finite; this worker skips the step",
                    self.r.comm.rank, step, bad)
        return True

    def after_step(self, state: LoopState) -> None:
        """Nothing: the servers log every gradient."""

    def checkpoint_due(self, step: int) -> bool:
        every = self.r.cfg.checkpoint.every if self.r.ckpt else 0
        return bool(every and step % every == 0 and not self.r.strategy.stopped)

    def stop(self, state: LoopState, flag) -> bool:
        """After the step's exchange nothing is in flight: stop when a server said the budget
        is spent or a signal came (the servers then stop every worker)."""
        self.signum = flag.signum
        return bool(self.r.strategy.stopped or flag.signum)

    def end_steps(self, signum: int) -> None:
        self.r.strategy.done(signum)

    def finish(self, state: LoopState) -> dict:
        """Report to rank 0, then take the run's final model (or its stop notice)."""
        r, ps = self.r, self.r.strategy
        wall = self.wall()
        mine = {"worker": ps.index, "ledger": r.comm.ledger.rows(), "wall_s": wall,
                "compute_cpu_s": state.compute_cpu_s, "skipped": state.skipped,
                "clock_lag": dict(ps.lag_hist), "wait_s": ps.wait_s, "clock": ps.clock,
                "signum": self.signum}
        report_to_rank0(r.ctl, mine, ps.server_timeout_s + 30)
        notice = take_final_model(r.ctl, r.model, ps.server_timeout_s + ps.worker_timeout_s + 30)
        if notice:                    # this worker's own step: it resumes its own batch sequence
            stopped(self, notice)
        skip_mpi_finalize(0)
        return {"method": r.cfg.method, "rank": r.comm.rank, "role": "worker",
                **{k: v for k, v in mine.items() if k != "ledger"}}


class Budget:
    """A time budget (``[budget]``): the run's modelled wall-clock after every step — the mean
    over ranks of the computation's CPU seconds plus the α–β time of the mean rank's traffic
    (its message rounds and bytes) on ``budget.link`` — agreed by every rank in one small
    all-reduce on the control communicator. The run stops at the first step that reaches
    ``budget.seconds`` and evaluates where it crosses each of ``budget.evals`` even marks."""

    def __init__(self, r: Run):
        b = r.cfg.budget
        self.r, self.seconds, self.evals, self.link = r, b.seconds, b.evals, Link.parse(b.link)
        self.spent_s, self.marks = 0.0, 0

    @property
    def spent(self) -> bool:
        return self.spent_s >= self.seconds

    def measure(self, state: LoopState) -> float:
        """The modelled seconds so far (collective)."""
        r, K = self.r, self.r.comm.size
        cpu, rounds, sent = allsum(r.ctl, [state.compute_cpu_s, r.comm.ledger.rounds(K),
                                           r.comm.ledger.totals()["bytes_sent"]])
        self.spent_s = cpu / K + self.link.traffic_seconds(rounds / K, sent / K)
        return self.spent_s

    def start(self, state: LoopState) -> None:
        """Where a resumed run stands in its budget."""
        self.marks = self._mark(self.measure(state))

    def advance(self, state: LoopState) -> bool:
        """After a step: True where it crossed one of the marks (the budget's end included)."""
        mark = self._mark(self.measure(state))
        crossed, self.marks = mark > self.marks, max(mark, self.marks)
        return crossed

    def _mark(self, t: float) -> int:
        return min(int(t / self.seconds * self.evals), self.evals)

    def summary(self) -> dict:
        return {"seconds": self.seconds, "link": str(self.link), "spent_s": self.spent_s}


def _append(f, line: str) -> None:
    """Append a metrics line whole or not at all: a full disk is an error naming the file, and
    the part of the line that was written is cut off again, so the file never ends in half a
    line. Written straight to the file descriptor: no buffer keeps half a line to flush later."""
    fd, data = f.fileno(), line.encode()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError as e:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise LowcommError(f"cannot write {f.name}: {e.strerror or e} (the metrics up to the "
                           "last whole line are kept)") from e


class _Done:
    """A completed request (one rank: nothing to agree with)."""

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True
