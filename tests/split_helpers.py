"""Shared by the tests of the methods that split the model (tests/test_pipeline.py,
tests/test_tensor.py): their 2-rank check files under mpirun, ``lowcomm train`` runs, and the
comparisons of two runs' logs."""
import json
import shutil

import pytest

from conftest import run_ranks, shared_mpi_suite
from lowcomm.errors import ConfigError
from lowcomm.run.api import load_config


#: the ``lowcomm train`` settings both files' runs share: a tiny byte LM, 10 steps, a log line,
#: an evaluation and a checkpoint every 5
RUN = ["batch_size=8", "model.d_model=32", "data.seq_len=16", "eval_batches=2", "eval_every=5",
       "log_every=5", "checkpoint.every=5", "steps=10"]


def assert_checks_ran(check_file: str, names) -> None:
    """Run ``check_file`` on 2 ranks (the shared mpirun) and assert each case of ``names`` ran."""
    cases = shared_mpi_suite(2, check_file)
    for name in names:
        assert f"{check_file}::{name}" in cases


def run_train(np_, out, base, *sets, resume=None):
    """``lowcomm train`` on ``np_`` ranks into ``out`` with the ``--set`` values ``base`` then
    ``sets``, resumed from ``resume`` where given."""
    args = [a for o in (*base, *sets) for a in ("--set", o)]
    return run_ranks(np_, "lowcomm", "train", "--quiet", "--out", out, *args,
                     *(["--resume", resume] if resume else []), timeout=240)


def copy_at_step_5(full, again) -> None:
    """``full``'s run folder copied to ``again`` as it stood after its step-5 checkpoint (the
    one at step 10 and the summary removed), to be resumed."""
    shutil.copytree(full, again)
    shutil.rmtree(again / "checkpoints" / f"step-{10:08d}", ignore_errors=True)
    (again / "summary.json").unlink()


def assert_resumes_on_two_and_one_rank(train, full, tmp_path, *sets) -> None:
    """``full``, a 2-rank run of 10 steps checkpointed at 5, resumed from step 5 with
    ``train(np_, out, *sets, resume=out)``: on 2 ranks it ends with the same model bit for bit;
    on 1 (the split undone) it records the resize and ends with the same loss to 1e-5."""
    first = summary(full)
    for np_ in (2, 1):
        again = tmp_path / f"again{np_}"
        copy_at_step_5(full, again)
        r = train(np_, again, *sets, resume=again)
        assert r.returncode == 0, r.output
        resumed = summary(again)
        if np_ == 2:
            assert resumed["state_sha256"] == first["state_sha256"]
        else:
            assert resumed["resizes"] == [{"step": 5, "from": 2, "to": 1}]
            assert abs(resumed["final_loss"] - first["final_loss"]) < 1e-5


def metrics(out) -> list[dict]:
    """A run's log lines (metrics.jsonl)."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out) -> dict:
    """A run's summary.json."""
    return json.loads((out / "summary.json").read_text())


def same_losses(ours, theirs) -> None:
    """Two runs' log lines: at steps 5 and 10, the same training and held-out loss to 1e-5."""
    assert [x["step"] for x in ours] == [x["step"] for x in theirs] == [5, 10]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["eval_loss"] - b["eval_loss"]) < 1e-5


def assert_split_run_equals(ours, theirs, level: str) -> dict:
    """The split run in ``ours`` logged the losses of the run in ``theirs`` (:func:`same_losses`),
    ended with the same model on every rank and sent bytes on ``level``; returns its summary."""
    same_losses(metrics(ours), metrics(theirs))
    s = summary(ours)
    assert s["ranks_agree"] is True and s["bytes_by_level"][level] > 0
    return s


def assert_refused(sets, key: str, words: str) -> None:
    """The settings ``sets`` are refused when loaded: a ConfigError naming ``key``, its message
    matching ``words``."""
    with pytest.raises(ConfigError, match=words) as e:
        load_config(None, sets)
    assert e.value.key == key, str(e.value)


def assert_refused_across_datacenters(name: str) -> None:
    """A model-splitting method ``name`` on a fleet's datacenter level is refused naming it
    (inside a fleet's datacenters it runs: tests/test_fleet_split.py)."""
    assert_refused(["fleet.dcs=2", "topology=dc:2,rank:2", f"policy.dc={name}",
                    "policy.rank=syncdp"], "policy.dc", "policy.dc.*innermost")
