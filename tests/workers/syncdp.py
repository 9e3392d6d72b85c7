"""SyncDP on K ranks with batch B equals one process with batch K·B (plain torch, same seed),
for every algorithm, with and without overlap, with gradient accumulation, with a parameter
unused on some ranks, and through the Horovod backend."""
import sys

import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, seeded_mlp, random_batch

comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)
B, STEPS = 6, 4
with_horovod = "--horovod" in sys.argv


def make():
    return seeded_mlp(10, 64, 64, 3, unused=True)


def batch(step):
    return random_batch(step, K * B)


def reference():
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def distributed(passes=1, **kw):
    model = make()
    with torch.no_grad():   # ranks start apart; SyncDP's broadcast from rank 0 must fix that
        for p in model.parameters():
            p.add_(0.01 * r)
    cls = lowcomm.HorovodDP if kw.pop("backend", "mpi") == "horovod" else lowcomm.SyncDP
    opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
              backward_passes_per_step=passes, **kw)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        for m in range(passes):
            sl = slice(m * B // passes, (m + 1) * B // passes)
            (F.cross_entropy(model(x[sl]), y[sl]) / passes).backward()
        opt.step()
    opt.close()
    return model


def same(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        ok(torch.allclose(p, q, rtol=1e-5, atol=1e-6),
           f"{what}: {name} differs from single-process K·B by {float((p - q).abs().max()):.3g}")


ref = reference()
for algorithm in [a for a in lowcomm.ALGORITHMS if a != "hierarchical"]:   # needs a topology
    for overlap in (True, False):
        same(distributed(algorithm=algorithm, overlap=overlap, bucket_mb=0.01), ref,
             f"{algorithm} overlap={overlap}")
same(distributed(passes=2, algorithm="ring", bucket_mb=0.01), ref, "backward_passes_per_step=2")
one_bucket = distributed(algorithm="rabenseifner", bucket_mb=64)
same(one_bucket, ref, "one bucket")

# the ledger: every step all-reduces every gradient once (ring: exact volume when K | n)
model = make()
opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, algorithm="mpi")
before = comm.ledger.get("allreduce.mpi")
x, y = batch(0)
F.cross_entropy(model(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
opt.step()
opt.close()
grad_bytes = 4 * sum(p.numel() for p in model.parameters())
ok(comm.ledger.get("allreduce.mpi").bytes_sent - before.bytes_sent == 2 * (K - 1) * grad_bytes // K
   if K > 1 else True, "SyncDP ledger volume")

# stepping after 1 of 2 declared backward passes is an error, not a silent partial update
model = make()
opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, backward_passes_per_step=2)
F.cross_entropy(model(x[:B]), y[:B]).backward()
try:
    opt.step()
    ok(False, "partial accumulation stepped")
except lowcomm.LowcommError as e:
    ok("1 of 2" in str(e), str(e))
opt.close()

if with_horovod:
    hv = distributed(backend="horovod")
    same(hv, ref, "horovod backend")
    own = distributed(algorithm="ring")
    for (name, p), q in zip(hv.named_parameters(), own.parameters()):
        ok(torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"horovod vs lowcomm: {name}")
    ok(comm.ledger.get("allreduce.horovod").calls == STEPS, "horovod steps in the ledger")
ok.report()
