"""Fault injection under real mpirun: killed ranks, signals, corrupt checkpoints, NaN.

Resume is checked for every strategy in ``STRATEGIES`` (Local SGD and DiLoCo through streaming
DiLoCo, whose state is theirs and more), one compressor of each kind of state (error-feedback
residuals, a seeded generator, PowerSGD's warm start; the others keep the same kinds), 1-bit
Adam, a per-level policy and a user's transformers task: a resumed run must end with the same
``state_sha256`` (and the same logged losses and byte counts) as an uninterrupted one. All of
that runs in one mpirun (tests/mpi/check_resume.py: reference, interrupted at a random step,
resumed in the same processes with their RNGs scrambled). A real SIGKILL of one rank, through
the CLI, is tested for the kinds of loop that differ in what is in flight when a rank dies: a
blocking all-reduce, an outer loop's background fragments, and the parameter server (whose
workers step in their own loop, so it cannot be interrupted in-process).
"""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, cli, run_mpi_suite, run_ranks, shared_mpi_suite
from lowcomm.compress import COMPRESSORS, Codec, build_compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.run.loop import STOP_VOTE_LAG
from lowcomm.run.registry import STRATEGIES, example, in_one_job

NP, STEPS, EVERY = 2, 12, 3
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=2", f"steps={STEPS}",
         f"log_every={EVERY}", f"checkpoint.every={EVERY}", "comm.timeout_s=20"]
OUTER = ["strategy.period=4", "strategy.fragments=2", "strategy.delay=1"]


def state_kind(name: str) -> str | None:
    """The kind of state a compressor resumes (None for stateless ones: casts, int8, sign,
    which resume like SyncDP itself)."""
    c = build_compressor(CompressorConfig(name=name))
    if type(c.codec).__name__ == "PowerSGD":
        return "PowerSGD"
    if c.error_feedback:
        return "ErrorFeedback"
    return "seeded" if type(c.codec).state_dict is not Codec.state_dict else None


def methods() -> dict[str, list[str]]:
    m = {"syncdp-sgd": ["strategy.algorithm=ring", "strategy.overlap=false",
                        "optimizer.name=sgd", "optimizer.momentum=0.9"],
         "horovod": ["strategy.backend=horovod"]}
    # localsgd and diloco keep a subset of streaming-diloco's state (OuterLoop's, DiLoCo's outer
    # optimizer): streaming-diloco's row, and the policy's nested one, resume them
    for name, method in in_one_job().items():   # each with the outer-loop keys it takes
        if name not in ("syncdp", "localsgd", "diloco"):
            m[name] = [f"strategy.name={name}", *example(method)[1],     # its inner optimizer
                       *[o for o in OUTER if o[9:o.index("=")] in method.settings.fields()]]
    kinds = {}
    for name in COMPRESSORS:          # one compressor per kind of state, in registry order
        kind = state_kind(name) if name != "none" else None
        if kind and kind not in kinds:
            kinds[kind] = name
            m[f"compressor-{name}"] = [f"compressor.name={name}", "compressor.start_iter=2"]
    if "diloco-dylu" in STRATEGIES:   # ranks sharing cores differ in speed by timing alone:
        m["diloco-dylu"].append("strategy.tolerance=0.99")   # every step taken, reproducibly
    if "onebit-adam" in STRATEGIES:   # past its warm-up within the run
        m["onebit-adam"] = ["strategy.name=onebit-adam", "strategy.freeze_step=4", "optimizer.name=adam",
                            "optimizer.schedule=cosine"]     # the lr a resumed step reads moves
    if "zeroone-adam" in STRATEGIES:   # all four kinds of step: dense, 1-bit, local, sync
        m["zeroone-adam"] = ["strategy.name=zeroone-adam", "strategy.var_freeze_step=5",
                             "strategy.var_update_scaler=2", "strategy.local_step_scaler=2",
                             "strategy.local_step_clipper=4", "optimizer.schedule=cosine"]
    if "desloc" in STRATEGIES:   # each of the three periods falls inside the run
        m["desloc"] = ["strategy.name=desloc", "strategy.period=2", "strategy.period_u=3",
                       "strategy.period_v=4", "optimizer.schedule=cosine"]
    if "demo" in STRATEGIES:   # the paper's sign step; the lr its momentum reads moves
        m["demo"] = ["strategy.name=demo", "optimizer.name=sgd", "optimizer.schedule=cosine"]
    # MuLoCo: DiLoCo over torch's Muon and AdamW (the inner optimizer's two parts resume)
    m["muloco"] = ["strategy.name=diloco", "strategy.period=4", "optimizer.name=muon"]
    if "sparseloco" in m:      # chunks the small model has several of, so top-k leaves some
        m["sparseloco"] += ["strategy.chunk=8", "strategy.topk=4"]
    if "async-ps" in STRATEGIES:   # checkpoints need its synchronous mode (1 server, 1 worker here)
        m["async-ps"] = ["strategy.name=async-ps", "strategy.max_staleness=0"]
    # a per-level policy: nested strategies (inner SyncDP state, outer loop, compressor) resume too
    m["policy"] = ["topology=dc:2,rank:1",
                   "policy.dc=streaming-diloco:period=4,fragments=2,delay=1,compressor=ef-sign"]
    # a model nobody here wrote (transformers GPT-2) under an outer loop; with dropout, so the
    # RNG streams of the checkpoint matter
    m["hf-gpt2-diloco"] = [f"task={ROOT / 'experiments' / 'hf_gpt2_task.py'}", "task.n_embd=32",
                           "task.n_layer=1", "task.n_head=2", "task.seq_len=32", "task.dropout=0.1",
                           "strategy.name=diloco", "strategy.period=4"]
    return m


