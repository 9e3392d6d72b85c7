"""Resume on another number of ranks, 4 → 2 and 2 → 4, one case per method, on 4 ranks.

1. the 4 ranks train the method on 4 ranks (``<m>/four``, a checkpoint at step 3);
2. ranks 0–1 resume it on 2 ranks; meanwhile ranks 2–3 train it on 2 ranks (``two``);
3. the 4 ranks resume ``two`` on 4 ranks.
Each resume is checked twice: resumed with ``steps`` equal to the checkpoint's step (nothing
trained), its parameters must equal the average over the old ranks of the parameters in the
checkpoint files, recomputed here from those files (exactly: for replicated methods the replicas
are equal, so the average is the replica); resumed to the end, the run must finish with a finite
eval loss, every rank holding the same model, and the resize recorded in its summary. Ranks 0–1
and 2–3 do different work in step 2, so the checks are collected and asserted after step 3 (an
assert between would leave the other pair waiting in a collective).
"""
import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import every_method, seeded_mlp, toy_dataset
from lowcomm.tasks import dataset_batches
from under_mpi import RANK

pytestmark = pytest.mark.mpi(sizes=(4,))
STEPS, EVERY = 5, 3
LAST = 3                       # the newest checkpoint of a 5-step run saved every 3 steps
DATA = toy_dataset()
NAMES = [n for n, _ in seeded_mlp(10, 16, 3).named_parameters()]
# name: [strategy spec, extra overrides, whether the ranks' parameters differ at the checkpoint
# (step 3: periods of 2 end at 2 and 4, so an outer loop's replicas have drifted; streaming
# DiLoCo's fragment 0, sent at step 3, is in flight)]
HAND = {
    "syncdp-ef-sign": ["syncdp", ["compressor.name=ef-sign"], False],
    "onebit-adam": ["onebit-adam:freeze_step=2", ["optimizer.name=adam"], False],
    "zero2": ["zero2", ["optimizer.name=adam"], False],
    # local steps from step 3 on (synchronisations at 2 and 4)
    "zeroone-adam": ["zeroone-adam:var_freeze_step=1,local_step_scaler=1,local_step_clipper=4",
                     ["optimizer.name=adam"], True],
    "demo": ["demo:topk=4,chunk=8", [], False],
    "distro": ["distro", [], False],
    "sparseloco": ["sparseloco:period=2,chunk=8,topk=4", [], True],
    "muloco-ef2bit": ["muloco-ef2bit:period=2", ["optimizer.name=muon"], True],
    "sparta": ["sparta:fraction=0.1", [], True],
    "sparta-diloco": ["sparta-diloco:period=2,fraction=0.1", [], True],
    "localsgd": ["localsgd:period=2", [], True],
    "diloco": ["diloco:period=2,compressor=ef-sign", [], True],
    "streaming-diloco": ["streaming-diloco:period=2,fragments=2,delay=1,merge=add-local", [], True],
    "gossip": ["gossip:graph=ring", [], True],
    # parameters averaged at 2 and 4, moments at 3 (u) and 4 (v): local steps at step 3
    "desloc": ["desloc:period=2,period_u=3,period_v=4", ["optimizer.name=adam"], True],
    "noloco": ["noloco:period=2", [], True],
    # 1 server + 3 workers <-> 1 server + 1 worker (checkpoints every N steps need τ = 0)
    "async-ps": ["async-ps:servers=1,max_staleness=0", [], False],
}
#: registered methods resized elsewhere, or as another row above
COVERED = {"syncdp": "syncdp-ef-sign", "zero1": "zero2 (the same class, stage 2)",
           "fsdp": "check_fsdp.py (its own shards)"}
#: every registered method: a row above, or its registry example (whether its ranks' parameters
#: differ at the checkpoint then not asserted, None), unless COVERED
METHODS = {**{n: [spec, needs, None] for n, (spec, needs) in every_method({}).items()
              if n not in COVERED}, **HAND}


@pytest.fixture(scope="module")
def half(comm):
    """Ranks 0-1 and ranks 2-3."""
    return comm.split(0 if RANK < 2 else 1)


