"""Fault injection under real mpirun: killed ranks, signals, corrupt checkpoints, NaN.

Every strategy in ``STRATEGIES`` joins the kill-and-resume test by being registered (Local SGD
and DiLoCo through streaming DiLoCo, whose state is theirs and more), and so does one compressor
of each kind of state (error-feedback residuals, a seeded generator, PowerSGD's
warm start; the others keep the same kinds): a resumed run must end with the same
``params_sha256`` (and the same logged losses and byte counts) as an uninterrupted one. The
uninterrupted reference runs share one mpirun (tests/workers/train_many.py).
"""
import json
import random
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS, run_ranks, run_worker
from lowcomm.compress import COMPRESSORS, Compressor, build_compressor
from lowcomm.config import CompressorConfig
from lowcomm.config import OPTIMIZERS
from lowcomm.registry import STRATEGIES

NP, STEPS, EVERY = 2, 12, 3
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=2", f"steps={STEPS}",
         f"log_every={EVERY}", f"checkpoint.every={EVERY}", "comm.timeout_s=20"]
OUTER = ["strategy.period=4", "strategy.fragments=2", "strategy.delay=1"]


def state_kind(name: str) -> str | None:
    """The kind of state a compressor resumes (None for stateless ones: casts, int8, sign,
    which resume like SyncDP itself)."""
    c = build_compressor(CompressorConfig(name=name))
    if type(c).state_dict is Compressor.state_dict:
        return None
    return type(c).__name__ if type(c).__name__ == "PowerSGD" else \
        "ErrorFeedback" if hasattr(c, "inner") else "seeded"


def methods() -> dict[str, list[str]]:
    m = {"syncdp-sgd": ["strategy.algorithm=ring", "strategy.overlap=false",
                        "optimizer.name=sgd", "optimizer.momentum=0.9"],
         "horovod": ["strategy.backend=horovod"]}
    # localsgd and diloco keep a subset of streaming-diloco's state (OuterLoop's, DiLoCo's outer
    # optimizer): streaming-diloco's row, and the policy's nested one, resume them
    for name, method in STRATEGIES.items():   # each with the outer-loop keys it takes
        if name not in ("syncdp", "localsgd", "diloco"):
            m[name] = [f"strategy.name={name}", *[o for o in OUTER
                                                  if o[9:o.index("=")] in method.settings.fields()]]
    kinds = {}
    for name in COMPRESSORS:          # one compressor per kind of state, in registry order
        kind = state_kind(name) if name != "none" else None
        if kind and kind not in kinds:
            kinds[kind] = name
            m[f"compressor-{name}"] = [f"compressor.name={name}", "compressor.start_iter=2"]
    if "onebit-adam" in OPTIMIZERS:
        m["onebit-adam"] = ["optimizer.name=onebit-adam", "optimizer.freeze_step=4"]
    if "async-ps" in STRATEGIES:   # checkpoints need its synchronous mode (1 server, 1 worker here)
        m["async-ps"] = ["strategy.name=async-ps", "strategy.max_staleness=0"]
    # a per-level policy: nested strategies (inner SyncDP state, outer loop, compressor) resume too
    m["policy"] = ["topology=dc:2,rank:1",
                   "policy.dc=streaming-diloco:period=4,fragments=2,delay=1,compressor=ef-sign"]
    return m


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
def references(tmp_path_factory) -> Path:
    """Every method's uninterrupted run, all in one mpirun: ``<dir>/<method>``."""
    root = tmp_path_factory.mktemp("references")
    jobs = [{"out": str(root / name), "overrides": [*SMALL, *extra]}
            for name, extra in {**methods(), **PLAIN}.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    run_worker(NP, "train_many.py", str(root / "jobs.json"), timeout=600)
    return root


@pytest.mark.parametrize("method", list(methods()))
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
    assert a["params_sha256"] == b["params_sha256"], f"{method} killed at step {step}"
    assert logged(ref) == logged(run)
    assert (a["bytes_total"], a["eval_loss"]) == (b["bytes_total"], b["eval_loss"])


def test_sigterm_on_one_rank_checkpoints_all_and_exits_nonzero(tmp_path, references):
    ref, run = references / "plain-no-checkpoints", tmp_path / "run"
    r = train(run, "checkpoint.every=0", fault="term:1:5")
    assert r.returncode != 0, r.output
    assert "stopped by SIGTERM after step 6" in r.stderr, r.output   # agreed one step later
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000006"]
    assert not (run / "summary.json").exists()
    r = train(run, "checkpoint.every=0", resume=run)
    assert r.returncode == 0, r.output
    assert summary(ref)["params_sha256"] == summary(run)["params_sha256"]


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
    assert summary(ref)["params_sha256"] == summary(run)["params_sha256"]


def test_resume_that_cannot_continue_fails_before_training(tmp_path):
    run = tmp_path / "run"
    assert train(run, fault=f"kill:1:{STEPS}").returncode != 0
    r = train(run, "model.d_model=64", resume=run)
    assert r.returncode != 0 and "config differs in: model.d_model: checkpoint 32, now 64" in r.stderr, r.output
    r = train(run, resume=run, np=3)
    assert r.returncode != 0 and "written by 2 ranks; this run has 3" in r.stderr, r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    r = train(empty, resume=empty)
    assert r.returncode != 0 and "no intact checkpoint" in r.stderr, r.output


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
