"""Every method through the one loop from Python (``lowcomm.train`` with model/loss/batch
functions over a map-style Dataset), in one mpirun: each run must end with the same model on
every rank (``ranks_agree``, and checked here against every rank's whole state), finite losses,
and exactly the bytes the run's ledger says; then every method again on a CNN with BatchNorm and
dropout over real images (experiments/digits_cnn_task.py). Also: the README's example method, registered from
its own file, equals Local SGD; ``lowcomm.build`` makes every registered method from a spec.

Usage: every_method.py  (3 ranks: odd, so averages are not exact halves; partial last periods)
"""
import math
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

from common import Checks, seeded_mlp

import lowcomm
from lowcomm.run.evaluate import state_sha256
from lowcomm.tasks import dataset_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import digits_cnn_task as digits  # noqa: E402
import example_method  # noqa: E402  (registers "average-every")

comm = lowcomm.init()
r, K = comm.rank, comm.size
ok = Checks(r)
g = torch.Generator().manual_seed(7)
X = torch.randn(600, 10, generator=g)
data = torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long() + (X[:, 1] > 0).long())
STEPS = 7        # not a multiple of any period below: every outer loop ends between syncs


built = []


def model(cfg):
    built.append(seeded_mlp(10, 16, 3))
    return built[-1]


def loss(m, batch):
    x, y = batch
    return F.cross_entropy(m(x), y)


def evals(cfg):
    return [data[i * 50:(i + 1) * 50] for i in range(3)]


METHODS = {
    "syncdp": ("syncdp", []),
    "syncdp-ring-int8": ("syncdp:algorithm=ring", ["compressor.name=int8"]),
    "horovod": ("syncdp:backend=horovod", []),
    "localsgd": ("localsgd:period=3", []),
    "diloco": ("diloco:period=3,compressor=ef-sign", []),
    "streaming-diloco": ("streaming-diloco:period=4,fragments=2,delay=2", []),
    "gossip": ("gossip:graph=ring", []),
    "gossip-push-sum": ("gossip:graph=one-peer-exponential,gossip_mode=push-sum", []),
    "onebit-adam": ("onebit-adam:freeze_step=3", ["optimizer.name=adam"]),
    "zeroone-adam": ("zeroone-adam:var_freeze_step=2,local_step_scaler=1,local_step_clipper=2",
                     ["optimizer.name=adam"]),
    "demo": ("demo:topk=4,chunk=8", []),
    "sparta": ("sparta:fraction=0.05", []),
    "sparta-diloco": ("sparta-diloco:period=3,fraction=0.05", []),
    "muloco": ("diloco:period=3", ["optimizer.name=muon"]),
    "average-every": ("average-every:period=3", []),
    "async-ps": ("async-ps:servers=1", []),
    "policy": ("syncdp", ["topology=dc:2,rank:2+1", "policy.dc=diloco:period=3,compressor=int8"]),
}
with tempfile.TemporaryDirectory() as tmp:
    out = comm.bcast_object(tmp)   # rank 0's folder
    finals = {}
    for name, (spec, extra) in METHODS.items():
        summary = lowcomm.train(model=model, loss=loss, batch=dataset_batches(data),
                                eval_batches=evals, strategy=spec, steps=STEPS, batch_size=8,
                                log_every=2, lr=0.05, set=["optimizer.name=sgd", *extra],
                                out=os.path.join(out, name), comm=comm)
        if name == "async-ps" and r != 0:     # servers and workers return their own counters
            summary = {**summary, **comm.bcast_object(None)}
        elif name == "async-ps":
            comm.bcast_object({k: summary[k] for k in ("ranks_agree", "state_sha256",
                                                        "final_loss", "eval_loss", "bytes_total")})
        ok(summary["ranks_agree"] is True, f"{name}: ranks_agree is {summary['ranks_agree']}")
        m = built[-1]                # the delivered model: every rank's copy must be the same
        digest = state_sha256(m)
        ok(digest == summary["state_sha256"], f"{name}: summary hash is not this rank's model's")
        hashes = comm.allgather_object(digest)
        ok(len(set(hashes)) == 1, f"{name}: ranks hold different models: {hashes}")
        finals[name] = m
        ok(math.isfinite(summary["final_loss"]) and math.isfinite(summary["eval_loss"]),
           f"{name}: losses {summary['final_loss']}, {summary['eval_loss']}")
        ok(summary["bytes_total"] > 0, f"{name}: no bytes counted")
    # the README's 30-line method equals Local SGD with the same period (SGD: the same update;
    # the averages are packed differently, so equal up to the sums' rounding)
    ok.models_close(finals["average-every"], finals["localsgd"], "average-every vs localsgd")

