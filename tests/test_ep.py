"""Expert parallelism as a method (``ep``) under ``lowcomm train``: against the same MoE trained
in one process, DiLoCo and SyncDP over it against the unsplit model, checkpoints resumed bit
for bit and on another degree, and the refusals. The step itself on 2 and 4 ranks is checked
in tests/mpi/check_experts.py.

Tolerance 1e-5 (absolute, on losses of about 5.5): an expert's rows of every rank run in one
call under ep and one rank at a time in the reference, so float32 sums differ in order only."""
import json
import shutil

import pytest
import torch

from conftest import run_ranks
from lowcomm.errors import ConfigError
from lowcomm.parallel.ep import METHOD, ExpertSettings
from lowcomm.parallel.experts import moe_layers
from lowcomm.run.api import load_config
from lowcomm.run.schedule import build_optimizer, lr_at, set_lr
from lowcomm.run.snapshot import seed_all
from lowcomm.strategies.method import Context
from lowcomm.tasks import load_task

TOL = 1e-5
MOE = ["task=lowcomm.tasks.moe", "task.experts=4", "task.top_k=2", "task.capacity_factor=1.0",
       "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "data.seq_len=8",
       "batch_size=2", "eval_batches=1", "data.path=/usr/share/common-licenses"]


def train(np_, out, *sets, resume=None):
    args = [a for o in (*MOE, *sets) for a in ("--set", o)]
    r = run_ranks(np_, "lowcomm", "train", "--quiet", "--out", out, *args,
                  *(["--resume", resume] if resume else []), timeout=240)
    assert r.returncode == 0, r.output
    return json.loads((out / "summary.json").read_text())


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def one_process(sets, worlds, eval_every=0):
    """The MoE task trained in one process as the loop trains it, step t on the ``worlds[t-1]``
    ranks' batches: the loss (1/K) Σ_r L_r of rank r's batch each (each rank's tokens routed
    as their own group, under their own capacity), its gradient, the run's optimizer and lr.
    Returns per step (mean loss, dropped assignments summed over the ranks and layers, the
    held-out loss every ``eval_every`` steps, else None)."""
    cfg = load_config(None, [*MOE, *sets])
    task = load_task(cfg.task.name)
    seed_all(cfg.seed)
    model = task.model(cfg)
    opt = build_optimizer(cfg, model.parameters())
    held_out = list(task.eval_batches(cfg))[:cfg.eval_batches]
    out = []
    for t, K in enumerate(worlds, start=1):
        opt.zero_grad()
        losses, dropped = [], 0
        for r in range(K):
            losses.append(task.loss(model, task.batch(t, r, K, cfg)))
            dropped += sum(m.dropped for m in moe_layers(model))
        (sum(losses) / K).backward()
        set_lr(opt, lr_at(cfg, t))
        opt.step()
        ev = None
        if eval_every and t % eval_every == 0:
            with torch.no_grad():
                ev = sum(float(task.loss(model, b)) for b in held_out) / len(held_out)
        out.append((float(sum(x.detach() for x in losses)) / K, dropped, ev))
    return out


def test_ep_on_two_ranks_equals_the_moe_trained_in_one_process(tmp_path):
    """``strategy.name=ep`` on 2 ranks, 6 steps: each step's loss (mean over the ranks) and
    dropped assignments as one process computes them; the whole model on every rank at the end,
    the all-to-all's rows per direction in the ledger."""
    sets = ["strategy.name=ep", "steps=6", "log_every=1", "eval_every=3"]
    summary = train(2, tmp_path / "ep", *sets)
    want = one_process(sets, [2] * 6, eval_every=3)
    got = metrics(tmp_path / "ep")
    assert [x["step"] for x in got] == list(range(1, 7))
    for line, (loss, dropped, ev) in zip(got, want):
        assert abs(line["loss"] - loss) < TOL, line["step"]
        assert line["ep_dropped"] == dropped, line["step"]
        assert (ev is None) == ("eval_loss" not in line) and (ev is None or
                                                               abs(line["eval_loss"] - ev) < TOL)
    assert sum(d for _, d, _ in want) > 0                   # capacity 1.0 drops some
    assert summary["ranks_agree"] is True
    assert abs(summary["ep_dropped_per_step"] - sum(d for _, d, _ in want) / 6) < 1e-9
    ops = {row["op"] for row in summary["ledger_rank0"]}
    assert {"alltoall.dispatch", "alltoall.combine", "alltoall.dispatch.grad",
            "alltoall.combine.grad"} <= ops


