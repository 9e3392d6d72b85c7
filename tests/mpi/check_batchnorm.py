"""BatchNorm's running statistics recomputed under an outer loop's weights (``bn_recompute``), on
2 ranks: through the loop on real images (scikit-learn's digits, experiments/digits_cnn_task.py)
DiLoCo with recomputed statistics is within 2 points of SyncDP's test accuracy, and the
statistics it delivers are those torch's own ``update_bn`` measures on each rank's batches,
averaged over the ranks; in the user's own loop (``DiLoCo(..., context=lowcomm.Context(batches=...))``) the same,
at the end and after every outer step."""
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import update_bn

import lowcomm
from lowcomm.errors import ArgumentError
from lowcomm.run.evaluate import state_sha256
from lowcomm.strategies import DiLoCo, LocalSGD
from under_mpi import RANK, SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import digits_cnn_task as digits  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

STEPS, PERIOD, RECOMPUTE = 300, 50, 16


def statistics(model) -> torch.Tensor:
    """Every BatchNorm layer's running mean and variance, as one vector."""
    return torch.cat([t.reshape(-1) for m in model.modules()
                      if isinstance(m, torch.nn.BatchNorm2d) for t in (m.running_mean, m.running_var)])


def reference(model, batches, comm) -> torch.Tensor:
    """torch's update_bn on a copy of ``model`` over this rank's ``batches``, averaged over the ranks."""
    ref = copy.deepcopy(model)
    update_bn(batches, ref)
    mine = statistics(ref)
    return torch.stack(comm.allgather_object(mine)).mean(0)


def accuracy(model, cfg) -> float:
    x, y = digits.splits(cfg)[1].tensors
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


@pytest.fixture(scope="module")
def runs(comm, shared_dir):
    """(summary, delivered model, cfg) of each method on the digits CNN: 300 steps of 16 images
    per rank, SGD lr 0.05, DiLoCo H = 50 (Nesterov 0.7/0.9)."""
    out = {}
    for name, spec in (("syncdp", "syncdp"), ("diloco", f"diloco:period={PERIOD}"),
                       ("recompute", f"diloco:period={PERIOD},bn_recompute={RECOMPUTE}")):
        built = []

        def cnn(cfg):
            built.append((digits.model(cfg), cfg))
            return built[-1][0]
        task = lowcomm.from_functions(cnn, digits.loss, digits.batch, digits.eval_batches)
        summary = lowcomm.train(task, strategy=spec, steps=STEPS,
                                batch_size=16, log_every=STEPS, lr=0.05, seed=0,
                                set=["optimizer.name=sgd", "eval_batches=17"],
                                out=str(shared_dir / name), comm=comm)
        out[name] = (summary, *built[-1])
    return out


def test_diloco_with_recomputed_statistics_is_within_2_points_of_syncdp(comm, runs):
    acc = {name: accuracy(m, cfg) for name, (_, m, cfg) in runs.items()}
    everyone = comm.allgather_object(acc)
    assert all(a == everyone[0] for a in everyone), f"ranks measured different accuracies: {everyone}"
    assert acc["recompute"] >= acc["syncdp"] - 0.02, f"test accuracy {acc}"
    loss = {name: s["eval_loss"] for name, (s, _, _) in runs.items()}
    assert loss["recompute"] < loss["diloco"], \
        f"recomputed statistics did not lower DiLoCo's held-out loss: {loss}"


def test_the_loop_recomputes_on_each_ranks_last_batches_as_torchs_update_bn(comm, runs):
    summary, m, cfg = runs["recompute"]
    assert summary["ranks_agree"] is True and state_sha256(m) == summary["state_sha256"]
    mine = [digits.batch(s, comm.rank, comm.size, cfg) for s in range(STEPS, STEPS - RECOMPUTE, -1)]
    want = reference(m, mine, comm)
    got = statistics(m)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), \
        f"statistics differ from update_bn's by {float((got - want).abs().max()):.3g}"
    assert int(m.bn1.num_batches_tracked) == RECOMPUTE
    plain = statistics(runs["diloco"][1])
    assert not torch.allclose(got, plain, rtol=1e-3), "the statistics were not recomputed"


def small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10))


def my_batches(step, n=8):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(n, 1, 8, 8, generator=g) * (1 + RANK), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("at", ["end", "sync"])
def test_in_the_users_loop_the_statistics_are_update_bns_averaged(comm, at):
    """The user's loop: the context's batches a list (iterated afresh each time); with ``at = "sync"`` the
    statistics after an outer step already are the recomputed ones, and at the end too."""
    model = small_cnn()
    held = [my_batches(100 + i) for i in range(3)]
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), comm, period=3,
                 bn_recompute=2, bn_recompute_at=at, context=lowcomm.Context(batches=held))
    for step in range(1, 7):
        x, y = my_batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 3:
            after_sync = statistics(model)
            want = reference(model, held[:2], comm)
            if at == "sync":
                assert torch.allclose(after_sync, want, rtol=1e-4, atol=1e-6)
            else:
                assert not torch.allclose(after_sync, want, rtol=1e-3)
    x, y = my_batches(7)                  # a partial period: the end averages the weights first
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.finish()
    got, want = statistics(model), reference(model, held[:2], comm)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), \
        f"statistics differ from update_bn's by {float((got - want).abs().max()):.3g}"
    hashes = comm.allgather_object(state_sha256(model))
    assert len(set(hashes)) == 1, "the ranks' whole states differ"
    opt.close()


def test_a_function_of_the_step_gets_the_steps_taken(comm):
    model = small_cnn()
    seen = []

    def batches(t):
        seen.append(t)
        return (my_batches(s) for s in range(t, 0, -1))
    opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), comm, period=2,
                   bn_recompute=3, context=lowcomm.Context(batches=batches))
    for step in range(1, 6):
        x, y = my_batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    assert seen == [5]
    want = reference(model, [my_batches(s) for s in (5, 4, 3)], comm)
    assert torch.allclose(statistics(model), want, rtol=1e-4, atol=1e-6)
    opt.close()


def test_recompute_without_batches_or_batchnorm_is_refused_at_build(comm):
    model = small_cnn()
    with pytest.raises(ArgumentError, match="context.batches"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, period=2, bn_recompute=4)
    mlp = torch.nn.Linear(3, 2)
    with pytest.raises(ArgumentError, match="bn_recompute.*no BatchNorm"):
        DiLoCo(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), comm, period=2, bn_recompute=4,
               context=lowcomm.Context(batches=[torch.zeros(1, 3)]))


def test_an_exhausted_iterator_is_an_error_naming_the_batches_on_every_rank(comm):
    model = small_cnn()
    once = iter([my_batches(50)])
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), comm, period=1,
                 bn_recompute=1, bn_recompute_at="sync", context=lowcomm.Context(batches=once))
    x, y = my_batches(1)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()                            # the first sync takes the one batch
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    before = statistics(model)
    with pytest.raises(ArgumentError, match="context.batches.*no batch"):
        opt.step()
    assert torch.equal(statistics(model), before), "a failed recompute changed the statistics"
    opt.close()
