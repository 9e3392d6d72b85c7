"""Pipeline parallelism (``pp``): its 2-rank checks under real mpirun (tests/mpi/check_pipeline.py,
each case asserted on every rank), ``lowcomm train`` with it (resume bit for bit and on another
split, the NaN policy, evaluation, the bubble in the metrics), and the cut and the settings in
one process; a killed pipeline rank under ``--max-restarts``."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT
from lowcomm.errors import ConfigError
from lowcomm.parallel.pipeline import bubble_formula
from lowcomm.parallel.stages import balanced, parse_split
from lowcomm.run.api import load_config
from lowcomm.run.evaluate import dict_sha256
from split_helpers import (RUN, assert_checks_ran, assert_refused_across_datacenters,
                           assert_resumes_on_two_and_one_rank, metrics, run_train, same_losses,
                           summary)


@pytest.mark.mpi_checks("check_pipeline.py", np=2, timeout=300)
def test_pipeline_on_two_ranks():
    assert_checks_ran("check_pipeline.py", (
        "test_pp_equals_one_process_on_the_whole_batch[gpt2]",
        "test_pp_equals_one_process_on_the_whole_batch[llama]",
        "test_every_schedule_of_this_torch_trains_the_same_model[ZBVZeroBubble]",
        "test_clipping_by_the_norm_over_every_stage_equals_torchs_on_the_whole_model[gpt2]",
        "test_activations_and_their_gradients_are_charged_per_boundary",
        "test_a_stage_resumes_bit_for_bit_from_its_state"))


SETS = ["strategy.name=pp", "strategy.microbatches=4", "model.n_layers=4", *RUN]


def train(np_, out, *sets, resume=None, base=SETS):
    return run_train(np_, out, base, *sets, resume=resume)


def test_lowcomm_train_with_pp_resumes_bit_for_bit_and_on_one_rank(tmp_path):
    """2 stages, 10 steps with a checkpoint every 5: the run's model is on every rank
    (ranks_agree), its metrics carry the bubble beside its formula; the run resumed from step 5
    on 2 ranks ends with the same model bit for bit, and on 1 rank (a pipeline of one stage:
    the stages' states merged by name) with the same losses to float tolerance, and with
    nothing left to train (steps=5) with the stages' saved tensors bit for bit."""
    full = tmp_path / "full"
    r = train(2, full)
    assert r.returncode == 0, r.output
    first = summary(full)
    assert first["ranks_agree"] is True and first["steps"] == 10
    lines = metrics(full)
    assert lines[-1]["pp_bubble_formula"] == bubble_formula("1F1B", 2, 4) == 1 / 5
    assert 0 < lines[-1]["pp_bubble"] < 1 and "eval_loss" in lines[-1]
    assert_resumes_on_two_and_one_rank(train, full, tmp_path)
    last = tmp_path / "last"            # PP 2 → 1 with nothing left to train: the model unchanged
    shutil.copytree(full, last)
    (last / "summary.json").unlink()
    r = train(1, last, "steps=5", resume=last)
    assert r.returncode == 0, r.output
    resumed = summary(last)
    assert resumed["resizes"] == [{"step": 5, "from": 2, "to": 1}]
    stages = [torch.load(full / "checkpoints" / f"step-{5:08d}" / f"rank-{r:05d}.pt",
                         weights_only=False)["model"] for r in range(2)]
    saved = dict(stages[0])                       # the stages' keys in the model's order
    saved.update({k: v for k, v in stages[1].items() if k not in saved})
    assert resumed["state_sha256"] == dict_sha256(saved)


def test_a_killed_pipeline_rank_under_max_restarts_resumes_and_ends_bit_identical(tmp_path):
    """Stage 1's rank SIGKILLed at step 7 of 10 under ``--max-restarts 1``: the run restarts from
    its checkpoint at step 5 and ends with the model of the same run never killed, bit for
    bit."""
    fired, killed, plain = tmp_path / "fired", tmp_path / "killed", tmp_path / "plain"
    assert train(2, plain, "checkpoint.every=0").returncode == 0
    sets = [a for o in SETS for a in ("--set", o)]
    r = subprocess.run([sys.executable, "-m", "lowcomm.cli", "train", "--np", "2", "--max-restarts",
                        "1", "--launcher", str(ROOT / "tests" / "launchers" / "faulty.sh"),
                        "--quiet", "--out", str(killed), *sets], cwd=ROOT, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "LOWCOMM_FAULT": "kill:1:7", "LOWCOMM_FAULT_AT": "batch",
                            "LOWCOMM_FAULT_ONCE": str(fired)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert fired.exists(), "the fault never happened"
    s = json.loads((killed / "summary.json").read_text())
    assert s["restarts"] == 1 and s["steps"] == 10, s
    assert s["state_sha256"] == json.loads((plain / "summary.json").read_text())["state_sha256"]


def test_diloco_between_two_datacenters_of_two_stage_pipelines_equals_unsplit_diloco(tmp_path):
    """``topology=dc:2,rank:2``, ``policy.rank=pp``, ``policy.dc=diloco``: each rank keeps the
    outer state of its stage only and averages it with the same stage of the other datacenter.
    The same losses (training and held-out, every logged step, to 1e-5) as DiLoCo between two
    datacenters of one rank each holding the whole model; each rank sends less across the
    datacenters (the cross-datacenter traffic is spread over the stages)."""
    common = ["policy.dc=diloco:period=5", "eval_every=5", "checkpoint.every=0"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    base = [x for x in SETS if x != "strategy.name=pp"]
    r = train(4, split, "topology=dc:2,rank:2", "policy.rank=pp", *common, base=base)
    assert r.returncode == 0, r.output
    r = train(2, whole, "topology=dc:2,rank:1", *common,
              base=[x for x in base if not x.startswith("strategy.")])
    assert r.returncode == 0, r.output
    same_losses(metrics(split), metrics(whole))
    s, w = summary(split), summary(whole)
    assert s["ranks_agree"] is True and w["ranks_agree"] is True
    assert s["bytes_by_level"]["dc"] / 4 < w["bytes_by_level"]["dc"] / 2


def test_pp_across_datacenters_is_refused_naming_the_key():
    assert_refused_across_datacenters("pp")


TASK = textwrap.dedent('''
    """An MLP as nn.Sequential (every layer a block), its loss a criterion; the batch of step
    ``bad`` holds a NaN."""
    import torch
    import torch.nn.functional as F

    def model(cfg):
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                     for _ in range(4)))

    def criterion(out, y):
        return F.mse_loss(out, y)

    def loss(model, batch):
        return criterion(model(batch[0]), batch[1])

    def batch(step, rank, world, cfg):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(cfg.batch_size, 8, generator=g), torch.randn(cfg.batch_size, 8, generator=g)
        if step == cfg.task.options.get("bad", 0):
            x[0, 0] = float("nan")
        return x, y
''')


@pytest.mark.parametrize("policy", ["skip", "abort"])
def test_a_non_finite_step_under_pp_follows_the_nan_policy(tmp_path, policy):
    """A user's task (an nn.Sequential, its own criterion): the NaN of step 3 reaches the
    last stage's loss; ``skip``: every stage skips that step together; ``abort``: the job ends
    naming the step."""
    task = tmp_path / "task.py"
    task.write_text(TASK)
    out = tmp_path / "run"
    r = run_train(2, out, ("strategy.name=pp", "strategy.microbatches=2", "batch_size=4",
                           f"task={task}", "task.bad=3", "steps=6", f"on_nonfinite={policy}",
                           "log_every=3"))
    if policy == "skip":
        assert r.returncode == 0, r.output
        s = summary(out)
        assert s["skipped_steps"] == 1 and s["ranks_agree"] is True
    else:
        assert r.returncode != 0 and "at step 3: non-finite values" in r.output, r.output


def test_balanced_cut_minimises_the_largest_stage():
    assert balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7, 9]     # 15, 13, 17
    assert balanced([3, 3], 2) == [0, 1, 2]


@pytest.mark.parametrize("text, ok", [("params", ("params", [])), ("every:2", ("every", [2])),
                                      ("at:2,transformer.h.5", ("at", [2, "transformer.h.5"])),
                                      ("every:0", None), ("evenly", None), ("at:", None)])
def test_split_settings_parse_or_name_the_key(text, ok):
    if ok is None:
        with pytest.raises(ConfigError, match="strategy.split"):
            parse_split(text)
    else:
        assert parse_split(text) == ok


@pytest.mark.parametrize("sets, key, words", [
    (["strategy.microbatches=3", "batch_size=8"], "strategy.microbatches", "do not divide"),
    (["strategy.schedule=Zigzag"], "strategy.schedule", "no schedule"),
    (["strategy.split=thirds"], "strategy.split", "is no split"),
    (["strategy.schedule=ZBVZeroBubble", "strategy.stages_per_rank=3"],
     "strategy.stages_per_rank", "2 stages per rank"),
])
def test_bad_pp_settings_name_the_key_before_any_rank_starts(sets, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["strategy.name=pp", *sets])
    assert e.value.key == key and words in str(e.value), str(e.value)
