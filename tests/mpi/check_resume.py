"""Interrupted-then-resumed runs against uninterrupted ones, every rank asserting.

Many ``lowcomm train`` runs in one mpirun (one start-up for what would be dozens).
``$LOWCOMM_RESUME_JOBS`` names a JSON list of ``{"name", "ref": DIR, "overrides":
[...], "stop": STEP|null, "run": DIR|null}``, one case per entry (two for one with ``stop``):

* every entry is trained uninterrupted into ``ref``, exactly as ``lowcomm train --set ... --out
  ref`` would (on a fresh duplicate of the world communicator, with its own ledger);
* an entry with ``stop`` is then trained into ``run`` and interrupted at that step's forward
  pass on every rank (an exception, as a crash would end it: the periodic checkpoints written so
  far are all that is left), the process's RNGs are scrambled, and the run is resumed from its
  folder with ``resume=run``. The resumed run must equal the reference: every rank's
  ``state_sha256``, the byte count and eval loss; rank 0 also the logged metrics (without the
  timings).

A real SIGKILL of one rank (the job must end, and no half-written checkpoint is left) is tested
with tests/workers/faulty_train.py; this checks what a resume restores.
"""
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.comm.ledger import Ledger
from lowcomm.run.api import run
from lowcomm.run.folder import RunOptions
from lowcomm.run.api import load_config
from lowcomm.tasks import Task

JOBS = json.loads(Path(os.environ["LOWCOMM_RESUME_JOBS"]).read_text()) \
    if "LOWCOMM_RESUME_JOBS" in os.environ else []
BY_NAME = {job["name"]: job for job in JOBS}
TIMINGS = {"wall_s", "comm_s", "compute_cpu_s"}


class Crash(Exception):
    """The injected interruption."""


@pytest.fixture(scope="module")
def interrupt():
    """``interrupt(step)``: the training forward pass of ``step`` raises :class:`Crash`
    (None: no interruption) for the runs made until the module ends."""
    real_loss, state = Task.loss, {"stop": None, "calls": 0}

    def loss(self, model, batch):
        out = real_loss(self, model, batch)
        if model.training and state["stop"] is not None:
            state["calls"] += 1
            if state["calls"] == state["stop"]:
                raise Crash(f"interrupted at step {state['stop']}")
        return out

    def at(step):
        state["stop"], state["calls"] = step, 0
    Task.loss = loss
    yield at
    Task.loss = real_loss


def logged(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMINGS} for line in lines]


def newest_checkpoint(out: Path) -> int:
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")]
    return max(steps) if steps else 0


@pytest.fixture(scope="module")
def reference(comm):
    """``reference(name)``: the summary of the entry's uninterrupted run (run once)."""
    done = {}

    def get(name):
        if name not in done:
            job = BY_NAME[name]
            done[name] = run(load_config(None, job["overrides"]), RunOptions(job["ref"], progress=False),
                             comm.dup(Ledger(), "world"))
        return done[name]
    return get


@pytest.mark.parametrize("name", BY_NAME)
def test_the_uninterrupted_run_writes_its_summary(name, comm, reference):
    ref = reference(name)
    assert ref is not None and (comm.rank != 0 or (Path(BY_NAME[name]["ref"]) / "summary.json").exists()), \
        "the reference run wrote no summary"


@pytest.mark.parametrize("name", [job["name"] for job in JOBS if job.get("stop") is not None])
def test_interrupted_then_resumed_is_bit_identical(name, comm, reference, interrupt):
    job = BY_NAME[name]
    cfg, out, stop = load_config(None, job["overrides"]), Path(job["run"]), job["stop"]
    ref = reference(name)
    interrupt(stop)
    try:
        run(cfg, RunOptions(out, progress=False), comm.dup(Ledger(), "world"))
        crashed = False
    except Crash:
        crashed = True
    finally:
        interrupt(None)
    comm.barrier()
    expect = (stop - 1) // cfg.checkpoint.every * cfg.checkpoint.every
    newest = newest_checkpoint(out)
    # what a new process would have: nothing of the interrupted run's RNG streams
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
    res = run(cfg, RunOptions(out, progress=False, resume=out), comm.dup(Ledger(), "world"))
    problems = [] if crashed else [f"the run was not interrupted at step {stop}"]
    if newest != expect:
        problems.append(f"interrupted at step {stop}: newest checkpoint {newest}, expected {expect}")
    for key in ("state_sha256", "bytes_total", "eval_loss", "ranks_agree"):
        if ref[key] != res[key]:
            problems.append(f"interrupted at step {stop}, resumed at {expect}: {key} {res[key]!r} != "
                            f"uninterrupted {ref[key]!r}")
    if comm.rank == 0 and logged(Path(job["ref"])) != logged(out):
        problems.append(f"interrupted at step {stop}: metrics.jsonl differs from the uninterrupted run's")
    assert not problems, "; ".join(problems)