#: methods also SIGKILLed for real (one rank, through the CLI): what is in flight differs
KILLED = ("syncdp-sgd", "streaming-diloco", "async-ps")
#: the parameter server's workers step in their own loop: resumed only after a real kill
NOT_IN_PROCESS = ("async-ps",)


def train(out, *overrides, fault=None, resume=None, np=NP, timeout=120):
    args = ["--quiet", "--out", out] + [a for o in (*SMALL, *overrides) for a in ("--set", o)]
    if resume:
        args += ["--resume", resume]
    cmd = (sys.executable, WORKERS / "faulty_train.py") if fault else ("lowcomm",)
    env = {"LOWCOMM_FAULT": fault} if fault else None
    return run_ranks(np, *cmd, "train", *args, env=env, timeout=timeout)


TIMINGS = {"wall_s", "comm_s", "compute_cpu_s"}


def logged(out):
    """metrics.jsonl without its timings (what a resumed run must reproduce exactly)."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMINGS} for line in lines]


def summary(out):
    return json.loads((out / "summary.json").read_text())


PLAIN = {"plain": [], "plain-no-checkpoints": ["checkpoint.every=0"]}   # for the tests below


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """One mpirun (tests/mpi/check_resume.py): every method's uninterrupted run
    (``<dir>/<method>``) and, for those that can be interrupted in-process, an
    interrupted-then-resumed run checked against it; the folder and the cases' outcomes (each
    interrupted method's own test asserts its own)."""
    root = tmp_path_factory.mktemp("references")
    rng = random.SystemRandom()
    jobs = [{"name": name, "ref": str(root / name), "overrides": [*SMALL, *extra],
             "stop": (rng.randint(EVERY + 1, STEPS) if name in methods()
                      and name not in NOT_IN_PROCESS else None),
             "run": str(root / "resumed" / name)}
            for name, extra in {**methods(), **PLAIN}.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    cases = run_mpi_suite(NP, "check_resume.py", timeout=600, case_timeout=300, each_case=True,
                          env={"LOWCOMM_RESUME_JOBS": str(root / "jobs.json")})
    refs = [f"check_resume.py::test_the_uninterrupted_run_writes_its_summary[{job['name']}]" for job in jobs]
    bad = {case: cases.get(case, "not run") for case in refs if cases.get(case) != "passed"}
    assert not bad, bad
    return root, cases


@pytest.fixture(scope="module")
def references(reference_runs) -> Path:
    return reference_runs[0]


@pytest.mark.parametrize("method", [m for m in methods() if m not in NOT_IN_PROCESS])
def test_interrupted_then_resumed_is_bit_identical(method, reference_runs):
    case = f"check_resume.py::test_interrupted_then_resumed_is_bit_identical[{method}]"
    assert reference_runs[1].get(case) == "passed", f"{method}: {reference_runs[1].get(case, 'not run')}"


@pytest.mark.parametrize("method", KILLED)
def test_sigkill_then_resume_is_bit_identical(tmp_path, method, references):
    extra = methods()[method]
    ref, run = references / method, tmp_path / "run"
    step = random.SystemRandom().randint(EVERY + 1, STEPS)
    t0 = time.monotonic()
    r = train(run, *extra, fault=f"kill:1:{step}")
    assert r.returncode != 0, f"killed at step {step}\n{r.output}"
    assert time.monotonic() - t0 < 60, "a killed rank must end the job, not hang it"
    assert not (run / "summary.json").exists()
    assert not list((run / "checkpoints").glob(".*.tmp")), "no half-written checkpoint is left"
    r = train(run, *extra, resume=run)
    assert r.returncode == 0, f"killed at step {step}\n{r.output}"
    assert f"at step {(step - 1) // EVERY * EVERY}" in r.stderr, r.output
    a, b = summary(ref), summary(run)
    assert a["state_sha256"] == b["state_sha256"], f"{method} killed at step {step}"
    assert logged(ref) == logged(run)
    assert (a["bytes_total"], a["eval_loss"]) == (b["bytes_total"], b["eval_loss"])


FAULTY = ROOT / "tests" / "launchers" / "faulty.sh"


def supervised(out, *extra, env=None):
    """``lowcomm train --np 2 --max-restarts 1`` through the fault-injecting launcher."""
    sets = [a for o in (*SMALL, *extra) for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "lowcomm.cli", "train", "--np", str(NP),
                           "--max-restarts", "1", "--launcher", str(FAULTY), "--quiet",
                           "--out", str(out), *sets], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_a_killed_rank_under_max_restarts_resumes_and_ends_bit_identical(tmp_path, references):
    run = tmp_path / "run"
    r = supervised(run, env={"LOWCOMM_FAULT": "kill:1:5", "LOWCOMM_FAULT_ONCE": str(tmp_path / "fired")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "fired").exists(), "the fault never happened"
    a, b = summary(references / "plain"), summary(run)
    assert b["restarts"] == 1 and b["steps"] == STEPS, b
    assert len(b["failures"]) == 1 and b["failures"][0]["exit"] != 0, b["failures"]
    assert "signal 9" in b["failures"][0]["cause"] or "Killed" in b["failures"][0]["cause"], b["failures"]
    assert a["state_sha256"] == b["state_sha256"]
    # a run that keeps failing gives up after its restarts, exiting non-zero, naming the cause
    r = supervised(tmp_path / "again", env={"LOWCOMM_FAULT": "nan-loss:0:1"})
    assert r.returncode != 0 and r.stderr.count("non-finite values") >= 2, r.stdout + r.stderr
    assert "attempt 2 failed" in r.stderr, r.stderr


def test_sigterm_on_one_rank_checkpoints_all_and_exits_nonzero(tmp_path, references):
    ref, run = references / "plain-no-checkpoints", tmp_path / "run"
    r = train(run, "checkpoint.every=0", fault="term:1:5")
    assert r.returncode != 0, r.output
    at = 5 + STOP_VOTE_LAG                          # the vote started after step 5 is read then
    assert at < STEPS and f"stopped by SIGTERM after step {at}" in r.stderr, r.output
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{at:08d}"]
    assert not (run / "summary.json").exists()
    r = train(run, "checkpoint.every=0", resume=run)
    assert r.returncode == 0, r.output
    assert summary(ref)["state_sha256"] == summary(run)["state_sha256"]


def test_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path, references):
    ref, run = references / "plain", tmp_path / "run"
    assert train(run, fault=f"kill:0:{STEPS - 1}").returncode != 0
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    part = newest / "rank-00001.pt"
    part.write_bytes(part.read_bytes()[:1000])
    r = train(run, resume=run)
    assert r.returncode == 0, r.output
    assert f"{part} is corrupt or truncated" in r.stderr, r.output
    assert f"resumed from {run / 'checkpoints'} at step {STEPS - 2 * EVERY}" in r.stderr, r.output
    assert summary(ref)["state_sha256"] == summary(run)["state_sha256"]


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lowcomm.lock"}


def test_a_finished_run_is_never_touched_and_a_resume_that_cannot_continue_changes_nothing(
        tmp_path, references):
    run = tmp_path / "run"
    shutil.copytree(references / "plain", run)
    before = digest(run)
    r = cli("train", "--out", run, *[a for o in (*SMALL, "lr=0.1") for a in ("--set", o)])
    assert r.returncode != 0 and f"{run} holds another run" in r.stderr, r.output
    assert digest(run) == before, "the refused run changed the earlier run's files"
    r = train(run, "model.d_model=64", resume=run)
    assert r.returncode != 0 and "config differs in: model.d_model: checkpoint 32, now 64" in r.stderr, r.output
    assert digest(run) == before, "a rejected --resume changed files"
    r = train(run, "steps=5", resume=run)
    assert r.returncode != 0 and "past steps=5" in r.stderr, r.output
    assert digest(run) == before, "a rejected --resume changed files"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    r = train(empty, resume=empty)
    assert r.returncode != 0 and "no intact checkpoint" in r.stderr, r.output
    theirs = run / "checkpoints" / "my_important_model" / "w.bin"     # not lowcomm's: it stays
    theirs.parent.mkdir()
    theirs.write_bytes(b"weights")
    old_id = json.loads((run / ".lowcomm-run.json").read_text())["run"]
    r = run_ranks(1, "lowcomm", "train", "--quiet", "--out", run, "--overwrite",
                  *[a for o in (*SMALL, "lr=0.1") for a in ("--set", o)])
    assert r.returncode == 0, r.output                               # asked for: replaced
    assert json.loads((run / "config.json").read_text())["lr"] == 0.1
    assert theirs.read_bytes() == b"weights" and "kept my_important_model" in r.stderr, r.output
    new_id = json.loads((run / ".lowcomm-run.json").read_text())["run"]
    assert new_id != old_id and {json.loads((p / "manifest.json").read_text())["run"]
                                 for p in (run / "checkpoints").glob("step-*")} == {new_id}


def test_overwrite_refuses_a_folder_lowcomm_did_not_write(tmp_path):
    """It used to delete another tool's config.json and checkpoints/."""
    theirs = tmp_path / "theirs"
    (theirs / "checkpoints" / "my_important_model").mkdir(parents=True)
    (theirs / "checkpoints" / "my_important_model" / "w.bin").write_bytes(b"weights")
    (theirs / "config.json").write_text('{"their": "tool"}')
    before = digest(theirs)
    r = cli("train", "--out", theirs, "--overwrite", *[a for o in SMALL for a in ("--set", o)])
    assert r.returncode != 0 and f"{theirs} holds config.json, checkpoints but no .lowcomm-run.json: " \
        "lowcomm did not write them" in r.stderr, r.output
    assert digest(theirs) == before


def test_a_garbage_config_json_on_resume_names_the_file(tmp_path):
    saved = tmp_path / "config.json"
    for text, what in (("{not json", "JSONDecodeError"), ("[1, 2]", "a JSON list, not an object"),
                       ('{"steps": "many"}', "config key 'steps': expects int")):
        saved.write_text(text)
        for supervised in ((), ("--np", "2", "--max-restarts", "1")):
            r = cli("train", *supervised, "--resume", tmp_path)
            assert r.returncode != 0 and f"{saved}" in r.stderr and what in r.stderr, r.output
            assert "Traceback" not in r.stderr, r.output


@pytest.mark.mpi_checks("check_nothing_lost.py", np=NP, timeout=300)
def test_what_a_run_guards_once_its_ranks_are_up():
    """tests/mpi/check_nothing_lost.py, each case asserted on every rank: seeds, a loss without
    grad_fn, another architecture on resume, a checkpoint.dir shared by two runs, a full disk
    while checkpointing."""
    cases = shared_mpi_suite(NP, "check_nothing_lost.py")
    assert any("full_disk" in name for name in cases) and any("checkpoint_dir" in name for name in cases)


@pytest.mark.parametrize("kind,what", [("nan-loss", "the loss"),
                                       ("nan-grad", "the gradient of 'tok.weight'")])
def test_nonfinite_aborts_naming_rank_step_and_tensor(tmp_path, kind, what):
    r = train(tmp_path, fault=f"{kind}:1:5")
    assert r.returncode != 0, r.output
    assert f"rank 1 at step 5: non-finite values (NaN/Inf) in {what}" in r.stderr, r.output
    assert not (tmp_path / "summary.json").exists()


def test_nonfinite_skip_skips_the_step_on_every_rank(tmp_path):
    kind = "nan-grad"     # a finite loss with an Inf gradient: the reducer's zeroing path too
    r = train(tmp_path, "on_nonfinite=skip", fault=f"{kind}:1:5")
    assert r.returncode == 0, r.output
    s = summary(tmp_path)
    assert s["skipped_steps"] == 1, s["skipped_steps"]
    assert s["final_loss"] == s["final_loss"] and s["eval_loss"] == s["eval_loss"]   # not NaN
    assert "rank 1 step 5: " in r.stderr and "all ranks skip the step" in r.stderr, r.output


def test_a_full_disk_while_appending_metrics_names_the_file_and_leaves_no_cut_line(tmp_path):
    """A metrics line cut by a full disk (half of it written, then ENOSPC): an error naming
    metrics.jsonl, and the file ends with the last whole line, as before the write."""
    import errno
    from unittest import mock
    from lowcomm.errors import LowcommError
    from lowcomm.run.lockstep import _append
    path = tmp_path / "metrics.jsonl"
    real = os.write
    with open(path, "w") as f:
        _append(f, '{"step": 1}\n')
        calls = []

        def half_then_full(fd, data):
            calls.append(len(data))
            if len(calls) == 1:
                return real(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        with mock.patch("lowcomm.run.lockstep.os.write", half_then_full):
            with pytest.raises(LowcommError, match=r"cannot write .*metrics\.jsonl: No space left"):
                _append(f, '{"step": 2, "loss": 1.25}\n')
        assert len(calls) == 2, "the check can fail: half the line was written first"
    assert path.read_text() == '{"step": 1}\n'
