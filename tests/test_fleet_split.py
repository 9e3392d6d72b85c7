"""Split models inside a fleet's datacenters (``lowcomm train --dcs``): tensor, pipeline or
expert parallelism on the ranks of each datacenter, DiLoCo across them through the fleet, each rank
exchanging only its own pieces with the same rank of the other datacenters; and a lost
datacenter of split models healed back rank by rank (each rank takes its own pieces)."""
import json
import sys
import time

import pytest

from conftest import ROOT, scaled
from fleet_helpers import Run, assert_healed_once, finished

#: rounds of five 250 ms steps: a relaunch fits in the run (the others also hold for it)
STEPS, PERIOD, STEP_MS = 40, 5, round(scaled(250))
TASK = ROOT / "tests" / "split_fleet_task.py"
BASE = [f"task={TASK}", f"task.step_ms={STEP_MS}", "batch_size=8", "model.d_model=32",
        "model.n_layers=2", "data.seq_len=16", "eval_batches=2", "eval_every=10", "log_every=5",
        "checkpoint.every=0", f"steps={STEPS}", "topology=dc:2,rank:2",
        f"policy.dc=diloco:period={PERIOD},outer_momentum=0.5"]


def _sets(*extra):
    return [a for o in (*BASE, *extra) for a in ("--set", o)]


#: the mixture-of-experts task, its experts spread over each datacenter's ranks (``ep``)
MOE = ["task=lowcomm.tasks.moe", "task.experts=4", "task.top_k=2", "task.capacity_factor=1.0",
       "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "data.seq_len=8",
       "batch_size=2", "eval_batches=1", "data.path=/usr/share/common-licenses", "steps=6",
       "log_every=3", "eval_every=3", "checkpoint.every=0", "topology=dc:2,rank:2",
       "policy.dc=diloco:period=3", "policy.rank=ep"]


def _fleet(out, *extra, base=None):
    sets = [a for o in base for a in ("--set", o)] if base else _sets(*extra)
    return Run(out, [sys.executable, "-m", "lowcomm.cli", "train", "--dcs", "2", "--np", "4",
                     "--place", "local", "--out", str(out), *sets])


def _single(out, sets):
    return Run(out, [str(ROOT / "launchers" / "local.sh"), "-n", "4", "lowcomm", "train",
                     "--quiet", "--out", str(out), *sets])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """At once: tensor-parallel pairs as one MPI job and as a fleet, pipelines of two stages as
    a fleet, tensor-parallel pairs as a fleet whose datacenter 1 fails at step 8 (the other
    holding at step 12 until its relaunch has built its model), and expert-parallel pairs of a
    mixture of experts as one MPI job and as a fleet."""
    tmp = tmp_path_factory.mktemp("split-fleet")
    deadline = time.monotonic() + scaled(240)
    started = {
        "single": _single(tmp / "single", _sets("policy.rank=tp")),
        "ep_single": _single(tmp / "ep_single", [a for o in MOE for a in ("--set", o)]),
        "ep": _fleet(tmp / "ep", base=MOE),
        "tp": _fleet(tmp / "tp", "policy.rank=tp"),
        "pp": _fleet(tmp / "pp", "policy.rank=pp"),
        "healed": _fleet(tmp / "healed", "policy.rank=tp", "task.crash_dc=1",
                         f"task.marks={tmp / 'marks'}", "task.hold_step=12"),
    }
    return {name: (r, *r.wait(deadline)) for name, r in started.items()}


def _dc_bytes(folder, dc):
    s = json.loads((folder / f"dc{dc}" / "summary.json").read_text())
    rank0 = sum(r["bytes_sent"] for r in s["ledger_rank0"] if r["level"] == "dc")
    return rank0, s["bytes_by_level"]["dc"], s


@pytest.mark.parametrize("split", ["tp", "pp", "ep"])
def test_a_fleet_of_split_datacenters_is_the_one_mpi_job_and_each_rank_sends_its_pieces(runs, split):
    """The fleet ends on the model of the same policy run as one MPI job (tensor and expert
    parallelism: bit for bit; pipeline stages: to 1e-5 in the held-out loss, as the pipeline
    equals the unsplit model), every datacenter on the same model; each rank of a datacenter
    sends its own pieces across, so rank 0 sends part of the datacenter's bytes, not all."""
    single = finished(runs["ep_single" if split == "ep" else "single"])
    fl = finished(runs[split])
    s, ref = fl.summary(), single.summary()
    assert s["dcs_agree"] and s["finished_dcs"] == [0, 1], s
    if split != "pp":
        assert s["state_sha256"] == ref["state_sha256"], (s["state_sha256"], ref["state_sha256"])
    assert abs(s["eval_loss"] - ref["eval_loss"]) < 1e-5, (s["eval_loss"], ref["eval_loss"])
    for dc in (0, 1):
        rank0, total, summary = _dc_bytes(fl.out, dc)
        assert summary["ranks_agree"] is True, summary
        assert 0.1 * total <= rank0 <= 0.9 * total, (dc, rank0, total)


def test_a_failed_datacenter_of_split_models_heals_back_rank_by_rank(runs):
    """Datacenter 1 fails at step 8, is relaunched and admitted: each of its ranks takes the
    pieces (of the model and of the outer state) of the same rank of datacenter 0, and the
    fleet ends with both datacenters on one model, as close to the unfaulted fleet as a heal
    allows (2 % of the held-out loss)."""
    fl = finished(runs["healed"])
    assert_healed_once(fl.summary(), runs["tp"][0].summary(), 0.02)
    assert json.loads((fl.out / "dc1.1" / "summary.json").read_text())["ranks_agree"] is True
