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


def lowcomm(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "lowcomm.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def train(out, *extra, np=2, env=None):
    return run_ranks(np, "lowcomm", "train", "--quiet", "--out", out, *SETS, *extra, env=env)


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lowcomm.lock"}


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
