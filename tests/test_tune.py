"""``lowcomm compare --tune``: the grid, which keys apply to which method, the pick (a diverged
value never wins), the cost stated, and one real tuned comparison on 2 ranks."""
import json
import math

import pytest

from conftest import cli, shared_mpi_suite
from lowcomm.run.api import load_config
from lowcomm.tools import tune
from lowcomm.tools.compare import methods


def test_parse_reads_values_as_set_does_and_names_what_is_wrong():
    assert tune.parse(["lr=1e-4,3e-4", "strategy.outer_lr=0.7", "optimizer.name=sgd,adamw"]) == {
        "lr": [1e-4, 3e-4], "strategy.outer_lr": [0.7], "optimizer.name": ["sgd", "adamw"]}
    for specs, says in ((["lr="], "lr has no values"), (["lr=1e-3,,2e-3"], "empty value"),
                        (["lr=0.001,1e-3"], "more than once"), (["lr"], "KEY=V1,V2"),
                        (["=1,2"], "KEY=V1,V2"), (["lr=1", "lr=2"], "given twice")):
        with pytest.raises(ValueError, match=says):
            tune.parse(specs)


def test_the_grid_is_every_combination_and_each_point_reads_back_as_an_override():
    g = tune.grid({"lr": [1e-4, 3e-4], "strategy.outer_lr": [0.5, 0.7]})
    assert g == [{"lr": 1e-4, "strategy.outer_lr": 0.5}, {"lr": 1e-4, "strategy.outer_lr": 0.7},
                 {"lr": 3e-4, "strategy.outer_lr": 0.5}, {"lr": 3e-4, "strategy.outer_lr": 0.7}]
    assert tune.grid({}) == [{}]
    point = {"lr": 1e-05, "strategy.overlap": False, "optimizer.name": "sgd"}
    assert tune.sets(point) == ["lr=1e-05", "strategy.overlap=false", 'optimizer.name="sgd"']
    cfg = load_config(None, ["strategy.name=diloco", *tune.sets(point)])
    assert (cfg.lr, cfg.strategy["overlap"], cfg.optimizer.name) == (1e-05, False, "sgd")
    assert tune.label({"lr": 0.0003, "strategy.outer_lr": 0.7}) == "lr=0.0003_strategy.outer_lr=0.7"


def _cfg(method):
    return load_config(None, methods()[method])


def test_a_key_a_method_lacks_is_not_tuned_for_it_and_one_no_method_has_is_an_error():
    assert tune.applies(_cfg("diloco"), "strategy.outer_lr") is None
    assert "syncdp has no setting outer_lr" in tune.applies(_cfg("ddp"), "strategy.outer_lr")
    assert tune.applies(_cfg("ddp"), "lr") is None
    assert tune.applies(_cfg("topk"), "compressor.ratio") is None
    assert "no compressor" in tune.applies(_cfg("ddp"), "compressor.ratio")
    # a per-level policy: a key of one of its levels' methods applies
    assert tune.applies(_cfg("dc-diloco"), "strategy.outer_lr") is None
    load = lambda o: load_config(None, o)     # noqa: E731
    plan = tune.plan(load, {m: methods()[m] for m in ("ddp", "diloco")},
                     {"lr": [1e-3, 3e-3], "strategy.outer_lr": [0.5, 0.7]}, ["steps=10"])
    assert plan["ddp"]["keys"] == {"lr": [1e-3, 3e-3]} and len(plan["ddp"]["points"]) == 2
    assert "outer_lr" in plan["ddp"]["not_tuned"]["strategy.outer_lr"]
    assert len(plan["diloco"]["points"]) == 4 and not plan["diloco"]["not_tuned"]
    with pytest.raises(ValueError, match="strategy.outer_lr is a setting of none of the methods"):
        tune.plan(load, {"ddp": methods()["ddp"]}, {"strategy.outer_lr": [0.5]}, [])
    with pytest.raises(ValueError, match="lr=fast for ddp: config key 'lr'"):
        tune.plan(load, {"ddp": methods()["ddp"]}, {"lr": [1e-3, "fast"]}, [])
    with pytest.raises(ValueError, match="no_such_key"):
        tune.plan(load, {"ddp": methods()["ddp"]}, {"no_such_key": [1]}, [])


def _run(values, status="ok", eval_loss=None, final_loss=2.0, steps=5, cpu=1.0, error=None):
    return {"values": values, "status": status, "eval_loss": eval_loss, "final_loss": final_loss,
            "steps": steps, "compute_cpu_s": cpu, "wall_s": 2.0, **({"error": error} if error else {})}


def test_the_lowest_finite_eval_loss_wins_and_a_diverged_or_failed_value_never_does():
    runs = [_run({"lr": 1e-2}, "diverged", error="non-finite loss"),
            _run({"lr": 3e-3}, "failed", error="exit 1: NaN"),
            _run({"lr": 1e-3}, eval_loss=3.1), _run({"lr": 3e-4}, eval_loss=2.9),
            _run({"lr": 1e-4}, eval_loss=3.5)]
    assert tune.best(runs) == 3
    assert tune.best(runs[:2]) is None
    # a task without held-out batches: the train loss decides
    assert tune.best([_run({"lr": 1}, final_loss=3.0), _run({"lr": 2}, final_loss=2.5)]) == 1
    assert tune.cost(runs) == {"runs": 5, "steps": 25, "compute_cpu_s": 5.0, "wall_s": 10.0}