def train(comm, method, out, resume=None, steps=STEPS):
    """The method's run on ``comm``; the parameter server's other ranks return their own
    counters: the run's summary is rank 0's."""
    spec, extra, _ = method
    task = lowcomm.from_functions(lambda cfg: seeded_mlp(10, 16, 3),
                                  lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                                  dataset_batches(DATA),
                                  lambda cfg: [DATA[i * 50:(i + 1) * 50] for i in range(2)])
    s = lowcomm.train(task, strategy=spec, steps=steps, batch_size=8, log_every=2, lr=0.05,
                      set=["optimizer.name=sgd", f"checkpoint.every={EVERY}", *extra],
                      out=str(out), comm=comm, run=lowcomm.RunOptions(resume=resume, progress=False))
    return comm.bcast_object(s if comm.rank == 0 else None) if "async-ps" in spec else s


def average_sha(run_dir: Path) -> tuple[str, int, bool]:
    """sha256 (as state_sha256) of the old ranks' averaged parameters, from the files; the
    number of files; whether the old ranks' parameters differ."""
    ck = run_dir / "checkpoints" / f"step-{LAST:08d}"
    states = [torch.load(f, weights_only=False)["model"] for f in sorted(ck.glob("rank-*.pt"))]
    h = hashlib.sha256()
    for name in NAMES:
        avg = torch.stack([s[name] for s in states]).sum(0).div(len(states))
        h.update(name.encode())
        h.update(avg.contiguous().view(torch.uint8).numpy().tobytes())
    differ = any(not torch.equal(s[n], states[0][n]) for s in states for n in NAMES)
    return h.hexdigest(), len(states), differ


def resumed(comm, method, old: Path, new: Path, K_old: int) -> list[str]:
    """What is wrong with resuming ``old`` (written by ``K_old`` ranks) on ``comm``."""
    problems = []
    want, n, differ = average_sha(old)
    if n != K_old:
        problems.append(f"{n} rank files in the checkpoint, not {K_old}")
    if method[2] is not None and differ != method[2]:
        problems.append(f"the old ranks' parameters {'differ' if differ else 'are equal'} at step {LAST}; "
                        f"expected {'per-rank' if method[2] else 'replicated'} state")
    if "async-ps" not in method[0]:      # (its servers apply one round more: a budget of LAST
        # steps is spent, and in flight, when its workers first push)
        at = train(comm, method, new.with_name(new.name + "-at"), resume=old, steps=LAST)
        if at["state_sha256"] != want:
            problems.append(f"the merged parameters are not the average of the {K_old} old ranks' parameters")
    s = train(comm, method, new, resume=old)
    if not math.isfinite(s["eval_loss"]):
        problems.append(f"eval loss {s['eval_loss']}")
    if s["ranks_agree"] is not True:
        problems.append(f"ranks_agree is {s['ranks_agree']}: ranks hold different models at the end")
    if s["resizes"] != [{"step": LAST, "from": K_old, "to": comm.size}]:
        problems.append(f"resizes {s['resizes']}")
    if s["ranks"] != comm.size or s["steps"] != STEPS:
        problems.append(f"{s['ranks']} ranks, {s['steps']} steps")
    return problems


@pytest.mark.parametrize("m", METHODS)
def test_resumes_on_half_and_on_twice_the_ranks(m, comm, half, shared_dir):
    method, d = METHODS[m], shared_dir / m
    problems = []
    s4 = train(comm, method, d / "four")
    if s4["ranks_agree"] is not True:
        problems.append(f"the 4-rank run: ranks_agree is {s4['ranks_agree']}")
    if RANK < 2:
        problems += [f"4 -> 2: {p}" for p in resumed(half, method, d / "four", d / "four-to-two", 4)]
    else:
        s2 = train(half, method, d / "two")
        if s2["ranks_agree"] is not True:
            problems.append(f"the 2-rank run: ranks_agree is {s2['ranks_agree']}")
    comm.barrier()
    problems += [f"2 -> 4: {p}" for p in resumed(comm, method, d / "two", d / "two-to-four", 2)]
    assert not problems, "; ".join(problems)
