"""What a run guards against once its ranks are up, on 2 ranks.

Every rank asserts (rank 0 also on the files, in a folder every rank sees):

* ``seed`` seeds Python's ``random`` and NumPy too: two fresh runs of a task that draws from
  them agree (the process's generators scrambled in between).
* A loss without ``grad_fn`` is a TaskError naming ``loss()``, not torch's message.
* A task changed to another architecture: resuming names the checkpoint and the keys and shapes
  that differ, and changes nothing.
* A ``checkpoint.dir`` belongs to one run: another run is refused while it is another's (and
  while a live run holds its lock); a resume skips a checkpoint of another run found there and
  neither overwrites nor prunes it.
* A full disk while writing a checkpoint: an error naming the file, and no partial
  ``.step-N.tmp`` folder left to keep the disk full.
"""
import errno
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from lowcomm.comm.ledger import Ledger
from lowcomm.errors import LowcommError, RunFolderError
from lowcomm.run import checkpoint, folder
from lowcomm.run.api import run
from lowcomm.run.folder import RunOptions
from lowcomm.run.checkpoint import CheckpointError
from lowcomm.run.api import load_config
from lowcomm.tasks import TaskError, from_functions
from under_mpi import RANK

BASE = ["batch_size=2", "eval_batches=0", "log_every=1", "comm.timeout_s=30"]


def cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


def train(comm, task, c, out=None, resume=None):
    """One run on a fresh duplicate of the world (its own ledger), as ``lowcomm train`` would."""
    return run(c, RunOptions(out, progress=False, resume=resume), comm.dup(Ledger(), "world"), task)


def failure(comm, fn):
    """The exception ``fn()`` raises (None when it returns), the same kind on every rank."""
    try:
        fn()
    except Exception as e:          # noqa: BLE001 - the checks look at what it is
        comm.barrier()
        return e
    comm.barrier()
    return None


def linear(n_out):
    return lambda c: torch.nn.Linear(4, n_out)


def mse(model, batch):
    return model(batch).pow(2).mean()


def batch(step, r, w, c):
    return torch.full((2, 4), 0.1 * (step + r))


def digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lowcomm.lock"}


def scramble():
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)


def drawn(c):
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        m.weight.add_(random.random())
        m.bias.add_(float(np.random.rand()))
    return m


def test_seed_seeds_python_random_and_numpy_too(comm):
    drawing = from_functions(drawn, mse, batch)
    sums = []
    for _ in range(2):
        scramble()
        sums.append(train(comm, drawing, cfg("steps=2", "seed=7")))
    assert sums[0]["ranks_agree"] and sums[1]["ranks_agree"], "a run of the seeded task: ranks disagree"
    assert sums[0]["state_sha256"] == sums[1]["state_sha256"], \
        "two fresh runs of a task drawing from random/numpy ended apart: seed does not seed them"


def test_a_task_without_held_out_batches_writes_a_summary_that_is_json(comm, shared_dir):
    """No eval_batches (the README's own task): the eval loss is null in summary.json, not a
    bare NaN, which is not JSON."""
    out = shared_dir / "no-eval"
    train(comm, from_functions(linear(2), mse, batch), cfg("steps=2"), out)
    if RANK == 0:
        text = (out / "summary.json").read_text()
        s = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
        assert "eval_loss" in s and s["eval_loss"] is None, s.get("eval_loss")
    comm.barrier()


def test_a_loss_without_grad_fn_is_a_task_error_naming_loss(comm):
    detached = from_functions(linear(2), lambda m, b: mse(m, b).detach(), batch, name="detached.py")
    e = failure(comm, lambda: train(comm, detached, cfg("steps=2")))
    assert isinstance(e, TaskError) and "detached.py: loss(model, batch) returned a tensor without grad_fn" \
        in str(e), f"{type(e).__name__}: {e}"


def test_resuming_another_architecture_names_the_checkpoint_and_shapes_and_changes_nothing(comm, shared_dir):
    arch = shared_dir / "arch"
    train(comm, from_functions(linear(2), mse, batch), cfg("steps=6", "checkpoint.every=3"), arch)
    before = digest(arch) if RANK == 0 else None
    e = failure(comm, lambda: train(comm, from_functions(linear(3), mse, batch),
                                    cfg("steps=6", "checkpoint.every=3"), arch, resume=arch))
    assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
    assert f"checkpoint {arch / 'checkpoints' / 'step-00000003'} holds another model" in str(e) \
        and "shapes differ: weight (2, 4) in the checkpoint, (3, 4) now, bias (2,) in the checkpoint, " \
        "(3,) now" in str(e), f"the error names neither the checkpoint nor the shapes: {e}"
    assert RANK != 0 or digest(arch) == before, "a refused resume changed the run's files"