def test_a_finished_run_whose_loss_is_not_finite_diverged(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(
        {"eval_loss": float("nan"), "final_loss": 3.0, "steps": 5, "steps_done": 5, "compute_cpu_s": 1.5}))
    got = tune.outcome({"status": "ok"}, tmp_path, 3.0)
    assert got["status"] == "diverged" and "non-finite" in got["error"] and got["steps"] == 5
    (tmp_path / "summary.json").unlink()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "compute_cpu_s": 0.7}) + "\n")
    got = tune.outcome({"status": "failed", "error": "exit 1: non-finite loss"}, tmp_path, 2.0)
    assert (got["status"], got["steps"], got["compute_cpu_s"]) == ("failed", 3, 0.7)


def test_a_sweep_where_every_value_diverged_chooses_nothing_and_says_so(tmp_path):
    planned = {"keys": {"lr": [1.0, 10.0]}, "not_tuned": {}, "points": tune.grid({"lr": [1.0, 10.0]})}

    def run(point, name):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(
            {"eval_loss": math.inf, "final_loss": math.inf, "steps": 4, "compute_cpu_s": 0.5}))
        return {"status": "ok"}, folder
    t = tune.sweep("ef-sign", planned, 4, run)
    assert t["chosen"] is None and [r["status"] for r in t["runs"]] == ["diverged", "diverged"]
    assert t["cost"]["runs"] == 2 and t["cost"]["steps"] == 8
    assert "every tuned value diverged" in tune.failure(t) and "lr=10.0" in tune.failure(t)
    md = tune.table([{"method": "ef-sign", "tuning": t}])
    assert "| ef-sign | none: every value diverged | lr=1.0: diverged, lr=10.0: diverged |" in md, md
    md = tune.table([{"method": "ef-sign", "tuning": {**t, "interrupted": True}}])
    assert "| ef-sign | none: the sweep was stopped |" in md, md


def test_compare_checks_tune_before_anything_runs(tmp_path):
    for args, says in ((("--tune", "lr=fast"), "lr=fast for ddp"), (("--tune", "lr="), "no values"),
                       (("--tune", "strategy.outer_lr=0.5"), "none of the methods"),
                       (("--tune-steps", "3"), "needs --tune")):
        r = cli("compare", "--np", "2", "--methods", "ddp", "--out", tmp_path, *args)
        assert r.returncode == 2 and "--tune" in r.stderr and says in r.stderr, (args, r.output)
    assert not any(tmp_path.iterdir())


def test_a_tuned_comparison_runs_each_method_at_its_best_value_and_states_the_cost(tmp_path):
    """2 ranks, ddp and diloco, lr at two values (one far too small to learn in 4 steps) and
    diloco's outer_lr (not ddp's): each method's run is at the value whose sweep ended with the
    lowest eval loss, and the sweep's runs, steps and seconds are in results.json, tuning.json
    and the table."""
    from test_compare import compare as run_compare
    r = run_compare(tmp_path, "--methods", "ddp,diloco", "--steps", "6", "--tune", "lr=1e-6,3e-2",
                    "--tune", "strategy.outer_lr=0.7", "--tune-steps", "4", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    results = {x["method"]: x for x in json.loads((tmp_path / "results.json").read_text())}
    for m, x in results.items():
        t = x["tuning"]
        losses = {json.dumps(run["values"]): run["eval_loss"] for run in t["runs"]}
        assert len(losses) == 2 and all(run["status"] == "ok" for run in t["runs"]), t
        best = min(t["runs"], key=lambda run: run["eval_loss"])["values"]
        assert t["chosen"] == best and best["lr"] == 3e-2, t
        # each sweep run is a run of its own, of the steps asked, at its values
        for run in t["runs"]:
            folder = tmp_path / "tune" / m / tune.label(run["values"])
            summary = json.loads((folder / "summary.json").read_text())
            cfg = json.loads((folder / "config.json").read_text())
            assert summary["eval_loss"] == run["eval_loss"] and run["steps"] == 4
            assert cfg["lr"] == run["values"]["lr"] and cfg["steps"] == 4
            assert run["compute_cpu_s"] == summary["compute_cpu_s"] > 0
        # the comparison's run trains at the chosen values, for the comparison's steps
        cfg = json.loads((tmp_path / m / "config.json").read_text())
        assert cfg["lr"] == 3e-2 and cfg["steps"] == 6 and x["steps"] == 6
        assert t["cost"] == tune.cost(t["runs"]) and t["cost"]["runs"] == 2 and t["cost"]["steps"] == 8
    assert results["diloco"]["tuning"]["chosen"]["strategy.outer_lr"] == 0.7
    assert json.loads((tmp_path / "diloco" / "config.json").read_text())["strategy"]["outer_lr"] == 0.7
    assert "strategy.outer_lr" in results["ddp"]["tuning"]["not_tuned"]
    total = json.loads((tmp_path / "tuning.json").read_text())["total"]
    assert total["runs"] == 4 and total["steps"] == 16
    assert total["compute_cpu_s"] == pytest.approx(sum(x["tuning"]["cost"]["compute_cpu_s"]
                                                       for x in results.values()), abs=1e-3)
    assert "| ddp | lr=0.03 |" in r.stdout and "| total | | | | 4 | 16 |" in r.stdout, r.stdout
    assert "tuning spent 4 runs, 16 steps" in r.stdout


@pytest.mark.mpi_checks("check_compare_defaults.py", np=2, timeout=600, case_timeout=240)
def test_every_method_trains_at_its_compare_settings_without_diverging():
    """tests/mpi/check_compare_defaults.py: every registered method and compressor, the byte LM;
    the sign and 1-bit ones also a transformers GPT-2."""
    cases = shared_mpi_suite(2, "check_compare_defaults.py")
    assert any("built_in_task_at_its_compare_settings[ef-sign]" in n for n in cases)
    assert any("transformers_gpt2_at_its_compare_settings[demo]" in n for n in cases)
