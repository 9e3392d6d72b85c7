"""Runs that need no person, and nothing lost whatever the user does (issue 16, parts 1 and 4):
a supervised run relaunches itself from its newest checkpoint; a run never overwrites another
run's files; a resume that cannot continue changes nothing on disk; errors are one line a rank."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT, run_ranks

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=2", "steps=9", "log_every=3",
         "checkpoint.every=3", "comm.timeout_s=20"]
SETS = [a for o in SMALL for a in ("--set", o)]
FAULTY = ROOT / "tests" / "launchers" / "faulty.sh"


def lowcomm(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "lowcomm.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def train(out, *extra, np=2, env=None):
    return run_ranks(np, "lowcomm", "train", "--quiet", "--out", out, *SETS, *extra, env=env)


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lowcomm.lock"}


def test_a_rank_that_cannot_come_back_shrinks_the_run_down_to_min_ranks(tmp_path):
    """DiLoCo on 2 ranks whose rank 1 dies at its 2nd step in every launch: the relaunch on 2
    ranks fails as well, so the third attempt runs on 1 rank from the 2-rank checkpoint."""
    run = tmp_path / "run"
    r = lowcomm("train", "--np", "2", "--max-restarts", "2", "--min-ranks", "1",
                "--restart-backoff", "0.1", "--launcher", FAULTY, "--quiet", "--out", run, *SETS,
                "--set", "steps=5", "--set", "checkpoint.every=1", "--set", "strategy.name=diloco",
                "--set", "strategy.period=2", env={"LOWCOMM_FAULT": "kill:1:2"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((run / "summary.json").read_text())
    assert s["ranks_per_attempt"] == [2, 2, 1], s["ranks_per_attempt"]
    assert [f["ranks"] for f in s["failures"]] == [2, 2], s["failures"]
    assert s["resizes"] == [{"step": 2, "from": 2, "to": 1}], s["resizes"]
    assert s["ranks"] == 1 and s["steps"] == 5 and s["ranks_agree"], s
    assert s["eval_loss"] == s["eval_loss"] and abs(s["eval_loss"]) < float("inf"), s["eval_loss"]
    assert "attempt 2 failed on 2 ranks" in r.stderr, r.stderr


def test_the_supervisor_shrinks_only_after_a_relaunch_fails_and_not_below_min_ranks(tmp_path):
    """The rule alone, on a job that fails while it has more than one rank (no MPI)."""
    from lowcomm.run.supervise import supervise
    job = lambda n: ["sh", "-c", f"test {n} -le 1", "--"]     # noqa: E731
    r = supervise(job, [], tmp_path / "a", max_restarts=4, backoff_s=0, np=3, min_ranks=1)
    assert r["returncode"] == 0 and r["ranks_per_attempt"] == [3, 3, 2, 2, 1], r
    assert [f["ranks"] for f in r["failures"]] == [3, 3, 2, 2], r["failures"]
    r = supervise(job, [], tmp_path / "b", max_restarts=4, backoff_s=0, np=3, min_ranks=2)
    assert r["returncode"] != 0 and r["ranks_per_attempt"] == [3, 3, 2, 2, 2], r


def test_two_runs_on_one_folder_at_once_the_second_names_the_holder(tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen([str(ROOT / "launchers" / "local.sh"), "-n", "1", "lowcomm", "train",
                              "--quiet", "--out", str(out), *SETS, "--set", "steps=100000"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (out / "metrics.jsonl").exists() and time.monotonic() - t0 < 120:
            time.sleep(0.5)
        assert (out / "metrics.jsonl").exists(), "the first run did not start"
        r = train(out, "--overwrite", np=1)
        assert r.returncode != 0 and "is in use by another run (pid" in r.stderr, r.output
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_a_cut_metrics_line_does_not_block_resume(tmp_path):
    run = tmp_path / "run"
    r = run_ranks(2, sys.executable, ROOT / "tests" / "workers" / "faulty_train.py", "train",
                  "--quiet", "--out", run, *SETS, env={"LOWCOMM_FAULT": "kill:1:8"})
    assert r.returncode != 0
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 7, "loss": 3.1')     # a kill mid-line
    r = train(run, "--resume", run)
    assert r.returncode == 0, r.output
    assert all(json.loads(x) for x in metrics.read_text().splitlines())


def test_a_crash_is_one_line_per_rank_with_the_traceback_in_the_run_folder(tmp_path):
    task = tmp_path / "broken.py"
    task.write_text("import torch\ndef model(cfg): return torch.nn.Linear(2, 1)\n"
                    "def loss(model, batch): return model(batch).sum()\n"
                    "def batch(step, rank, world, cfg): return {}['no such key']\n")
    r = train(tmp_path / "run", "--set", f"task={task}")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if "lowcomm failed" in ln]
    assert lines and all("broken.py: batch() raised KeyError" in ln for ln in lines), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    r = train(tmp_path / "run2", "--set", f"task={task}", env={"LOWCOMM_DEBUG": "1"})
    assert "Traceback" in r.stderr, r.stderr
    r = lowcomm("train", "--out", tmp_path / "x", env={"LOWCOMM_NUM_THREADS": "two"})
    assert r.returncode != 0 and "LOWCOMM_NUM_THREADS='two': expects a whole number" in r.stderr, r.stderr
