"""Asynchronous parameter server: sharding, update rules and messages in-process; equivalence,
bounded staleness, a straggler, a lost worker and a lost server under real mpirun.

Lost ranks need ``mpirun --enable-recovery`` (Open MPI otherwise ends the whole job when a
process dies). Open MPI 4.1's mpirun then exits 0 whatever its ranks' statuses, so these tests
read what happened from stderr and summary.json, not from mpirun's exit status.
"""
import json
import math
import sys
import time

import numpy as np
import pytest
import torch

from conftest import WORKERS, run_ranks, scaled, shared_mpi_suite
from lowcomm.compress import COMPRESSORS
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError
from lowcomm.strategies.ps.async_ps import (HEADER, build_shards, dc_compensate, pack_push,
                                         staleness_lr, unpack_push)
from lowcomm.strategies.layout import balance

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4",
         "data.seq_len=32", "data.max_bytes=300000", "eval_batches=4", "log_every=5",
         "strategy.name=async-ps", "comm.timeout_s=30"]
RECOVER = {"LOWCOMM_MPIRUN_ARGS": "--enable-recovery"}


def train(out, *overrides, np=4, env=None, script="async_ps_faults.py", timeout=150):
    args = ["train", "--quiet", "--out", out] + [a for o in (*SMALL, *overrides) for a in ("--set", o)]
    return run_ranks(np, sys.executable, WORKERS / script, *args, env=env, timeout=timeout)


def summary(out):
    return json.loads((out / "summary.json").read_text())


# in-process -----------------------------------------------------------------------------------
def test_balance_is_greedy_largest_first():
    assert balance([10, 1, 1, 8], 2) == [0, 1, 1, 1]
    assert balance([5, 5, 5], 3) == [0, 1, 2]
    sizes = [int(x) for x in np.random.default_rng(0).integers(1, 1000, 40)]
    where = balance(sizes, 4)
    loads = [sum(s for s, b in zip(sizes, where) if b == k) for k in range(4)]
    assert max(loads) - min(loads) <= max(sizes)   # LPT: within one tensor of even


def test_shards_cover_every_parameter_once():
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([300, 20, 200, 100, 80])]
    shards = build_shards(named, 2)
    assert sorted(n for sh in shards for n in sh.names) == sorted(n for n, _ in named)
    assert [sh.numel for sh in shards] == [380, 320]
    for sh in shards:
        assert [seg.stop - seg.start for seg in sh.segments] == [dict(named)[n].numel() for n in sh.names]
    with pytest.raises(ValueError, match="3 servers but only 2 parameter tensors"):
        build_shards(named[:2], 3)


def test_update_rules():
    assert staleness_lr(0.1, 0) == 0.1 and staleness_lr(0.1, 1) == 0.1 and staleness_lr(0.1, 4) == 0.025
    g, w, w_bak = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])
    assert torch.equal(dc_compensate(g, w, w_bak, 0.1), torch.tensor([1.0 + 0.1 * 0.5, -2.0 - 0.1 * 4 * 0.5]))
    assert torch.equal(dc_compensate(g, w, w.clone(), 5.0), g)   # no delay, no compensation


def test_push_message_round_trip():
    header = np.arange(HEADER, dtype=np.float64)
    payload = [torch.randn(5), torch.arange(3, dtype=torch.int8).view(1, 3)]
    h, out, ctx, lrs = unpack_push(pack_push(header.copy(), payload, {"k": (1, 2)}, [0.1, 0.02]))
    assert list(h[:5]) == [0, 1, 2, 3, 4] and ctx == {"k": (1, 2)} and lrs == [0.1, 0.02]
    assert all(torch.equal(a, b) for a, b in zip(out, payload))


@pytest.mark.parametrize("override,key", [
    ("strategy.max_staleness=-2", "strategy.max_staleness"), ("strategy.servers=0", "strategy.servers"),
    ("strategy.dc_lambda=-1", "strategy.dc_lambda"), ("strategy.worker_timeout_s=0", "strategy.worker_timeout_s"),
    ("checkpoint.every=5", "checkpoint.every"), ("strategy.compressor=fp16", "strategy.compressor")])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(None, ["strategy.name=async-ps", override])
    load_config(None, ["strategy.name=async-ps", "strategy.max_staleness=0", "checkpoint.every=5"])


# under mpirun ---------------------------------------------------------------------------------
@pytest.mark.mpi_checks("check_async_ps.py", np=4, timeout=200)
def test_synchronous_ps_equals_syncdp_and_large_batch_sgd():
    """tests/mpi/check_async_ps.py: 2 servers (sharded), 2 workers, each case asserted on every
    rank; also the messages' bytes, every compressor's payloads, and SSP's bound on the lag."""
    cases = shared_mpi_suite(4, "check_async_ps.py")
    for name in (n for n in COMPRESSORS if n != "none"):
        assert f"check_async_ps.py::test_every_compressors_payloads_and_context_travel[{name}]" in cases


