"""Many ``lowcomm train`` runs in one mpirun (one start-up for what would be dozens): each entry
of the JSON list in argv[1] is ``{"name", "ref": DIR, "overrides": [...], "stop": STEP|null,
"run": DIR|null}``.

Every entry is first trained uninterrupted into ``ref``, exactly as ``lowcomm train --set ...
--out ref`` would (on a fresh duplicate of the world communicator, with its own ledger). An
entry with ``stop`` is then trained into ``run`` and interrupted at that step's forward pass on
every rank (an exception, as a crash would end it: the periodic checkpoints written so far are
all that is left), the process's RNGs are scrambled, and the run is resumed from its folder
with ``resume=run``. Every rank then compares the resumed run with the reference: its own
``state_sha256``, the byte count and eval loss; rank 0 also the logged metrics (without the
timings). Mismatches are not raised at once (one method must not hide the others): every rank
writes ``{name: [problems]}`` to ``<argv[2]>/rank<r>.json`` and the test asserts per method.

A real SIGKILL of one rank (the job must end, and no half-written checkpoint is left) is
tested separately with ``faulty_train.py``; this worker checks what a resume restores.
"""
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from common import Checks

import lowcomm
from lowcomm.comm.ledger import Ledger
from lowcomm.run.api import load_config
from lowcomm.tasks import Task
from lowcomm.run.api import run

TIMINGS = {"wall_s", "comm_s", "compute_cpu_s"}


class Crash(Exception):
    """The injected interruption."""


real_loss, stop_at, calls = Task.loss, [None], [0]


def loss(self, model, batch):
    out = real_loss(self, model, batch)
    if model.training and stop_at[0] is not None:
        calls[0] += 1
        if calls[0] == stop_at[0]:
            raise Crash(f"interrupted at step {stop_at[0]}")
    return out


Task.loss = loss


def logged(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMINGS} for line in lines]


def newest_checkpoint(out: Path) -> int:
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*")]
    return max(steps) if steps else 0


world = lowcomm.init()
ok = Checks(world.rank)
problems: dict[str, list[str]] = {}
for entry in json.loads(Path(sys.argv[1]).read_text()):
    name, cfg = entry["name"], load_config(None, entry["overrides"])
    ref = run(cfg, entry["ref"], world.dup(Ledger(), "world"), progress=False)
    ok(ref is not None and (world.rank != 0 or (Path(entry["ref"]) / "summary.json").exists()),
       f"{name}: the reference run wrote no summary")
    if entry.get("stop") is None:
        continue
    out, stop, bad = Path(entry["run"]), entry["stop"], problems.setdefault(name, [])
    stop_at[0], calls[0] = stop, 0
    try:
        run(cfg, out, world.dup(Ledger(), "world"), progress=False)
        bad.append(f"the run was not interrupted at step {stop}")
    except Crash:
        pass
    finally:
        stop_at[0] = None
    world.barrier()
    expect = (stop - 1) // cfg.checkpoint.every * cfg.checkpoint.every
    if newest_checkpoint(out) != expect:
        bad.append(f"interrupted at step {stop}: newest checkpoint {newest_checkpoint(out)}, "
                   f"expected {expect}")
    # what a new process would have: nothing of the interrupted run's RNG streams
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
    res = run(cfg, out, world.dup(Ledger(), "world"), progress=False, resume=out)
    for key in ("state_sha256", "bytes_total", "eval_loss", "ranks_agree"):
        if ref[key] != res[key]:
            bad.append(f"interrupted at step {stop}, resumed at {expect}: {key} "
                       f"{res[key]!r} != uninterrupted {ref[key]!r}")
    if world.rank == 0 and logged(Path(entry["ref"])) != logged(out):
        bad.append(f"interrupted at step {stop}: metrics.jsonl differs from the uninterrupted run's")
Path(sys.argv[2], f"rank{world.rank}.json").write_text(json.dumps(problems))
ok.report()
