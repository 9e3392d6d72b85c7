"""Bad input and failures end the job quickly with a message naming what was wrong."""
import sys
import time

import pytest

from conftest import WORKERS, cli, run_ranks


def test_exception_on_one_rank_ends_the_whole_job_within_seconds():
    t0 = time.monotonic()
    r = run_ranks(3, sys.executable, WORKERS / "fail_one_rank.py", timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, r.output
    assert "injected failure on the last rank" in r.stderr, r.output
    assert elapsed < 30, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("how,waits_for", [("ring", "waiting for rank"),
                                           ("mpi", "waiting for all 3 ranks of level world")])
def test_stopped_rank_ends_the_job_after_the_timeout_naming_it(how, waits_for):
    timeout = 3
    t0 = time.monotonic()
    r = run_ranks(3, sys.executable, WORKERS / "hang_one_rank.py", how, timeout, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, r.output
    assert "lowcomm watchdog: rank " in r.stderr and "(timeout 3 s)" in r.stderr, r.output
    assert waits_for in r.stderr, r.output
    assert "allreduce" in r.stderr or "sendrecv" in r.stderr, r.output
    assert elapsed < timeout + 10 + 10, f"took {elapsed:.1f} s"   # + startup of 3 ranks


def test_exception_in_cli_aborts_all_ranks(tmp_path):
    # data.path exists only as a file too small to form a batch: every rank fails in training
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 50)
    t0 = time.monotonic()
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--set", f"data.path={str(tiny)!r}",
                  "--out", tmp_path / "out", timeout=60)
    assert r.returncode != 0, r.output
    assert "too few for seq_len" in r.stderr, r.output
    assert time.monotonic() - t0 < 40


def test_bad_config_key_fails_before_training(tmp_path):
    r = run_ranks(2, "lowcomm", "train", "--set", "strategy.bucket_size=3", "--out", tmp_path, timeout=60)
    assert r.returncode != 0
    assert "config key 'strategy.bucket_size': unknown key" in r.stderr, r.output
    assert r.stderr.count("unknown key") == 1, "only rank 0 reports the configuration error"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_config_type_and_value_are_named(tmp_path):
    for override, words in [("steps=ten", "config key 'steps': expects int"),
                            ("strategy.algorithm=butterfly", "known: auto, mpi, ring, rabenseifner, tree, shm"),
                            ("compressor.name=zip", "config key 'compressor.name'")]:
        r = cli("train", "--set", override, "--out", tmp_path)
        assert r.returncode != 0 and words in r.stderr, r.output


def test_bad_toml_file_is_named(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[strategy]\nname = 'syncdp'\nbogus = 1\n")
    r = cli("train", "--config", f, "--out", tmp_path)
    assert r.returncode != 0 and "'strategy.bogus': unknown key" in r.stderr, r.output
    assert not (tmp_path / "summary.json").exists()
