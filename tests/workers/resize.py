"""Resume on another number of ranks, 4 → 2 and 2 → 4, for every method in argv[2] (a JSON
object ``{method: [method]}``), all in one 4-rank mpirun (usage: resize.py ROOT METHODS):

1. the 4 ranks train each method on 4 ranks (``ROOT/<m>/four``, a checkpoint at step 3);
2. ranks 0–1 resume it on 2 ranks; meanwhile ranks 2–3 train it on 2 ranks (``two``);
3. the 4 ranks resume ``two`` on 4 ranks.
Each resume is checked twice: resumed with ``steps`` equal to the checkpoint's step (nothing
trained), its parameters must equal the average over the old ranks of the parameters in the
checkpoint files, recomputed here from those files (exactly: for replicated methods the replicas
are equal, so the average is the replica); resumed to the end, the run must finish with a finite
eval loss, every rank holding the same model, and the resize recorded in its summary.
"""
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from common import Checks, seeded_mlp

import lowcomm
from lowcomm.tasks import dataset_batches

STEPS, EVERY = 5, 3
LAST = 3                       # the newest checkpoint of a 5-step run saved every 3 steps
world = lowcomm.init()
rank = world.rank
ok = Checks(rank)
assert world.size == 4, "resize.py runs on 4 ranks"
root, methods = Path(sys.argv[1]), json.loads(sys.argv[2])
half = world.split(0 if rank < 2 else 1)          # ranks 0-1 and ranks 2-3
g = torch.Generator().manual_seed(7)
X = torch.randn(600, 10, generator=g)
data = torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long() + (X[:, 1] > 0).long())
names = [n for n, _ in seeded_mlp(10, 16, 3).named_parameters()]


def train(comm, method, out, resume=None, steps=STEPS):
    spec, extra, _ = method
    return lowcomm.train(model=lambda cfg: seeded_mlp(10, 16, 3),
                         loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                         batch=dataset_batches(data),
                         eval_batches=lambda cfg: [data[i * 50:(i + 1) * 50] for i in range(2)],
                         strategy=spec, steps=steps, batch_size=8, log_every=2, lr=0.05,
                         set=["optimizer.name=sgd", f"checkpoint.every={EVERY}", *extra],
                         out=str(out), comm=comm, resume=resume)


def average_sha(run_dir: Path) -> tuple[str, int, bool]:
    """sha256 (as state_sha256) of the old ranks' averaged parameters, from the files; the
    number of files; whether the old ranks' parameters differ."""
    ck = run_dir / "checkpoints" / f"step-{LAST:08d}"
    states = [torch.load(f, weights_only=False)["model"] for f in sorted(ck.glob("rank-*.pt"))]
    h = hashlib.sha256()
    for name in names:
        avg = torch.stack([s[name] for s in states]).sum(0).div(len(states))
        h.update(name.encode())
        h.update(avg.contiguous().view(torch.uint8).numpy().tobytes())
    differ = any(not torch.equal(s[n], states[0][n]) for s in states for n in names)
    return h.hexdigest(), len(states), differ


def check_resumed(comm, method, old: Path, new: Path, what: str, K_old: int):
    want, n, differ = average_sha(old)
    ok(n == K_old, f"{what}: {n} rank files in the checkpoint, not {K_old}")
    ok(differ == method[2], f"{what}: the old ranks' parameters {'differ' if differ else 'are equal'}"
       f" at step {LAST}; expected {'per-rank' if method[2] else 'replicated'} state")
    if "async-ps" not in method[0]:      # (its servers apply one round more: a budget of LAST
        # steps is spent, and in flight, when its workers first push)
        at = train(comm, method, new.with_name(new.name + "-at"), resume=old, steps=LAST)
        ok(at["state_sha256"] == want, f"{what}: the merged parameters are not the average of "
           f"the {K_old} old ranks' parameters")
    s = train(comm, method, new, resume=old)
    if "async-ps" in method[0]:          # other ranks return their own counters: rank 0's
        s = comm.bcast_object(s if comm.rank == 0 else None)
    ok(math.isfinite(s["eval_loss"]), f"{what}: eval loss {s['eval_loss']}")
    ok(s["ranks_agree"], f"{what}: ranks hold different models at the end")
    ok(s["resizes"] == [{"step": LAST, "from": K_old, "to": comm.size}], f"{what}: {s['resizes']}")
    ok(s["ranks"] == comm.size and s["steps"] == STEPS, f"{what}: {s['ranks']} ranks")


for m, method in methods.items():       # m: [spec, overrides, per-rank state?]
    d = root / m
    s4 = train(world, method, d / "four")
    ok(s4.get("ranks_agree") is not False, f"{m}: 4-rank run")
    if rank < 2:
        check_resumed(half, method, d / "four", d / "four-to-two", f"{m} 4 -> 2", 4)
    else:
        s2 = train(half, method, d / "two")
        ok(s2.get("ranks_agree") is not False, f"{m}: 2-rank run")
    world.barrier()
    check_resumed(world, method, d / "two", d / "two-to-four", f"{m} 2 -> 4", 2)
ok.report()
