"""The command line as users run it: launchers/local.sh -n K lowcomm ..."""
import json
import math

import pytest

from conftest import ROOT, run_ranks

SUMMARY_KEYS = {"method", "ranks", "steps", "params", "final_loss", "eval_loss", "bytes_total",
                "bytes_by_level", "wall_s"}


def test_train_writes_metrics_and_summary(tmp_path):
    """One 4-rank run through the CLI (the constant schedule and the vendor algorithm are
    covered in test_units and test_collectives)."""
    K, steps, algorithm = 4, 12, "ring"
    r = run_ranks(K, "lowcomm", "train", "--quiet", "--set", f"steps={steps}", "--set", "log_every=4",
                  "--set", f"strategy.algorithm={algorithm}", "--set", "model.d_model=32",
                  "--set", "model.n_layers=1", "--set", "data.max_bytes=300000",
                  "--set", "optimizer.schedule=cosine", "--set", "optimizer.warmup_steps=2",
                  "--set", "eval_batches=4", "--out", tmp_path, timeout=240)
    assert r.returncode == 0, r.output
    s = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(s)
    assert (s["ranks"], s["steps"], s["method"]) == (K, steps, f"syncdp({algorithm})")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [4, 8, 12]
    # the optimizer's own lr at each logged step (lr 3e-3, cosine to 0.1 · lr over steps 3..12)
    cos = [3e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi * (t - 2) / 10)) / 2) for t in (4, 8, 12)]
    assert [m["lr"] for m in lines] == pytest.approx(cos, rel=1e-12)
    assert all(m["loss"] > 0 and m["wall_s"] > 0 for m in lines)
    assert lines[0]["bytes"] < lines[1]["bytes"] < lines[2]["bytes"]
    # every step all-reduces all gradients and a presence slot per tensor (which ones any rank
    # had a gradient for): 2(K-1)/K · 4 · (params + tensors) bytes per rank and step
    from lowcomm.run.api import load_config
    from lowcomm.tasks import bytelm
    tensors = len(list(bytelm.model(load_config(None, ["model.d_model=32", "model.n_layers=1"])).parameters()))
    grads = s["steps"] * K * (2 * (K - 1) * 4 * (s["params"] + tensors) // K)
    rows = {row["op"]: row for row in s["ledger_rank0"]}
    ar = rows[f"allreduce.{algorithm}"]     # the tiny model is one bucket: one all-reduce a step
    assert (ar["calls"], ar["bytes_sent"]) == (steps, grads // K), ar
    # bytes_total: the gradient all-reduces, rank 0's broadcast of the parameters, and every
    # rank's shape checks and one all-gather (the same on every rank: rank 0's)
    setup = 4 * s["params"] + K * (rows["check"]["bytes_sent"] + rows["allgather"]["bytes_sent"])
    assert s["bytes_total"] == grads + setup, (grads, setup, s["bytes_total"], rows)
    assert s["bytes_by_level"] == {"world": s["bytes_total"]}
    assert lines[-1]["loss"] < lines[0]["loss"]


def test_bench_allreduce_every_algorithm_correct(tmp_path):
    """Every row correct; --autotune writes the table and the auto row then runs its fastest."""
    out, table = tmp_path / "ar.json", tmp_path / "cache" / "allreduce.json"
    r = run_ranks(4, "lowcomm", "bench", "allreduce", "--sizes", "4K,1M", "--iters", "3",
                  "--warmup", "1", "--json", out, "--autotune", "--tune-sizes", "4K,1M",
                  "--table", table, timeout=240)
    assert r.returncode == 0, r.output
    rows = json.loads(out.read_text())
    assert {(x["size"], x["algorithm"]) for x in rows} == {
        (s, a) for s in (4096, 1 << 20)
        for a in ("mpi", "ring", "rabenseifner", "tree", "shm", "shm-registered", "auto", "horovod",
                  "gloo", "memcpy")}
    assert all(x["wrong"] == 0 and x["time_us"] > 0 and x["busbw_GBps"] > 0 for x in rows)
    assert "busbw(GB/s)" in r.stdout and "vs mpi" in r.stdout and "best/auto" in r.stdout
    memcpy = next(x for x in rows if x["algorithm"] == "memcpy" and x["size"] == 1 << 20)
    measured = r.stdout.split("all-reduce, float32")[-1]      # the table after the tuning's
    ring = next(line for line in measured.splitlines() if line.split()[:2] == ["1048576", "ring"])
    ring_us = next(x["time_us"] for x in rows if x["algorithm"] == "ring" and x["size"] == 1 << 20)
    assert f"{memcpy['time_us'] / ring_us:.2f}" == ring.split()[6], ring    # its vs memcpy
    tuned = json.loads(table.read_text())
    assert tuned["ranks"] == 4 and set(tuned["times_us"]) == {"4096", "1048576"}
    for x in rows:
        if x["algorithm"] == "auto":
            times = tuned["times_us"][str(x["size"])]
            assert set(times) == {"mpi", "ring", "rabenseifner", "tree", "shm"}
            assert x["chose"] == min(times, key=times.get), (x, times)


def test_bench_step_runs_every_peer(tmp_path):
    out = tmp_path / "step.json"
    r = run_ranks(2, "lowcomm", "bench", "step", "--steps", "3", "--warmup", "1",
                  "--set", "model.d_model=32", "--json", out, timeout=240)
    assert r.returncode == 0, r.output
    rows = json.loads(out.read_text())
    assert [x["strategy"] for x in rows] == ["syncdp", "ddp-gloo", "syncdp-fp16", "ddp-gloo-fp16",
                                              "syncdp-int8", "syncdp-powersgd", "ddp-gloo-powersgd",
                                              "horovod", "local"]
    assert all(x["step_ms"] > 0 for x in rows) and len({x["params"] for x in rows}) == 1
    assert "ours/ddp" in r.stdout
    local = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["local"])
    ddp = next(x["step_ms"] for x in rows if x["strategy"] == "ddp-gloo")
    assert f"{rows[-1]['step_ms'] / ddp:.2f}" in local.split()[5:], local   # its floor ratio


def test_horovodrun_launcher_runs_lowcomm(tmp_path):
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--set", "steps=3", "--set", "model.d_model=32",
                  "--set", "strategy.backend='horovod'", "--set", "eval_batches=2",
                  "--set", "model.n_layers=1", "--set", "data.max_bytes=300000", "--out", tmp_path,
                  launcher=ROOT / "launchers" / "horovodrun.sh", timeout=240)
    assert r.returncode == 0, r.output
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["method"] == "syncdp(horovod)" and s["ranks"] == 2

