"""Runs that need no person, and nothing lost whatever the user does:
a supervised run relaunches itself from its newest checkpoint; a run never overwrites another
run's files; a resume that cannot continue changes nothing on disk; errors are one line a rank."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, cli, run_ranks, scaled

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=2", "steps=9", "log_every=3",
         "checkpoint.every=3", f"comm.timeout_s={scaled(20):g}"]
SETS = [a for o in SMALL for a in ("--set", o)]
FAULTY = ROOT / "tests" / "launchers" / "faulty.sh"


def lowcomm(*args, env=None, timeout=180):
    """``lowcomm ARGS``, killed after ``timeout`` seconds (an idle machine's, scaled)."""
    return subprocess.run([sys.executable, "-m", "lowcomm.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled(timeout),
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
    from lowcomm.run.supervise import Attempts, supervise
    job = lambda n: ["sh", "-c", f"test {n} -le 1", "--"]     # noqa: E731
    r = supervise(job, [], tmp_path / "a", Attempts(max_restarts=4, backoff_s=0, np=3, min_ranks=1))
    assert r["returncode"] == 0 and r["ranks_per_attempt"] == [3, 3, 2, 2, 1], r
    assert [f["ranks"] for f in r["failures"]] == [3, 3, 2, 2], r["failures"]
    r = supervise(job, [], tmp_path / "b", Attempts(max_restarts=4, backoff_s=0, np=3, min_ranks=2))
    assert r["returncode"] != 0 and r["ranks_per_attempt"] == [3, 3, 2, 2, 2], r


def test_two_runs_on_one_folder_at_once_the_second_names_the_holder(tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen([str(ROOT / "launchers" / "local.sh"), "-n", "1", "lowcomm", "train",
                              "--quiet", "--out", str(out), *SETS, "--set", "steps=100000"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (out / "metrics.jsonl").exists() and time.monotonic() - t0 < scaled(120):
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


RECORD = ROOT / "tests" / "launchers" / "record.sh"


def a_run(folder, checkpoint_at=None):
    """A finished run's folder as lowcomm writes it (by hand: no ranks needed)."""
    from lowcomm.run.folder import new_run_id, write_marker
    from lowcomm.run.api import load_config
    folder.mkdir(parents=True)
    write_marker(folder, new_run_id(), folder)
    (folder / "config.json").write_text(json.dumps(load_config(None, SMALL).to_dict()))
    (folder / "metrics.jsonl").write_text('{"step": 3, "loss": 3.0}\n')
    (folder / "summary.json").write_text('{"steps": 9}\n')
    if checkpoint_at is not None:
        step = folder / "checkpoints" / f"step-{checkpoint_at:08d}"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text("{}")
    return folder


def read_only(folder):
    """Make ``folder`` unwritable even for root (chattr +i); the undo, or a skip."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("no chattr +i on this file system: cannot make a folder read-only as root")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_supervisor_refuses_at_once_what_every_attempt_would_fail_on(tmp_path):
    """Nothing is launched and nothing changes: a --resume of a run without a checkpoint (whose
    relaunch used to replace the run), the --out of another run (whose relaunch used to add
    --overwrite), a folder a live run holds, a folder that cannot be written."""
    from lowcomm.run.folder import close_run, lock
    sup = ["train", "--np", "2", "--max-restarts", "2", "--restart-backoff", "0", "--quiet"]
    bare = a_run(tmp_path / "bare")
    done = a_run(tmp_path / "done", checkpoint_at=9)
    before = {f: digest(f) for f in (bare, done)}
    r = cli(*sup, "--resume", bare, "--set", "steps=40")
    assert r.returncode != 0 and f"--resume {bare}: no checkpoint in {bare / 'checkpoints'} " \
        "to resume from" in r.stderr, r.output
    r = cli(*sup, "--out", done, *SETS)
    assert r.returncode != 0 and f"{done} holds another run" in r.stderr, r.output
    lock(done, "a live run")
    try:
        r = cli(*sup, "--resume", done, "--set", "steps=40")
    finally:
        close_run("a live run")
    assert r.returncode != 0 and f"{done} is in use by another run (pid {os.getpid()}" in r.stderr, \
        r.output
    assert {f: digest(f) for f in (bare, done)} == before, "a refused supervisor changed a run"
    assert not list(tmp_path.rglob("std*.log")), "a refused supervisor launched a job"
    locked = tmp_path / "read-only"
    locked.mkdir()
    undo = read_only(locked)
    try:
        r = cli(*sup, "--out", locked, *SETS)
    finally:
        undo()
    assert r.returncode != 0 and f"cannot use {locked} for the run: " in r.stderr, r.output
    assert list(locked.iterdir()) == []


def attempts(record):
    return [line.split() for line in record.read_text().splitlines()]


def test_the_supervisor_relaunches_without_overwrite_and_from_checkpoint_dir(tmp_path):
    """What each attempt is given (tests/launchers/record.sh starts nothing and fails): the
    same run id; never --overwrite; --resume once a checkpoint is in checkpoint.dir."""
    record = tmp_path / "attempts.txt"
    sup = ["train", "--np", "1", "--max-restarts", "1", "--restart-backoff", "0", "--quiet",
           "--launcher", RECORD]
    env = {"LOWCOMM_TEST_RECORD": str(record)}
    r = cli(*sup, "--out", tmp_path / "fresh", *SETS, env=env)
    assert r.returncode != 0 and "attempt 2 failed" in r.stderr, r.output
    first, second = attempts(record)
    assert "--overwrite" not in first + second and "--resume" not in first + second, (first, second)
    assert first[first.index("--run-id") + 1] == second[second.index("--run-id") + 1], (first, second)
    record.unlink()
    ck = tmp_path / "elsewhere"
    (ck / "step-00000006").mkdir(parents=True)
    r = cli(*sup, "--out", tmp_path / "ck", *SETS, "--set", f"checkpoint.dir='{ck}'", env=env)
    assert r.returncode != 0 and "attempt 2 failed" in r.stderr, r.output
    first, second = attempts(record)
    assert "--resume" not in first and second[second.index("--resume") + 1] == str(tmp_path / "ck"), \
        (first, second)


def test_sigint_during_the_restart_backoff_stops_the_supervisor(tmp_path):
    """It used to launch the next attempt, which trained to the end."""
    import threading

    from lowcomm.run.supervise import Attempts, supervise
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        r = supervise(["sh", "-c", "exit 3", "--"], [], tmp_path / "run",
                      Attempts(max_restarts=2, backoff_s=60))
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 20, "the backoff went on after SIGINT"
    assert r["stopped"] == "SIGINT" and r["returncode"] == 128 + signal.SIGINT, r
    assert r["ranks_per_attempt"] == [None] and r["restarts"] == 0, r


def a_supervisor(out, *extra):
    """``lowcomm train --np 2 --max-restarts 2`` of a long run in the background."""
    args = extra or (*SETS, "--set", "steps=1000000")
    return subprocess.Popen([sys.executable, "-m", "lowcomm.cli", "train", "--np", "2",
                             "--max-restarts", "2", "--restart-backoff", "0.1", "--quiet",
                             "--out", str(out), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def job_of(supervisor):
    """The pid of the supervisor's job (its mpirun)."""
    return int(Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children").read_text().split()[0])


def until(check, what, timeout=120):
    timeout = scaled(timeout)
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"{what} after {timeout} s"
        time.sleep(0.3)


def ended(p, timeout=120):
    """The supervisor's exit status and stderr (killed, and failing, after ``timeout``)."""
    timeout = scaled(timeout)
    try:
        return p.returncode if p.wait(timeout) is not None else None, p.stderr.read()
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"the supervisor did not end in {timeout} s")


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_supervisor_does_not_retry_a_failure_that_would_repeat(tmp_path):
    """A task error ends the supervisor at once, with the error (not after every restart)."""
    task = tmp_path / "broken.py"
    task.write_text("import torch\ndef model(cfg): return torch.nn.Linear(2, 1)\n"
                    "def loss(model, batch): return model(batch).sum()\n"
                    "def batch(step, rank, world, cfg): return {}['no such key']\n")
    r = lowcomm("train", "--np", "2", "--max-restarts", "3", "--restart-backoff", "0", "--quiet",
                "--out", tmp_path / "run", *SETS, "--set", f"task={task}")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "attempt 1 failed on 2 ranks (exit 1): TaskError: " in r.stderr and \
        "broken.py: batch() raised KeyError: 'no such key'" in r.stderr, r.stderr
    assert "attempt 2" not in r.stderr and "a relaunch would fail the same way" in r.stderr, r.stderr
    assert (tmp_path / "run" / "stderr.log").read_text().count("--- attempt") == 1


def test_sigterm_to_the_jobs_mpirun_is_a_stop_not_a_failure(tmp_path):
    """mpirun exits 1 after its ranks stop on the SIGTERM it passed on, as after a crash: the
    supervisor restarted the job. The ranks now report the stop themselves."""
    out = tmp_path / "run"
    sup = a_supervisor(out)
    until(lambda: lines(out / "metrics.jsonl"), "the job did not start")
    os.kill(job_of(sup), signal.SIGTERM)
    code, err = ended(sup)
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM; not restarted" in err, err
    log = (out / "stderr.log").read_text()
    assert log.count("--- attempt") == 1 and "lowcomm: stopped by SIGTERM after step" in log, log
    assert list((out / "checkpoints").glob("step-*")), "no final checkpoint"


def test_the_job_ends_with_its_supervisor_and_sighup_stops_it_like_sigterm(tmp_path):
    """A SIGKILLed supervisor left mpirun and the ranks training unsupervised (and the next
    supervisor spent its restarts on 'in use by another run'); SIGHUP (a closed terminal)."""
    from lowcomm.run.folder import usable
    out = tmp_path / "run"
    sup = a_supervisor(out)
    until(lambda: lines(out / "metrics.jsonl"), "the job did not start")
    mpirun = job_of(sup)
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait()
    try:
        until(lambda: "lowcomm: stopped by SIGTERM after step" in (out / "stderr.log").read_text(),
              "the job trained on without its supervisor", timeout=60)
    finally:
        if Path(f"/proc/{mpirun}").exists():     # this test's job, should it live on
            os.kill(mpirun, signal.SIGKILL)
    until(lambda: usable(out) is None, "the stopped job still holds the folder", timeout=30)
    sup = a_supervisor(out, "--resume", str(out))
    seen = len(lines(out / "metrics.jsonl"))
    until(lambda: len(lines(out / "metrics.jsonl")) > seen, "the resumed job did not train")
    os.kill(sup.pid, signal.SIGHUP)
    code, err = ended(sup)
    assert code == 128 + signal.SIGHUP and "stopped by SIGHUP; not restarted" in err, err
    log = (out / "stderr.log").read_text()
    assert log.count("--- attempt") == 2 and log.count("lowcomm: stopped by SIGTERM after") == 2, log


def test_a_stop_is_what_every_rank_says_not_one_ranks_signal(tmp_path):
    """When a rank dies, mpirun ends the others with SIGTERM: they report a signal, the dead rank
    nothing; that is a failure to restart, not a stop the user asked for."""
    from lowcomm.run import outcome

    def job(*ranks):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for r, report in enumerate(ranks):
            (folder / f"rank{r}.json").write_text(json.dumps({"started": True, **report}))
        return outcome.read(folder)

    assert job({"signal": "SIGTERM"}, {"signal": "SIGTERM"})["stop"] == "SIGTERM"
    assert job({"signal": "SIGINT"}, {"stopped": "SIGINT"})["stop"] == "SIGINT"  # missed, voted
    killed = job({"signal": "SIGTERM"}, {})
    assert killed["stop"] is None and killed["signalled"] and not killed["repeats"], killed
    crash = job({"signal": "SIGTERM"}, {"error": "TaskError: t.py: batch() raised", "repeats": True})
    assert crash == {"stop": None, "signalled": True, "error": "TaskError: t.py: batch() raised",
                     "repeats": True}, crash


def test_a_stop_completes_its_checkpoint_however_long_a_step_takes(tmp_path):
    """Steps of 0.5 s: the stop (STOP_VOTE_LAG steps, then the checkpoint) takes longer than
    mpirun's second between its SIGTERM and its SIGKILL; the supervisor passes the signal to the
    ranks themselves, so that mpirun never gets one to act on."""
    out = tmp_path / "run"
    task = ROOT / "tests" / "fleet_task.py"
    sup = a_supervisor(out, "--set", f"task={task}", "--set", "task.step_ms=500", "--set",
                       "task.dim=8", "--set", "batch_size=8", "--set", "steps=100000", "--set",
                       "log_every=1", "--set", "strategy.name=diloco", "--set", "strategy.period=4")
    until(lambda: lines(out / "metrics.jsonl"), "the job did not start")
    os.kill(sup.pid, signal.SIGTERM)
    code, err = ended(sup)
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM; not restarted" in err, err
    log = (out / "stderr.log").read_text()
    assert log.count("lowcomm: stopped by SIGTERM after step") == 1, log
    step = int(log.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert (out / "checkpoints" / f"step-{step:08d}" / "manifest.json").exists(), log


SLOW = [a for o in (f"task={ROOT / 'tests' / 'fleet_task.py'}", "task.step_ms=500", "task.dim=8",
                    "batch_size=8", "log_every=1", "checkpoint.every=0")
        for a in ("--set", o)]


def _as_from_a_terminal() -> None:
    """The launcher's SIGINT as a terminal gives it: a suite started in the background (``make
    test &``) ignores SIGINT, which its children inherit and a shell then cannot trap."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_slow_run(out, launch, sig):
    """A run of 0.5 s steps started by ``launch`` (a launcher's argv prefix), stopped by ``sig``
    sent to that launcher's process once two steps are logged; its exit status and stderr."""
    venv = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # as a user's
    p = subprocess.Popen([*launch, "lowcomm", "train", "--quiet", "--out", str(out), *SLOW,
                          "--set", "steps=100000"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, **venv}, preexec_fn=_as_from_a_terminal)
    until(lambda: len(lines(out / "metrics.jsonl")) >= 2, "the job did not start")
    p.send_signal(sig)
    return ended(p)


def assert_stopped_and_resumes(out, sig, err):
    """The final checkpoint is the last logged step's, and ``--resume`` continues from it."""
    said = f"lowcomm: stopped by {signal.Signals(sig).name} after step "
    assert said in err, err
    step = int(err.split(said)[1].split(";")[0])
    assert (out / "checkpoints" / f"step-{step:08d}" / "manifest.json").exists(), err
    assert json.loads(lines(out / "metrics.jsonl")[-1])["step"] == step
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--resume", out, "--set", f"steps={step + 2}")
    assert r.returncode == 0, r.output
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 2
    assert [json.loads(x)["step"] for x in lines(out / "metrics.jsonl")][-3:] == \
        [step, step + 1, step + 2]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_through_local_sh_keeps_its_final_checkpoint_with_slow_steps(tmp_path, sig):
    """launchers/local.sh passes the stop to the ranks, never to mpirun (which SIGKILLs its ranks
    a second after passing a SIGTERM on, before 5 steps of 0.5 s and a checkpoint are done)."""
    out = tmp_path / "run"
    code, err = stop_slow_run(out, [str(ROOT / "launchers" / "local.sh"), "-n", "2"], sig)
    assert code == 128 + sig, f"exit {code}\n{err}"
    assert_stopped_and_resumes(out, sig, err)
    assert "odls_base_sigkill_timeout" not in err, err      # no warning: the launcher forwards


def test_a_stop_through_bare_mpirun_keeps_its_checkpoint_with_the_documented_grace(tmp_path):
    """A bare mpirun with ``--mca odls_base_sigkill_timeout G`` (docs/reliability.md): SIGTERM to
    mpirun reaches the ranks G s later and leaves them G s to stop."""
    out, grace = tmp_path / "run", round(scaled(10))     # a stop here takes about 3 s
    launch = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none",
              *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
              "--mca", "odls_base_sigkill_timeout", str(grace)]
    code, err = stop_slow_run(out, launch, signal.SIGTERM)
    assert code != 0, err           # mpirun's own status (1) for the ranks it stopped itself
    assert_stopped_and_resumes(out, signal.SIGTERM, err)
    assert "odls_base_sigkill_timeout" not in err.split("stopped by")[0], err   # grace enough


def test_a_bare_mpirun_whose_grace_is_too_short_for_the_steps_is_warned_once(monkeypatch):
    """The stop takes up to STOP_VOTE_LAG + 1 steps: at 0.3 s a step, mpirun's default second
    is too short (a warning naming the fix), a 1000 s grace is not; a launcher that forwards
    stops, and a run outside Open MPI's mpirun, are never warned."""
    from lowcomm.run.signals import GraceCheck, mpirun_grace
    orte = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://x"}
    assert mpirun_grace({}) is None and mpirun_grace(orte) == 1.0
    assert mpirun_grace({**orte, "OMPI_MCA_odls_base_sigkill_timeout": "30"}) == 30.0
    assert mpirun_grace({**orte, "LOWCOMM_STOP_FORWARDED": "1"}) is None
    assert mpirun_grace({**orte, "LOWCOMM_FLEET": "127.0.0.1:1"}) is None
    short, long_ = GraceCheck(4, True, grace=1.0), GraceCheck(4, True, grace=1000.0)
    for _ in range(6):
        time.sleep(0.3)
        short.step_done(), long_.step_done()
    assert "odls_base_sigkill_timeout" in short.warning and long_.warning is None
    assert not short.active                                 # once
    quiet = GraceCheck(4, False, grace=1.0)                 # another rank than 0
    for _ in range(6):
        quiet.step_done()
    assert quiet.warning is None
