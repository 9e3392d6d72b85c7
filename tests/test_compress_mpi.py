"""Compressors and 1-bit Adam under real mpirun (tests/mpi/check_compress.py), and ``lowcomm train``
with a compressor: summary.json's bytes == the analytic volume from the model's shapes."""
import json
import math

import pytest

from conftest import run_ranks, shared_mpi_suite
from lowcomm.compress import COMPRESSORS
from lowcomm.run.api import load_config
from lowcomm.comm.ledger import wire_bytes
from lowcomm.tasks import bytelm


# each collective at one rank count (the all-gather at 2, two-phase at 3: an odd K, uneven chunks)
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.mpi_checks("check_compress.py", timeout=200)
def test_compressors_and_onebit_adam_under_mpirun(np_):
    cases = shared_mpi_suite(np_, "check_compress.py")
    for name in COMPRESSORS:     # every registered compressor trains (and its bytes are checked)
        assert f"check_compress.py::test_trains_and_the_ranks_agree[{name}]" in cases, name
    # 1-bit Adam's warm-up and compressed all-reduce on 2 ranks; its per-tensor scales on both
    warm_up = "check_compress.py::test_onebit_adam_warm_up_equals_torch_adam_then_compresses_and_trains"
    assert (warm_up in cases) == (np_ == 2), sorted(cases)
    assert "check_compress.py::test_onebit_adams_per_tensor_scales_match_their_definition" in cases
    assert "check_compress.py::test_int8_keeps_a_tensor_10_4_times_smaller_than_its_bucket_neighbour" in cases


TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4", "data.seq_len=32",
        "data.max_bytes=300000", "eval_batches=2", "steps=6", "log_every=3", "comm.timeout_s=30"]


def train(out, np_, *extra):
    args = ["--quiet", "--out", out] + [a for o in (*TINY, *extra) for a in ("--set", o)]
    r = run_ranks(np_, "lowcomm", "train", *args, timeout=120)
    assert r.returncode == 0, r.output
    return json.loads((out / "summary.json").read_text())


def test_cli_summary_bytes_equal_the_analytic_volume(tmp_path):
    """One bucket holds the whole tiny model: per step sign sends ⌈d/8⌉ + 4 bytes and one bit
    per parameter to K-1 ranks, PowerSGD (after start_iter dense steps) r·(n+m) floats per matrix
    plus the vectors."""
    K, steps = 2, 6
    cfg = load_config(None, TINY)
    shapes = [tuple(p.shape) for p in bytelm.model(cfg).parameters()]
    d = sum(math.prod(s) for s in shapes)
    assert 4 * d < 4.0 * 2**20, "one bucket"
    dense = train(tmp_path / "none", K)
    setup = dense["bytes_total"] - K * steps * wire_bytes("allreduce", 4 * d, K)[0]
    assert 0 <= setup < 4 * d * K, setup       # the initial broadcast and layout checks
    sign = train(tmp_path / "sign", K, "compressor.name=sign", "compressor.collective=allgather")
    assert sign["bytes_total"] - setup == K * steps * (K - 1) * (-(-d // 8) + 4 + -(-len(shapes) // 8))
    r, start = 2, 2
    p = q = 0
    for s in shapes:
        n, m = s[0], math.prod(s[1:])
        if len(s) >= 2 and min(n, m) > 1 and n * m > r * (n + m):
            p, q = p + r * n, q + r * m
        else:
            p += math.prod(s)
    per_step = wire_bytes("allreduce", 4 * p, K)[0] + wire_bytes("allreduce", 4 * q, K)[0]
    ps = train(tmp_path / "powersgd", K, "compressor.name=powersgd", f"compressor.start_iter={start}",
               f"compressor.approx_rank={r}")
    assert ps["bytes_total"] - setup == K * (start * wire_bytes("allreduce", 4 * d, K)[0]
                                            + (steps - start) * per_step)
    assert ps["final_loss"] == ps["final_loss"] and sign["final_loss"] == sign["final_loss"]
