"""Every method through the one loop from Python, on 3 ranks.

``lowcomm.train`` with model/loss/batch functions, on 3 ranks (odd, so averages are not exact
halves; partial last periods), one run per method on a CNN with BatchNorm and dropout over real
images (experiments/digits_cnn_task.py): each run must end with the same whole state on every
rank (``ranks_agree``, and checked here against every rank's state, BatchNorm's statistics
included, which must have moved), finite losses, and bytes counted. Also: the README's example
method, registered from its own file, equals Local SGD on an MLP fed from a map-style Dataset;
``lowcomm.build`` makes every registered method from a spec.
"""
import importlib
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import assert_models_close, every_method, inner_optimizer, seeded_mlp, toy_dataset
from lowcomm.run.evaluate import state_sha256
from lowcomm.run.registry import in_one_job
from lowcomm.tasks import dataset_batches
from under_mpi import RANK, SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import digits_cnn_task as digits  # noqa: E402

importlib.import_module("example_method")     # the README's method registers "average-every"

DATA = toy_dataset()
STEPS = 7        # not a multiple of any period below: every outer loop ends between syncs
#: every registered method at its example (helpers.every_method), and variants of some
METHODS = every_method({
    "syncdp-ring-int8": ("syncdp:algorithm=ring", ["compressor.name=int8"]),
    "horovod": ("syncdp:backend=horovod", []),
    "zero2-qgz-qwz": ("zero2:qgz=int4,qwz=int8,partition=tensor", []),
    "gossip-push-sum": ("gossip:graph=one-peer-exponential,gossip_mode=push-sum", []),
    "muloco": ("diloco:period=3", ["optimizer.name=muon"]),
    # DeepSpeed's conventions: a compression scale per tensor, its step counter
    "onebit-adam-deepspeed": ("onebit-adam:freeze_step=3,scale=tensor,counter=deepspeed",
                              ["optimizer.name=adam"]),
    "zeroone-adam-deepspeed": ("zeroone-adam:var_freeze_step=2,local_step_scaler=1,local_step_clipper=2,"
                               "scale=tensor,counter=deepspeed", ["optimizer.name=adam"]),
    "policy": ("syncdp", ["topology=dc:2,rank:2+1", "policy.dc=diloco:period=3,compressor=int8"]),
})


def loss(m, batch):
    x, y = batch
    return F.cross_entropy(m(x), y)


def evals(cfg):
    return [DATA[i * 50:(i + 1) * 50] for i in range(3)]


def rank_0s(comm, summary, keys):
    """async-ps: servers and workers return their own counters; the run's are rank 0's."""
    return {**summary, **comm.bcast_object({k: summary[k] for k in keys} if RANK == 0 else None)}


@pytest.fixture(scope="module")
def trained(comm, shared_dir):
    """``trained(name)``: (summary, the delivered model) of the method's run on the MLP task, fed
    from a map-style Dataset (``dataset_batches``)."""
    cache = {}

    def get(name):
        if name not in cache:
            built = []

            def model(cfg):
                built.append(seeded_mlp(10, 16, 3))
                return built[-1]
            spec, extra = METHODS[name]
            task = lowcomm.from_functions(model, loss, dataset_batches(DATA), evals)
            summary = lowcomm.train(task, strategy=spec, steps=STEPS, batch_size=8,
                                    log_every=2, lr=0.05, set=["optimizer.name=sgd", *extra],
                                    out=str(shared_dir / name), comm=comm)
            cache[name] = summary, built[-1]
        return cache[name]
    return get


def test_the_readmes_example_method_equals_localsgd(trained):
    """SGD: the same update; the averages are packed differently, so equal up to the sums'
    rounding. Both runs end with one model on every rank, with finite losses."""
    for name in ("average-every", "localsgd"):
        summary, _ = trained(name)
        assert summary["ranks_agree"] is True and math.isfinite(summary["eval_loss"]), (name, summary)
    assert_models_close(trained("average-every")[1], trained("localsgd")[1], "average-every vs localsgd")