def test_an_ep_run_resumes_bit_for_bit_and_on_one_rank(tmp_path):
    """6 steps with a checkpoint every 3 on 2 ranks (the last step writes none); resumed from
    step 3 on 2 ranks: the same model bit for bit and the same metrics; on 1 rank (the experts
    joined by name, with their Adam moments): the losses of one process that takes 2 ranks'
    batches to step 3, then 1 rank's."""
    sets = ["strategy.name=ep", "steps=6", "log_every=1", "checkpoint.every=3"]
    full = tmp_path / "full"
    summary = train(2, full, *sets)
    for np_ in (2, 1):
        again = tmp_path / f"again{np_}"
        shutil.copytree(full, again)
        shutil.rmtree(again / "checkpoints" / f"step-{6:08d}", ignore_errors=True)
        (again / "summary.json").unlink()
        resumed = train(np_, again, *sets, resume=again)
        if np_ == 2:
            assert resumed["state_sha256"] == summary["state_sha256"]
            assert [x["loss"] for x in metrics(again)] == [x["loss"] for x in metrics(full)]
            assert resumed["ep_dropped_per_step"] == summary["ep_dropped_per_step"]
        else:
            assert resumed["resizes"] == [{"step": 3, "from": 2, "to": 1}]
            want = one_process(sets, [2, 2, 2, 1, 1, 1])
            for line, (loss, _, _) in zip(metrics(again), want):
                assert abs(line["loss"] - loss) < TOL, line["step"]


def test_diloco_between_datacenters_of_ep_pairs_equals_it_over_data_parallel_pairs(tmp_path):
    """``topology=dc:2,rank:2``, ``policy.rank=ep``, ``policy.dc=diloco``: each rank keeps the
    outer state of its experts and the dense part only and averages it with the same rank of
    the other datacenter. The same losses, training and held-out, as DiLoCo between the same
    datacenters of data-parallel pairs holding the whole model (``policy.rank=syncdp``)."""
    common = ["topology=dc:2,rank:2", "policy.dc=diloco:period=3", "steps=6", "log_every=3",
              "eval_every=3"]
    split = train(4, tmp_path / "ep", *common, "policy.rank=ep")
    train(4, tmp_path / "dp", *common, "policy.rank=syncdp")
    ours, theirs = metrics(tmp_path / "ep"), metrics(tmp_path / "dp")
    assert [x["step"] for x in ours] == [x["step"] for x in theirs] == [3, 6]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) < TOL and abs(a["eval_loss"] - b["eval_loss"]) < TOL
    assert split["ranks_agree"] is True and split["inner"]["strategy"] == "ep"
    assert split["bytes_by_level"]["dc"] > 0 and split["bytes_by_level"]["rank"] > 0
    cfg = load_config(None, MOE)                  # the outer state: the dense part + 2 of 4 experts
    model = load_task(cfg.task.name).model(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert split["sharded"] is True
    assert split["fragment_numel"] == [split["params"] - experts // 2]


def test_syncdp_between_ep_pairs_equals_the_moe_trained_in_one_process(tmp_path):
    """``topology=node:2,rank:2``, ``policy.node=syncdp``, ``policy.rank=ep``: two
    expert-parallel pairs, each rank averaging its gradients with the rank holding the same
    experts in the other pair; rank r of the 4 takes batch r. The same losses, training and
    held-out, as one process on the 4 ranks' batches."""
    sets = ["topology=node:2,rank:2", "policy.node=syncdp", "policy.rank=ep", "steps=6",
            "log_every=3", "eval_every=3"]
    summary = train(4, tmp_path / "ep", *sets)
    want = one_process(sets, [4] * 6, eval_every=3)
    got = metrics(tmp_path / "ep")
    assert [x["step"] for x in got] == [3, 6]
    for line in got:
        t = line["step"]
        assert abs(line["loss"] - sum(w[0] for w in want[t - 3:t]) / 3) < TOL, t
        assert abs(line["eval_loss"] - want[t - 1][2]) < TOL, t
        assert abs(line["ep_dropped"] - sum(w[1] for w in want[t - 3:t]) / 3) < 1e-9, t
    assert summary["ranks_agree"] is True and summary["bytes_by_level"]["node"] > 0


@pytest.mark.parametrize("sets, key, words", [
    (["fleet.dcs=2", "topology=dc:2,rank:2", "policy.dc=ep", "policy.rank=syncdp"],
     "policy.dc", "innermost per-step level only"),
    (["topology=node:2,rank:2", "policy.node=tp", "policy.rank=ep"], "policy.node",
     "two levels that split the model in one job"),
])
def test_ep_across_datacenters_or_beside_another_split_is_refused_naming_the_key(sets, key, words):
    with pytest.raises(ConfigError, match=words) as e:
        load_config(None, sets)
    assert e.value.key == key


def test_ep_on_a_model_without_moe_layers_is_refused_naming_the_task():
    cfg = load_config(None, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                             "data.seq_len=8"])
    model = load_task(cfg.task.name).model(cfg)
    with pytest.raises(ConfigError, match="has no MoE layer") as e:
        METHOD.build(ExpertSettings(), model, torch.optim.AdamW(model.parameters()), None,
                     Context())
    assert e.value.key == "task"