# the same methods on a CNN with BatchNorm and dropout over real images (scikit-learn's digits):
# the model each delivers — its BatchNorm statistics included — is the same on every rank, and
# the statistics moved (a method that never carried them would evaluate with the initial ones)
cnns = []


def cnn(cfg):
    cnns.append(digits.model(cfg))
    return cnns[-1]


with tempfile.TemporaryDirectory() as tmp:
    out = comm.bcast_object(tmp)
    for name, (spec, extra) in METHODS.items():
        summary = lowcomm.train(model=cnn, loss=digits.loss, batch=digits.batch,
                                eval_batches=digits.eval_batches, strategy=spec, steps=STEPS,
                                batch_size=16, log_every=7, lr=0.05,
                                set=["optimizer.name=sgd", "eval_batches=4", *extra],
                                out=os.path.join(out, "cnn-" + name), comm=comm)
        if name == "async-ps":
            summary = {**summary, **comm.bcast_object(
                {k: summary[k] for k in ("ranks_agree", "state_sha256", "eval_loss")} if r == 0 else None)}
        m = cnns[-1]
        ok(summary["ranks_agree"] is True, f"cnn {name}: ranks_agree is {summary['ranks_agree']}")
        hashes = comm.allgather_object(state_sha256(m))
        ok(len(set(hashes)) == 1 and hashes[0] == summary["state_sha256"],
           f"cnn {name}: the ranks' whole states differ or differ from the summary's hash")
        ok(math.isfinite(summary["eval_loss"]), f"cnn {name}: eval loss {summary['eval_loss']}")
        ok(int(m.bn1.num_batches_tracked) > 0 and float(m.bn1.running_mean.abs().sum()) > 0,
           f"cnn {name}: BatchNorm statistics never moved")

# 1-bit Adam accepts AdamW: during its warm-up it equals torch AdamW (decoupled weight decay) on
# the averaged gradient, i.e. one process on the K ranks' batches together
def adamw_run(distributed: bool):
    m = seeded_mlp(10, 16, 3)
    inner = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    opt = lowcomm.OneBitAdam(m, inner, comm, freeze_step=4) if distributed else inner
    for step in range(1, 5):
        x, y = data[(step * 3 * K * 4) % 500:(step * 3 * K * 4) % 500 + K * 4]
        if distributed:
            x, y = x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4]
        opt.zero_grad()
        loss((m), (x, y)).backward()
        opt.step()
    if distributed:
        opt.close()
    return m


ok.models_close(adamw_run(True), adamw_run(False), "OneBitAdam(AdamW) warm-up vs torch AdamW")

# every registered method from its spec string, from Python (no config machinery)
for name in lowcomm.STRATEGIES:
    if name == "async-ps":
        continue                    # needs the loop's serving side: see the CLI tests
    m = model(None)
    adam = name in ("onebit-adam", "zeroone-adam")
    inner = (torch.optim.Adam if adam else torch.optim.SGD)(m.parameters(), lr=0.1)
    opt = lowcomm.build(name, m, inner, comm, steps=STEPS)
    ok(isinstance(opt, lowcomm.Strategy), f"build({name!r}) gave {type(opt).__name__}")
    opt.close()
try:
    lowcomm.build("diloco:perod=3", seeded_mlp(10, 3), None, comm)
    ok(False, "a misspelt key was accepted")
except lowcomm.ConfigError as e:
    ok(e.key == "perod", str(e))
ok.report()