TASK = from_functions(linear(2), mse, batch)


@pytest.fixture(scope="module")
def run_a(comm, shared_dir):
    """Run a, 7 steps, its checkpoints in the folder ``ck`` outside its run folder."""
    ck = shared_dir / "ck"
    train(comm, TASK, cfg("steps=7", "checkpoint.every=3", f"checkpoint.dir='{ck}'"), shared_dir / "a")
    return ck


def test_a_checkpoint_dir_of_another_run_is_refused_and_left_as_it_was(comm, shared_dir, run_a):
    ck = run_a
    mine = digest(ck) if RANK == 0 else None
    e = failure(comm, lambda: train(comm, TASK, cfg("steps=7", "checkpoint.every=3", "lr=0.01",
                                                    f"checkpoint.dir='{ck}'"), shared_dir / "b"))
    assert isinstance(e, RunFolderError) and f"checkpoint.dir {ck} holds the checkpoints of another " \
        f"run (the run in {(shared_dir / 'a').resolve()})" in str(e), f"a second run on a checkpoint.dir: {e}"
    assert RANK != 0 or digest(ck) == mine, "the refused run changed the other run's checkpoints"


def test_a_checkpoint_dir_a_live_run_holds_is_refused(comm, shared_dir, run_a):
    ck = run_a
    if RANK == 0:
        folder.lock(ck, "a live run elsewhere")
    try:
        e = failure(comm, lambda: train(comm, TASK, cfg("steps=7", "checkpoint.every=3",
                                                        f"checkpoint.dir='{ck}'"),
                                        shared_dir / "a", resume=shared_dir / "a"))
    finally:
        folder.close_run("a live run elsewhere")
    assert isinstance(e, RunFolderError) and f"{ck} is in use by another run" in str(e), \
        f"{type(e).__name__}: {e}"


@pytest.fixture
def said():
    """What lowcomm's run and checkpoint loggers said during the test."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in ("lowcomm.train", "lowcomm.run.checkpoint")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield lines
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


def test_a_resume_skips_another_runs_checkpoint_and_neither_overwrites_nor_prunes_it(comm, shared_dir, run_a, said):
    ck, ckx = run_a, shared_dir / "ckx"
    # another run's newer checkpoint in it (copied by hand)
    train(comm, TASK, cfg("steps=9", "checkpoint.every=4", f"checkpoint.dir='{ckx}'"), shared_dir / "x")
    if RANK == 0:
        shutil.copytree(ckx / "step-00000008", ck / "step-00000008")
    comm.barrier()
    res = train(comm, TASK, cfg("steps=13", "checkpoint.every=3", f"checkpoint.dir='{ck}'"), shared_dir / "a",
                resume=shared_dir / "a")
    assert res["ranks_agree"] and res["steps"] == 13, f"the resumed run: {res}"
    if RANK == 0:
        assert any(f"{ck / 'step-00000008'} is a checkpoint of another run" in m for m in said), \
            f"the other run's checkpoint was not skipped by name: {said}"
        assert f"resumed from {ck} at step 6" in said, f"resumed from the wrong checkpoint: {said}"
        x_id = json.loads((shared_dir / "x" / ".lowcomm-run.json").read_text())["run"]
        steps = sorted(p.name for p in ck.glob("step-*"))
        assert steps == ["step-00000008", "step-00000009", "step-00000012"], \
            f"pruning touched another run's checkpoint: {steps}"
        assert json.loads((ck / "step-00000008" / "manifest.json").read_text())["run"] == x_id, \
            "the other run's checkpoint was overwritten"


def full(path, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))    # as write(2) says it: no file name


def test_a_full_disk_while_checkpointing_names_the_file_and_leaves_no_partial_checkpoint(comm, shared_dir):
    with mock.patch.object(checkpoint, "_write", full):
        e = failure(comm, lambda: train(comm, TASK, cfg("steps=4", "checkpoint.every=2"), shared_dir / "full"))
    tmp = shared_dir / "full" / "checkpoints" / ".step-00000002.tmp"
    assert isinstance(e, LowcommError) and f"cannot write checkpoint file {tmp / f'rank-{RANK:05d}.pt'}: " \
        "No space left on device" in str(e) and f"removed the partial checkpoint {tmp}" in str(e), \
        f"{type(e).__name__}: {e}"
    assert not list((shared_dir / "full" / "checkpoints").glob(".step-*")), "the partial checkpoint was left"
