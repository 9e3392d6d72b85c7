"""``lowcomm compare``: the same workload under several methods, results, plots and table."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli
from lowcomm.tools.compare import Link, default_topology, methods, needs_topology, resolve_methods
from lowcomm.tools.compare_report import modelled_wall, table

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=2", "log_every=5"]


def compare(tmp_path, *args, timeout=300, env=None):
    sets = [a for s in SMALL for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "lowcomm.cli", "compare", "--np", "2", "--steps", "20", "--out", str(tmp_path),
                           *sets, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown method.*warp.*known: ddp, .*horovod"):
        resolve_methods("ddp,warp")
    assert resolve_methods("ddp,horovod") == ["ddp", "horovod"]
    with pytest.raises(ValueError, match="method.s. ddp given more than once"):
        resolve_methods("ddp,fp16,ddp")          # it ran twice and was listed twice
    assert "ddp" in resolve_methods("all") and set(resolve_methods("all")) <= set(methods())


def test_topology_aware_methods_get_the_launcher_s_datacenter_blocks():
    assert default_topology(4) == "dc:2,rank:2"
    assert default_topology(3) == "dc:2,rank:2+1"
    assert default_topology(6, 3) == "dc:3,rank:2"
    assert needs_topology("dc-diloco") and needs_topology("ddp-hier")
    assert not needs_topology("ddp") and not needs_topology("diloco")


def test_modelled_wall_is_cpu_compute_plus_alpha_beta_never_wall_clock():
    from lowcomm.tools.compare_report import _line_modelled, table
    rows = [{"level": "world", "op": "allreduce.ring", "calls": 10, "bytes_sent": 1_000_000,
             "bytes_recv": 1_000_000, "seconds": 0.5}]
    s = {"method": "ddp", "ledger_rank0": rows, "wall_s": 9.0, "compute_cpu_s": 1.5, "ranks": 4}
    # compute 1.5 CPU s + 10 calls x 2(K-1)=6 rounds x 10 ms + 1 MB at 8 Mbit/s = 1 s
    assert modelled_wall(s, Link(10, 8)) == pytest.approx(1.5 + 0.6 + 1.0)
    busy = {**s, "wall_s": 90.0}     # a machine ten times as busy: the same model
    assert modelled_wall(busy, Link(10, 8)) == modelled_wall(s, Link(10, 8))
    line = {"step": 5, "bytes": 4_000_000, "ranks": 4, "rounds": 60, "wall_s": 50.0, "comm_s": 1.0,
            "compute_cpu_s": 1.5}
    assert _line_modelled(line, Link(10, 8)) == pytest.approx(1.5 + 0.6 + 1.0)
    for bad in ({k: v for k, v in s.items() if k != "compute_cpu_s"}, {**s, "compute_cpu_s": float("nan")}):
        with pytest.raises(ValueError, match="'ddp' has no compute_cpu_s"):
            modelled_wall(bad, Link(10, 8))
    with pytest.raises(ValueError, match="step 5 has no compute_cpu_s"):
        _line_modelled({k: v for k, v in line.items() if k != "compute_cpu_s"}, Link(10, 8))
    md = table([{"method": "ddp", "status": "ok", "eval_loss": 1.0, "final_loss": 1.0, "bytes_total": 1,
                 "wall_s": 9.0, "compute_cpu_s": 1.5, "modelled_wall_s": 3.1, "steps": 20}], Link(10, 8))
    assert "| compute CPU s | modelled s (10 ms, 8 Mbit/s)¹ |" in md and "| 9.0 | 1.5 | 3.1 |" in md
    assert "¹ modelled s = compute CPU s + the α–β time" in md and "do not inflate" in md


def test_compute_cpu_clock_counts_computation_not_waiting_or_communication():
    import time

    from lowcomm.comm.ledger import charge_comm_cpu, comm_cpu_seconds, compute_cpu_clock
    c0 = compute_cpu_clock()
    time.sleep(0.3)                       # descheduled: no CPU time
    assert compute_cpu_clock() - c0 < 0.1
    c0, p0 = compute_cpu_clock(), time.process_time()
    x = 0
    while time.process_time() - p0 < 0.2:  # computing
        x += 1
    assert compute_cpu_clock() - c0 >= 0.19
    m0, c0 = comm_cpu_seconds(), compute_cpu_clock()
    charge_comm_cpu(5.0)                  # what communication calls charge is not computation
    assert comm_cpu_seconds() - m0 == pytest.approx(5.0) and compute_cpu_clock() - c0 < -4.5
    with pytest.raises(ValueError, match="DELAY_MS,RATE_MBIT"):
        Link.parse("fast")


def test_compare_runs_methods_on_the_same_data_and_keeps_going_when_one_fails(tmp_path):
    r = compare(tmp_path, "--methods", "ddp,horovod,fp16", "--repeat", "2", "--relative-to", "ddp",
                "--launcher", ROOT / "tests" / "launchers" / "fail_method.sh",
                env={"LOWCOMM_TEST_FAIL_ARG": "compressor.name=fp16"})
    assert r.returncode == 1, r.stdout + r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    by = {x["method"]: x for x in results}
    assert by["fp16"]["status"] == "failed" and "exit 7" in by["fp16"]["error"], by["fp16"]
    ok = [by["ddp"], by["horovod"]]
    assert all(x["status"] == "ok" and x["steps"] == 20 and x["ranks"] == 2 for x in ok), ok
    for x in ok:
        assert {"method", "ranks", "steps", "params", "final_loss", "eval_loss", "bytes_total",
                "bytes_by_level", "wall_s", "modelled_wall_s"} <= set(x)
        assert x["bytes_total"] > 0 and x["eval_loss"] > 0
    for png in ("bytes", "wall", "modelled_wall", "steps"):
        assert (tmp_path / f"eval_loss_vs_{png}.png").stat().st_size > 10_000
    assert "| 1 | " in r.stdout and "fp16 | failed: exit 7" in r.stdout, r.stdout
    # Horovod and lowcomm's SyncDP average the same gradients of the same batches
    assert by["ddp"]["eval_loss"] == pytest.approx(by["horovod"]["eval_loss"], rel=1e-4)
    curves = [[json.loads(x) for x in (tmp_path / m / "metrics.jsonl").read_text().splitlines()]
              for m in ("ddp", "horovod")]
    assert [x["step"] for x in curves[0]] == [x["step"] for x in curves[1]] == [5, 10, 15, 20]
    # the modelled wall-clock comes from the CPU clock of the steps, and the table says so
    for x, curve in zip(ok, curves):
        summary = json.loads((tmp_path / x["method"] / "summary.json").read_text())
        assert 0 < x["compute_cpu_s"] == summary["compute_cpu_s"] < 1e3
        assert x["modelled_wall_s"] == pytest.approx(
            summary["compute_cpu_s"] + Link(25, 100).seconds(summary["ledger_rank0"], 2))
        cpu = [ln["compute_cpu_s"] for ln in curve]
        assert all(0 < c for c in cpu) and cpu == sorted(cpu)
    assert "compute CPU s" in r.stdout and "do not inflate" in (tmp_path / "table.md").read_text()
    assert all("eval_loss" in x for x in curves[0][1::2])      # eval_every = 10 by default
    # two rounds, interleaved: wall s is the median of each method's runs, each run divided by
    # ddp's of its round; a run is the same computation (state hash) every round
    for x in ok:
        again = json.loads((tmp_path / "repeats" / "2" / x["method"] / "summary.json").read_text())
        first = json.loads((tmp_path / x["method"] / "summary.json").read_text())
        assert x["wall_s_runs"] == [first["wall_s"], again["wall_s"]], x
        assert x["wall_s"] == pytest.approx(sum(x["wall_s_runs"]) / 2) and x["repeats_agree"] is True
        assert again["state_sha256"] == first["state_sha256"] and len(x["load_1m_runs"]) == 2
        assert x["wall_ratio"]["runs"] == pytest.approx(
            [a / b for a, b in zip(x["wall_s_runs"], by["ddp"]["wall_s_runs"])]), x
    assert by["ddp"]["wall_ratio"]["runs"] == [1.0, 1.0] and "wall_ratio" not in by["fp16"]
    assert not (tmp_path / "repeats" / "2" / "fp16").exists()      # failed: not run again
    assert "wall s (median of 2 runs: min–max) | wall ÷ ddp's³" in r.stdout, r.stdout


def test_time_to_target_reads_the_first_crossing_of_the_eval_curve():
    from lowcomm.tools.compare_report import table, time_to_target
    curve = [(1.0, 4.0), (2.0, 3.0), (4.0, 2.0), (5.0, 2.5), (6.0, 1.0)]
    assert time_to_target(curve, 3.0) == 2.0            # at an evaluation
    assert time_to_target(curve, 2.5) == pytest.approx(3.0)   # halfway from 3.0 at 2 s to 2.0 at 4 s
    assert time_to_target(curve, 4.5) == 1.0            # already below at the first evaluation
    assert time_to_target(curve, 0.5) is None            # never
    rows = [{"method": m, "status": "ok", "eval_loss": e, "final_loss": e, "bytes_total": b,
             "wall_s": 1.0, "compute_cpu_s": 1.0, "modelled_wall_s": 30.0, "steps": 9000,
             "steps_done": n, "time_to_target_s": t}
            for m, e, b, n, t in (("ddp", 2.5, 100, 80, 30.0), ("diloco", 2.1, 2, 600, 7.25))]
    md = table(rows, Link(25, 100), budget=30, target=2.5)
    assert "| eval loss at 30 s |" in md and "modelled s to eval ≤ 2.5000² |" in md
    assert "| 1 | diloco | 2.1000 | 2.1000 | 600 |" in md and md.rstrip().count("| 7.2") == 1
    assert "| 2 | ddp | 2.5000 | 2.5000 | 80 |" in md and "ddp’s final eval loss" in md
    assert "budget of 30 s" in md


def test_compare_by_time_budget_gives_every_method_the_same_modelled_seconds(tmp_path):
    budget = 4.0
    r = compare(tmp_path, "--methods", "ddp,localsgd", "--budget", budget, "--steps", "5000")
    assert r.returncode == 0, r.stdout + r.stderr
    by = {x["method"]: x for x in json.loads((tmp_path / "results.json").read_text())}
    for m, x in by.items():
        lines = [json.loads(v) for v in (tmp_path / m / "metrics.jsonl").read_text().splitlines()]
        spent = [ln["modelled_s"] for ln in lines]
        assert spent == sorted(spent) and spent[-1] >= budget > spent[-2], (m, spent)
        # the budget's model is the table's: CPU seconds plus the α–β time of the traffic
        assert spent[-1] == pytest.approx(lines[-1]["compute_cpu_s"] + Link(25, 100).traffic_seconds(
            lines[-1]["rounds"], lines[-1]["bytes"] / 2))
        assert x["steps_done"] == lines[-1]["step"] < 5000 and x["steps"] == 5000
        summary = json.loads((tmp_path / m / "summary.json").read_text())
        assert summary["steps_done"] == x["steps_done"] and summary["ranks_agree"] is True
        assert summary["budget"] == {"seconds": budget, "link": "25 ms, 100 Mbit/s", "spent_s": spent[-1]}
        # an evaluation where each tenth of the budget was crossed (the last one at the budget)
        marks = [int(ln["modelled_s"] / budget * 10) for ln in lines if "eval_loss" in ln]
        assert marks == list(range(1, 11)), (m, marks)
        assert x["time_to_target_s"] is None or x["time_to_target_s"] <= x["modelled_wall_s"]
    # Local SGD sends far less per step: in the same modelled time it takes more steps
    assert by["localsgd"]["steps_done"] > 2 * by["ddp"]["steps_done"], by
    # the target is ddp's final eval loss: ddp reaches it, at the latest with its final model
    assert 0 < by["ddp"]["time_to_target_s"] <= by["ddp"]["modelled_wall_s"]
    assert f"eval loss at {budget:g} s" in r.stdout and "modelled s to eval ≤" in r.stdout
    assert f"{budget:g} modelled s (at most 5000 steps) per method" in r.stdout
    # projected to the measured rank count, a run's bytes per step are its own ledger's
    p = subprocess.run([sys.executable, "-m", "lowcomm.cli", "project", str(tmp_path), "--ranks", "2,4096",
                        "--json", str(tmp_path / "projection.json")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    done = {x["name"]: x for x in json.loads((tmp_path / "projection.json").read_text())["projections"]}
    assert set(done) == {"ddp", "localsgd"} and "assumptions: every rank's traffic" in p.stdout
    for m in done:
        summary = json.loads((tmp_path / m / "summary.json").read_text())
        at2 = next(r for r in done[m]["rows"] if r["ranks"] == 2 and r["link"] == "25 ms, 100 Mbit/s")
        assert at2["bytes_per_rank_per_step"] == pytest.approx(
            sum(r["bytes_sent"] for r in summary["ledger_rank0"]) / summary["steps_done"])
        assert done[m]["compute_s"] == pytest.approx(summary["compute_cpu_s"] / summary["steps_done"])


def test_a_budget_refuses_what_it_cannot_keep():
    from lowcomm.errors import ConfigError
    from lowcomm.run.config import load_config
    with pytest.raises(ConfigError, match="budget.seconds.*schedule = \"constant\".*'cosine'"):
        load_config(None, ["budget.seconds=10", "optimizer.schedule=cosine"])
    with pytest.raises(ConfigError, match="budget.link.*DELAY_MS,RATE_MBIT"):
        load_config(None, ["budget.seconds=10", "budget.link=fast"])
    with pytest.raises(ConfigError, match="budget.seconds.*>= 0"):
        load_config(None, ["budget.seconds=-1"])
    assert load_config(None, ["budget.seconds=10", "optimizer.warmup_steps=5"]).budget.seconds == 10


def test_a_later_round_adds_its_run_its_failure_or_its_stop():
    from lowcomm.tools.compare import _another_round
    from lowcomm.tools.compare_report import add_wall_ratios
    first = {"method": "int8", "status": "ok", "wall_s": 10.0, "compute_cpu_s": 9.0,
             "state_sha256": "a", "eval_loss": 2.5}
    two = _another_round(first, {**first, "wall_s": 12.0, "compute_cpu_s": 9.5}, 2)
    three = _another_round(two, {**first, "wall_s": 11.5, "compute_cpu_s": 9.2, "state_sha256": "b"}, 3)
    assert two["wall_s_runs"] == [10.0, 12.0] and two["wall_s"] == 11.0 and two["repeats_agree"]
    assert three["wall_s"] == 11.5 and three["compute_cpu_s_runs"] == [9.0, 9.5, 9.2]
    assert three["repeats_agree"] is False and three["eval_loss"] == 2.5     # the first round's
    failed = _another_round(two, {"method": "int8", "status": "failed", "error": "exit 7: boom"}, 3)
    assert failed["status"] == "failed" and failed["error"] == "round 3: exit 7: boom"
    stopped = _another_round(two, {"method": "int8", "status": "interrupted", "error": "SIGINT"}, 3)
    assert stopped["status"] == "ok" and stopped["interrupted_round"] == 3 and \
        stopped["wall_s_runs"] == [10.0, 12.0]
    ref = {"method": "ddp", "status": "ok", "wall_s": 8.0, "wall_s_runs": [8.0, 10.0, 10.0]}
    kept = {**three, "method": "topk", "wall_ratio": {"to": "fp16", "runs": [1.0], "median": 1.0}}
    results = [ref, three, {**first, "method": "fp16"}, kept]   # fp16: one run, not paired
    add_wall_ratios(results, "ddp", ["ddp", "int8", "fp16"])    # topk: an earlier comparison's
    assert three["wall_ratio"] == {"to": "ddp", "runs": [1.25, 1.2, 1.15], "median": 1.2}
    assert "wall_ratio" not in results[2] and ref["wall_ratio"]["runs"] == [1.0, 1.0, 1.0]
    assert "wall_ratio" not in kept


def test_repeats_refuse_what_they_cannot_do(tmp_path):
    """Rounds below one, and a ratio to a method that does not run, before anything runs."""
    from lowcomm.errors import ConfigError
    from lowcomm.run.config import load_config
    with pytest.raises(ConfigError, match="compare.repeat.*>= 1, got 0"):
        load_config(None, ["compare.repeat=0"])
    r = cli("compare", "--np", "2", "--out", tmp_path, "--methods", "ddp,fp16", "--relative-to", "int8")
    assert r.returncode == 2 and "'int8' is not one of the methods run (ddp, fp16)" in r.stderr, r.output
    r = cli("compare", "--np", "2", "--out", tmp_path, "--methods", "ddp", "--repeat", "0")
    assert r.returncode == 2 and "--repeat" in r.stderr, r.output
    assert not any(tmp_path.iterdir())


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lowcomm.lock"}


def test_ctrl_c_ends_the_comparison_and_a_later_one_adds_to_it(tmp_path):
    """Ctrl-C used to stop only the running method (recorded as 'failed: exit 1') and go on with
    the next; a second comparison into the folder replaced the first's results. Now: the
    finished results are kept, the stopped method is marked interrupted; a later comparison adds
    methods beside them (the failed one's row carries its own error), and refuses to rerun one
    or to mix other settings unless --overwrite, which removes only what lowcomm wrote."""
    sets = [a for s in SMALL for a in ("--set", s)]
    p = subprocess.Popen([sys.executable, "-m", "lowcomm.cli", "compare", "--np", "2", "--steps",
                          "20", "--out", str(tmp_path), *sets, "--methods", "ddp,fp16,int8"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (tmp_path / "fp16" / "command.txt").exists():
        assert time.monotonic() - t0 < 120 and p.poll() is None, "fp16 never started"
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["status"]) for r in results] == [("ddp", "ok"), ("fp16", "interrupted")]
    assert results[1]["error"] == "stopped by SIGINT" and not (tmp_path / "int8").exists()
    assert "| fp16 | interrupted: stopped by SIGINT |" in (tmp_path / "table.md").read_text()
    before = digest(tmp_path)
    r = cli("compare", "--np", "2", "--steps", "20", "--out", tmp_path, *sets, "--methods", "ddp")
    assert r.returncode != 0 and f"{tmp_path} holds results of ddp already: --overwrite runs them " \
        "again" in r.stderr, r.output
    r = cli("compare", "--np", "2", "--steps", "30", "--out", tmp_path, *sets, "--methods", "int8")
    assert r.returncode != 0 and "holds a comparison with other settings (steps: 20 then, 30 now" \
        in r.stderr, r.output
    assert digest(tmp_path) == before, "a refused comparison changed the earlier one"
    # a new method joins; its own error (from its ranks) is in the table, not mpirun's last line
    r = compare(tmp_path, "--methods", "dc-diloco", env={"LOWCOMM_TOPOLOGY": "dc:3,rank:1"})
    assert r.returncode == 1, r.stdout + r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(x["method"], x["status"]) for x in results] == [
        ("ddp", "ok"), ("fp16", "interrupted"), ("dc-diloco", "failed")], results
    error = "EnvError: environment variable LOWCOMM_TOPOLOGY='dc:3,rank:1': 'dc:3,rank:1' places " \
        "3 ranks but the job has 2"
    assert error in results[2]["error"] and f"dc-diloco | failed: exit 1: {error}" in r.stdout, r.stdout
    assert "| 1 | ddp |" in r.stdout, r.stdout
    # other settings on request: the earlier comparison goes, what lowcomm did not write stays
    (tmp_path / "ddp" / "notes.txt").write_text("mine")
    (tmp_path / "elsewhere.txt").write_text("mine")
    r = cli("compare", "--np", "2", "--steps", "20", "--out", tmp_path, *sets, "--methods", "fp16",
            "--overwrite", "--launcher", ROOT / "tests" / "launchers" / "fail_method.sh",
            env={"LOWCOMM_TEST_FAIL_ARG": "compressor.name=fp16"})
    assert r.returncode == 1 and "fp16 | failed: exit 7" in r.stdout, r.output
    assert [x["method"] for x in json.loads((tmp_path / "results.json").read_text())] == ["fp16"]
    assert not (tmp_path / "ddp" / "summary.json").exists() and \
        not (tmp_path / "ddp" / "checkpoints").exists()
    assert (tmp_path / "ddp" / "notes.txt").read_text() == "mine" == \
        (tmp_path / "elsewhere.txt").read_text()


def test_compare_never_takes_over_a_folder_it_did_not_write(tmp_path):
    """A results.json lowcomm compare did not mark, even with --overwrite; a run's folder."""
    (tmp_path / "results.json").write_text("[]")
    for extra in ((), ("--overwrite",)):
        r = cli("compare", "--np", "2", "--out", tmp_path, "--methods", "ddp", *extra)
        assert r.returncode != 0 and f"{tmp_path} holds a results.json but no .lowcomm-compare.json"\
            in r.stderr, r.output
    assert {p.name for p in tmp_path.iterdir()} - {".lowcomm.lock"} == {"results.json"}
    assert (tmp_path / "results.json").read_text() == "[]"
    run = tmp_path / "run"                     # a training run's folder is not a comparison's
    run.mkdir()
    (run / "config.json").write_text("{}")
    r = cli("compare", "--np", "2", "--out", run, "--methods", "ddp")
    assert r.returncode != 0 and f"{run} holds a training run (config.json)" in r.stderr, r.output
    assert {p.name for p in run.iterdir()} - {".lowcomm.lock"} == {"config.json"}


def _summary(rows, ranks=4, steps=10, params=1000, cpu=2.0):
    return {"method": "m", "ranks": ranks, "steps": steps, "steps_done": steps, "params": params,
            "compute_cpu_s": cpu, "ledger_rank0": [{"level": "world", "bytes_recv": 0, "seconds": 0,
                                                    **r} for r in rows]}


def test_projection_recosts_each_op_by_its_algorithm_s_formula():
    from lowcomm.comm.ledger import wire_bytes
    from lowcomm.tools.project import project
    n = 4000                                    # bytes per all-reduce; 10 steps, one call each
    s = _summary([{"op": "allreduce.mpi", "calls": 10, "bytes_sent": 10 * wire_bytes("allreduce", n, 4)[0]},
                  {"op": "allreduce.ring", "calls": 5, "bytes_sent": 5 * 2 * 3 * n // 4},
                  {"op": "alltoall.v", "calls": 10, "bytes_sent": 10 * 3 * 400 // 4},
                  {"op": "allgather.v", "calls": 10, "bytes_sent": 10 * 3 * 400 // 4},
                  {"op": "sendrecv", "calls": 20, "bytes_sent": 20 * 100}])
    link = Link(10, 8)                          # 10 ms, 1 MB/s
    at = {r["ranks"]: r for r in project(s, [4, 8, 1024], [link])["rows"]}
    # at the measured K the bytes per step are the ledger's own
    assert at[4]["bytes_per_rank_per_step"] == pytest.approx(sum(r["bytes_sent"] for r in s["ledger_rank0"]) / 10)
    per_step_8 = (2 * 7 / 8 * n) + 0.5 * (2 * 7 / 8 * n) + 2 * (7 / 8 * 400) + 2 * 100
    assert at[8]["bytes_per_rank_per_step"] == pytest.approx(per_step_8)
    rounds_8 = 2 * 3 + 0.5 * 2 * 7 + 2 * 7 + 2 * 1     # Rabenseifner, ring, two-phase, p2p
    assert at[8]["seconds_per_step"] == pytest.approx(0.2 + rounds_8 * 0.01 + per_step_8 / 1e6)
    # at 1024 ranks: the all-reduces' bytes tend to 2n, the two-phase exchange's K-1 rounds dominate
    rounds_1024 = 2 * 10 + 0.5 * 2 * 1023 + 2 * 1023 + 2
    assert at[1024]["seconds_per_step"] == pytest.approx(
        0.2 + rounds_1024 * 0.01 + at[1024]["bytes_per_rank_per_step"] / 1e6)
    big = project(s, [8], [link], params=1e6)["rows"][0]      # 1000x the parameters
    assert big["bytes_per_rank_per_step"] == pytest.approx(1000 * per_step_8)
    assert project(s, [8], [link], params=1e6)["compute_s"] == pytest.approx(200.0)
    assert project(s, [8], [link], step_compute_s=0.5)["compute_s"] == 0.5
    lone = _summary([{"op": "allgather.v", "calls": 10, "bytes_sent": 10 * 3 * 400}])
    assert project(lone, [8], [link])["rows"][0]["bytes_per_rank_per_step"] == 7 * 400   # every rank's block
    with pytest.raises(ValueError, match="levels dc, world"):
        project(_summary([{"op": "allreduce.mpi", "calls": 1, "bytes_sent": 1},
                          {"op": "allreduce.mpi", "calls": 1, "bytes_sent": 1, "level": "dc"}]), [8], [link])


def test_projection_of_zero_keeps_its_bytes_flat_in_k_and_prints_memory_per_rank():
    """ZeRO's reduce-scatter and block all-gather each send (K-1)/K of the buffer at any K (not
    a block that stays the measured one); memory per rank for 1 B and 10 B parameters by stage."""
    from lowcomm.tools.project import memory_table, project, state_bytes_per_param
    n = 8000                                    # the bucket's bytes; 4 ranks measured
    s = _summary([{"op": "reduce_scatter.shm", "calls": 10, "bytes_sent": 10 * 3 * n // 4},
                  {"op": "allgather.blocks", "calls": 10, "bytes_sent": 10 * 3 * (n // 4)}])
    at = {r["ranks"]: r for r in project(s, [4, 1024], [Link(10, 8)])["rows"]}
    assert at[4]["bytes_per_rank_per_step"] == pytest.approx(2 * 3 / 4 * n)
    assert at[1024]["bytes_per_rank_per_step"] == pytest.approx(2 * 1023 / 1024 * n)
    assert state_bytes_per_param("syncdp(mpi)", 8) == 16
    assert state_bytes_per_param("zero1(auto)", 8) == 9 and state_bytes_per_param("zero2(auto)", 8) == 5.5
    assert state_bytes_per_param("fsdp(mpi)", 8) == 2
    text = memory_table([{"name": "zero2", "method": "zero2(auto)"}], [8, 64])
    assert "| zero2 | 10 B | 51.2 GiB | 39 GiB |" in text, text


def test_compare_checks_timeout_target_and_methods_before_anything_runs(tmp_path):
    for args, option in ((("--timeout", "0"), "--timeout"), (("--target", "nan"), "--target"),
                         (("--methods", ""), "--methods"), (("--methods", " , "), "--methods")):
        r = cli("compare", "--np", "2", "--out", tmp_path, *args)
        assert r.returncode == 2 and option in r.stderr, (args, r.output)
    assert not any(tmp_path.iterdir())


def _result(method, eval_loss, final_loss, steps_done=10, modelled=5.0):
    return {"method": method, "status": "ok", "eval_loss": eval_loss, "final_loss": final_loss,
            "steps": 10, "steps_done": steps_done, "bytes_total": 1e6, "wall_s": 1.0,
            "compute_cpu_s": 1.0, "modelled_wall_s": modelled}


def test_a_task_without_held_out_batches_writes_valid_json_and_the_table_says_how_it_ranks():
    """The README's own task has no eval_batches: summary.json and results.json held a bare NaN
    (not JSON) and the table ranked by it without a word."""
    from lowcomm.run.folder import json_text
    text = json_text({"eval_loss": float("nan"), "runs": [float("inf"), 1.5]})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}")) == \
        {"eval_loss": None, "runs": [None, 1.5]}
    md = table([_result("ddp", None, 2.0), _result("int8", None, 1.5)], Link(25, 100))
    rows = [line for line in md.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0].startswith("| 1 | int8 | – | 1.5000") and rows[1].startswith("| 2 | ddp | – |"), md
    assert "no held-out batches" in md and "ranked by their final train loss" in md, md
    md = table([_result("ddp", 2.0, 2.0), _result("int8", 1.0, 1.5)], Link(25, 100))
    assert "| 1 | int8 | 1.0000" in md and "held-out" not in md, md


def test_a_budget_table_marks_the_methods_the_steps_cap_stopped_first():
    md = table([_result("ddp", 2.0, 2.0, steps_done=7, modelled=30.0),
                _result("int8", 1.0, 1.5, steps_done=10, modelled=12.0)], Link(25, 100), budget=30)
    assert "| int8 | 1.0000 | 1.5000 | 10⁴ |" in md and "| ddp | 2.0000 | 2.0000 | 7 |" in md, md
    assert "stopped by the steps cap (int8)" in md and "Every method but those marked ⁴" in md, md
    md = table([_result("ddp", 2.0, 2.0, steps_done=7, modelled=30.0)], Link(25, 100), budget=30)
    assert "⁴" not in md and "Every method trained until" in md, md


def test_train_refuses_a_comparison_folder(tmp_path):
    from lowcomm.run.folder import COMPARE_MARKER
    (tmp_path / COMPARE_MARKER).write_text("{}")
    (tmp_path / "results.json").write_text("[]")
    before = digest(tmp_path)
    for extra in ((), ("--overwrite",)):
        r = cli("train", "--out", tmp_path, *extra)
        assert r.returncode == 2 and "holds a comparison" in r.stderr, r.output
    assert digest(tmp_path) == before


def _measured_folder(tmp_path):
    """A comparison's folder of two methods on 4 ranks, 100 steps, 1000 parameters: 'dense'
    all-reduces 4000 bytes every step and reaches eval loss 2.0 at step 40; 'outer' all-reduces
    them once in 10 steps and reaches it at step 80; 'never' stays above it."""
    from lowcomm.comm.ledger import wire_bytes
    per_call = wire_bytes("allreduce", 4000, 4)[0]
    results = []
    for name, calls, reach in (("dense", 100, 40), ("outer", 10, 80), ("never", 10, None)):
        s = {**_summary([{"op": "allreduce.mpi", "calls": calls, "bytes_sent": calls * per_call}],
                        steps=100, cpu=1.0), "method": name, "eval_loss": 1.9 if reach else 2.55}
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
        evals = [(20, 3.0), (reach or 60, 2.0 if reach else 2.6), (100, s["eval_loss"])]
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": st, "loss": e, "eval_loss": e}) + "\n" for st, e in evals))
        results.append({"method": name, "status": "ok"})
    (tmp_path / "results.json").write_text(json.dumps(results))
    return tmp_path


def test_project_ranks_the_methods_by_modelled_time_to_a_target_loss(tmp_path):
    """Time to target = the measured steps to the target × the projected seconds per step: on a
    fast link the method that needs fewer steps wins, on a slow one the one that sends less;
    the table says which never reached it and states the assumptions; a projection's JSON
    file is read again as the measurements."""
    from lowcomm.tools.project import projections, ranking
    folder = _measured_folder(tmp_path)
    fast, slow = Link(0, 1e6), Link(25, 100)
    done, skipped = projections(folder, [64], [fast, slow], target=2.5)
    assert not skipped
    by = {p["name"]: p for p in done}
    # linear between evaluations: 3.0 at step 20, 2.0 at 40 -> 2.5 at 30; 'outer' 3.0@20, 2.0@80
    assert by["dense"]["steps_to_target"] == pytest.approx(30)
    assert by["outer"]["steps_to_target"] == pytest.approx(50)
    assert by["never"]["steps_to_target"] is None and by["never"]["best_eval_loss"] == 2.55
    text = ranking(done, [64], [fast, slow], 2.5)
    fast_part, slow_part = text.split("**K = 64, 25 ms")
    assert fast_part.index("| 1 | dense |") < fast_part.index("| 2 | outer |")
    assert slow_part.index("| 1 | outer |") < slow_part.index("| 2 | dense |")
    assert "| – | never | not reached in 100 (best 2.55) |" in slow_part
    assert "not re-modelled for another rank count" in text
    s_step = next(r["seconds_per_step"] for r in by["outer"]["rows"] if r["link"] == str(slow))
    assert f"| {50 * s_step:.3g} s |" in slow_part
    # the CLI: --target prints the ranking; --json keeps the measurements, read again
    r = cli("project", str(folder), "--ranks", "64", "--link", "25,100", "--target", "2.5",
            "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.output
    assert "| 1 | outer |" in r.stdout and "time to eval loss 2.5" in r.stdout
    again = cli("project", str(tmp_path / "p.json"), "--ranks", "64", "--link", "25,100",
                "--target", "2.5")
    assert again.returncode == 0 and again.stdout == r.stdout.replace(
        f"wrote {tmp_path / 'p.json'}\n", ""), again.output
    (tmp_path / "other.json").write_text("{}")
    bad = cli("project", str(tmp_path / "other.json"))
    assert bad.returncode != 0 and "is not a projection's JSON file" in bad.stderr, bad.output
