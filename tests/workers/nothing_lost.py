"""What a run guards against once its ranks are up, in one mpirun: ``argv[1]`` is an empty
folder every rank sees. Each check asserts on every rank (rank 0 also on the files).

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
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from common import Checks

import lowcomm
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import LowcommError, RunFolderError
from lowcomm.run import checkpoint, folder
from lowcomm.run.api import run
from lowcomm.run.checkpoint import CheckpointError
from lowcomm.run.api import load_config
from lowcomm.tasks import TaskError, from_functions

world = lowcomm.init()
rank = world.rank
ok = Checks(rank)
root = Path(sys.argv[1])
BASE = ["batch_size=2", "eval_batches=0", "log_every=1", "comm.timeout_s=30"]


def cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


def train(task, c, out=None, resume=None):
    """One run on a fresh duplicate of the world (its own ledger), as ``lowcomm train`` would."""
    return run(c, out, world.dup(Ledger(), "world"), progress=False, resume=resume, task=task)


def failure(fn):
    """The exception ``fn()`` raises (None when it returns), the same kind on every rank."""
    try:
        fn()
    except Exception as e:          # noqa: BLE001 - the checks look at what it is
        world.barrier()
        return e
    world.barrier()
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


# --- seed: Python's random and NumPy too ---------------------------------------------------------
def drawn(c):
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        m.weight.add_(random.random())
        m.bias.add_(float(np.random.rand()))
    return m


drawing = from_functions(drawn, mse, batch)
sums = []
for _ in range(2):
    scramble()
    sums.append(train(drawing, cfg("steps=2", "seed=7")))
ok(sums[0]["ranks_agree"] and sums[1]["ranks_agree"], "a run of the seeded task: ranks disagree")
ok(sums[0]["state_sha256"] == sums[1]["state_sha256"],
   "two fresh runs of a task drawing from random/numpy ended apart: seed does not seed them")

# --- a loss without grad_fn ----------------------------------------------------------------------
detached = from_functions(linear(2), lambda m, b: mse(m, b).detach(), batch, name="detached.py")
e = failure(lambda: train(detached, cfg("steps=2")))
ok(isinstance(e, TaskError) and "detached.py: loss(model, batch) returned a tensor without grad_fn"
   in str(e), f"a loss without grad_fn: {type(e).__name__}: {e}")

# --- a task changed to another architecture ------------------------------------------------------
arch = root / "arch"
train(from_functions(linear(2), mse, batch), cfg("steps=6", "checkpoint.every=3"), arch)
before = digest(arch) if rank == 0 else None
e = failure(lambda: train(from_functions(linear(3), mse, batch), cfg("steps=6", "checkpoint.every=3"),
                          arch, resume=arch))
ok(isinstance(e, CheckpointError), f"another architecture: {type(e).__name__}: {e}")
ok(f"checkpoint {arch / 'checkpoints' / 'step-00000003'} holds another model" in str(e)
   and "shapes differ: weight (2, 4) in the checkpoint, (3, 4) now, bias (2,) in the checkpoint, "
   "(3,) now" in str(e), f"the error names neither the checkpoint nor the shapes: {e}")
ok(rank != 0 or digest(arch) == before, "a refused resume changed the run's files")

# --- a checkpoint.dir belongs to one run ---------------------------------------------------------
task = from_functions(linear(2), mse, batch)
ck, ckx = root / "ck", root / "ckx"
a = train(task, cfg("steps=7", "checkpoint.every=3", f"checkpoint.dir='{ck}'"), root / "a")
mine = digest(ck) if rank == 0 else None
e = failure(lambda: train(task, cfg("steps=7", "checkpoint.every=3", "lr=0.01",
                                    f"checkpoint.dir='{ck}'"), root / "b"))
ok(isinstance(e, RunFolderError) and f"checkpoint.dir {ck} holds the checkpoints of another run "
   f"(the run in {(root / 'a').resolve()})" in str(e), f"a second run on a checkpoint.dir: {e}")
ok(rank != 0 or digest(ck) == mine, "the refused run changed the other run's checkpoints")
if rank == 0:                            # a live run holds the folder
    folder.lock(ck, "a live run elsewhere")
e = failure(lambda: train(task, cfg("steps=7", "checkpoint.every=3", f"checkpoint.dir='{ck}'"),
                          root / "a", resume=root / "a"))
ok(isinstance(e, RunFolderError) and f"{ck} is in use by another run" in str(e),
   f"a locked checkpoint.dir: {type(e).__name__}: {e}")
folder.close_run("a live run elsewhere")
# another run's newer checkpoint in it (copied by hand): skipped on resume, never pruned
train(task, cfg("steps=9", "checkpoint.every=4", f"checkpoint.dir='{ckx}'"), root / "x")
if rank == 0:
    shutil.copytree(ckx / "step-00000008", ck / "step-00000008")
world.barrier()
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
for name in ("lowcomm.train", "lowcomm.run.checkpoint"):
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.INFO)
res = train(task, cfg("steps=13", "checkpoint.every=3", f"checkpoint.dir='{ck}'"), root / "a",
            resume=root / "a")
ok(res["ranks_agree"] and res["steps"] == 13, f"the resumed run: {res}")
if rank == 0:
    ok(any(f"{ck / 'step-00000008'} is a checkpoint of another run" in m for m in said),
       f"the other run's checkpoint was not skipped by name: {said}")
    ok(f"resumed from {ck} at step 6" in said, f"resumed from the wrong checkpoint: {said}")
    x_id = json.loads((root / "x" / ".lowcomm-run.json").read_text())["run"]
    ok(sorted(p.name for p in ck.glob("step-*")) == ["step-00000008", "step-00000009",
                                                      "step-00000012"],
       f"pruning touched another run's checkpoint: {sorted(p.name for p in ck.glob('step-*'))}")
    ok(json.loads((ck / "step-00000008" / "manifest.json").read_text())["run"] == x_id,
       "the other run's checkpoint was overwritten")

# --- a full disk while writing a checkpoint ------------------------------------------------------
def full(path, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))    # as write(2) says it: no file name


with mock.patch.object(checkpoint, "_write", full):
    e = failure(lambda: train(task, cfg("steps=4", "checkpoint.every=2"), root / "full"))
tmp = root / "full" / "checkpoints" / ".step-00000002.tmp"
ok(isinstance(e, LowcommError) and f"cannot write checkpoint file {tmp / f'rank-{rank:05d}.pt'}: "
   "No space left on device" in str(e) and f"removed the partial checkpoint {tmp}" in str(e),
   f"a full disk: {type(e).__name__}: {e}")
ok(not list((root / "full" / "checkpoints").glob(".step-*")), "the partial checkpoint was left")
ok.report()