@pytest.mark.parametrize("name", METHODS)
def test_ends_with_one_whole_state_on_every_rank_finite_losses_and_bytes_counted(name, comm, shared_dir):
    """Real images (scikit-learn's digits): the model each method delivers, its BatchNorm
    statistics included, is the same on every rank and the summary's hash is every rank's,
    the statistics moved (a method that never carried them would evaluate with the initial
    ones), the losses are finite and the bytes counted."""
    cnns = []

    def cnn(cfg):
        cnns.append(digits.model(cfg))
        return cnns[-1]
    spec, extra = METHODS[name]
    task = lowcomm.from_functions(cnn, digits.loss, digits.batch, digits.eval_batches)
    summary = lowcomm.train(task, strategy=spec, steps=STEPS,
                            batch_size=16, log_every=7, lr=0.05,
                            set=["optimizer.name=sgd", "eval_batches=4", *extra],
                            out=str(shared_dir / ("cnn-" + name)), comm=comm)
    if name == "async-ps":
        summary = rank_0s(comm, summary, ("ranks_agree", "state_sha256", "final_loss",
                                          "eval_loss", "bytes_total"))
    m = cnns[-1]
    digest = state_sha256(m)          # the delivered model: every rank's copy must be the same
    hashes = comm.allgather_object(digest)
    assert summary["ranks_agree"] is True, f"ranks_agree is {summary['ranks_agree']}"
    assert digest == summary["state_sha256"], "the summary's hash is not this rank's model's"
    assert len(set(hashes)) == 1, f"the ranks' whole states differ: {hashes}"
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["eval_loss"]), \
        f"losses {summary['final_loss']}, {summary['eval_loss']}"
    assert summary["bytes_total"] > 0, "no bytes counted"
    assert int(m.bn1.num_batches_tracked) > 0 and float(m.bn1.running_mean.abs().sum()) > 0, \
        "BatchNorm statistics never moved"


def adamw_run(comm, distributed: bool):
    m = seeded_mlp(10, 16, 3)
    inner = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    opt = lowcomm.OneBitAdam(m, inner, comm, freeze_step=4) if distributed else inner
    for step in range(1, 5):
        x, y = DATA[(step * 3 * SIZE * 4) % 500:(step * 3 * SIZE * 4) % 500 + SIZE * 4]
        if distributed:
            x, y = x[RANK * 4:(RANK + 1) * 4], y[RANK * 4:(RANK + 1) * 4]
        opt.zero_grad()
        loss(m, (x, y)).backward()
        opt.step()
    if distributed:
        opt.close()
    return m


def test_onebit_adam_with_adamw_warms_up_as_torch_adamw_on_the_whole_batch(comm):
    """Decoupled weight decay on the averaged gradient: one process on the K ranks' batches."""
    assert_models_close(adamw_run(comm, True), adamw_run(comm, False), "OneBitAdam(AdamW) warm-up vs torch AdamW")


@pytest.mark.parametrize("name", [n for n in in_one_job() if n != "async-ps"])
def test_build_makes_every_registered_method_from_its_spec(name, comm):
    """From Python, no config machinery (async-ps needs the loop's serving side: see the CLI
    tests)."""
    m = seeded_mlp(10, 16, 3)
    inner = inner_optimizer(name, m.parameters())
    opt = lowcomm.build(name, m, inner, comm, context=lowcomm.Context(steps=STEPS))
    opt.close()
    assert isinstance(opt, lowcomm.Strategy), f"build({name!r}) gave {type(opt).__name__}"


def test_a_misspelt_key_is_a_config_error_naming_it(comm):
    with pytest.raises(lowcomm.ConfigError) as e:
        lowcomm.build("diloco:perod=3", seeded_mlp(10, 3), None, comm)
    assert e.value.key == "perod", str(e.value)