def test_straggler_staleness_stays_within_tau_and_training_converges(tmp_path):
    """1 server + 3 workers; worker 2 (rank 3) sleeps 60 ms in every forward pass; τ = 2."""
    tau, steps = 2, 60
    r = train(tmp_path, f"steps={steps}", f"strategy.max_staleness={tau}", "lr=0.01",
              env={"LOWCOMM_SLOW": "3:60"})
    assert r.returncode == 0, r.output
    s = summary(tmp_path)
    assert s["clock_lag"]["max"] == tau, s["clock_lag"]      # the straggler held the others back
    got = s["gradients_per_worker"]   # the budget: steps × 3 gradients (+ up to 2 in flight)
    assert 3 * steps <= sum(got) <= 3 * steps + 2 and s["staleness"]["count"] == sum(got), got
    assert got[2] < min(got[:2]), got     # the straggler did fewer
    assert s["status"] == "ok" and s["workers_lost"] == [] and s["samples"] == sum(got) * 4
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(line["clock_lag_max"] <= tau for line in lines), lines
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0, lines           # it learns ...
    assert s["eval_loss"] < 0.6 * math.log(256), s["eval_loss"]     # ... well below chance
    rows = {row["op"]: row for row in s["ledger_rank0"]}
    assert rows["push"]["calls"] == sum(got) and rows["pull"]["calls"] == sum(got) + 3


def test_killed_worker_leaves_the_others_finishing(tmp_path):
    """Worker 2 (rank 3) is SIGKILLed in its 8th step; τ = 1, so the others wait for it until the
    servers declare it lost (3 s of silence on an idle machine, longer by the measured slowdown:
    a live worker's first step must not look like silence), then finish the run's budget of
    30 × 3 gradients."""
    silence = round(scaled(3), 1)
    t0 = time.monotonic()
    r = train(tmp_path, "steps=30", "strategy.max_staleness=1", f"strategy.worker_timeout_s={silence}",
              env={**RECOVER, "LOWCOMM_KILL": "3:8"})
    assert time.monotonic() - t0 < scaled(120)
    assert f"worker 2 (rank 3) sent nothing for {silence:.1f} s" in r.stderr, r.output
    assert "async-ps finished with 2 of 3 workers; lost: worker 2 (rank 3, after 7 gradients)" in r.stderr, r.output
    s = summary(tmp_path)
    assert s["status"] == "1 of 3 workers lost" and s["workers_finished"] == 2
    assert [(x["worker"], x["rank"], x["clock"]) for x in s["workers_lost"]] == [(2, 3, 7)]
    got = s["gradients_per_worker"]       # the survivors do the lost worker's share of 30 × 3
    assert got[2] == 7 and 90 <= sum(got) <= 91 and s["samples"] == sum(got) * 4, got
    assert s["clock_lag"]["max"] <= 1 and s["staleness"]["count"] == sum(got)
    assert s["bytes_total"] > 0 and math.isfinite(s["eval_loss"])


def test_killed_server_ends_the_job_naming_it(tmp_path):
    """2 servers + 2 workers; server 1 (rank 1) is SIGKILLed before its 6th update: the workers
    waiting on it end the job within server_timeout_s (2 s on an idle machine, scaled), naming it."""
    silence = round(scaled(2), 1)
    t0 = time.monotonic()
    r = train(tmp_path, "steps=200", "strategy.servers=2", f"strategy.server_timeout_s={silence}",
              "strategy.max_staleness=0", env={**RECOVER, "LOWCOMM_KILL_SERVER": "1:6"})
    assert time.monotonic() - t0 < scaled(120)
    assert "parameter server 1 (rank 1) sent neither a reply nor a heartbeat for " in r.stderr and \
        f"(strategy.server_timeout_s = {silence:g}); it is gone" in r.stderr, r.output
    assert "it is gone, ending the job" in r.stderr, r.output
    assert not (tmp_path / "summary.json").exists()


def test_sigterm_to_one_worker_of_an_ssp_run_checkpoints_every_rank_and_resumes(tmp_path):
    """1 server + 2 workers, τ = 2: worker 1 (rank 2) gets SIGTERM in its 3rd step. The servers
    answer STOP from then on; every rank exits 128 + 15 after one final checkpoint (the server's
    shard, optimizer and clocks; each worker's own step, clock and RNG), and --resume finishes the
    run's budget of 16 × 2 gradients (not bit-identical to an uninterrupted run: asynchronous)."""
    r = train(tmp_path, "steps=16", "strategy.max_staleness=2", np=3, script="faulty_train.py",
              env={"LOWCOMM_FAULT": "term:2:3"})
    assert r.returncode == 128 + 15, r.output
    assert "parameter server 0 (rank 0): stop requested (signal 15)" in r.stderr, r.output
    assert "stopped by SIGTERM after step" in r.stderr, r.output
    (ck,) = (tmp_path / "checkpoints").iterdir()
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["world_size"] == 3 and len(manifest["files"]) == 3, manifest
    assert not (tmp_path / "summary.json").exists()
    r = run_ranks(3, "lowcomm", "train", "--quiet", "--resume", tmp_path, timeout=150)
    assert r.returncode == 0, r.output
    assert f"resumed from {tmp_path / 'checkpoints'} at step {manifest['step']}" in r.stderr, r.output
    s = summary(tmp_path)
    got = s["gradients_per_worker"]      # the whole budget, before and after the stop
    assert 32 <= sum(got) <= 33 and s["status"] == "ok" and s["ranks_agree"], s
    assert math.isfinite(s["eval_loss"]) and math.isfinite(s["final_loss"]), s


def test_a_full_disk_under_the_servers_metrics_ends_the_job_naming_the_file(tmp_path):
    """The servers log through the loop's coordination: metrics.jsonl on a full disk (a link to
    /dev/full, whose writes fail with ENOSPC) ends the job within its timeouts with the loop's
    error naming the file, not a bare OSError."""
    t0 = time.monotonic()
    r = train(tmp_path, "steps=10", "strategy.max_staleness=0", "log_every=2", np=2,
              env={"LOWCOMM_FULL_METRICS": "1"})
    assert time.monotonic() - t0 < scaled(120)
    assert r.returncode != 0, r.output
    assert f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device" in r.stderr, r.output
