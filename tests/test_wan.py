"""WAN emulation with real packets (root): namespaces up and down leaving nothing behind, a
16 MiB transfer between two emulated datacenters within 0.8–1.5x of the α–β model, the
hierarchical all-reduce across 2 datacenters, and cleanup after a failed run."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, run_ranks, run_worker  # noqa: F401

WAN = ROOT / "launchers" / "wan.sh"
LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="WAN emulation needs root")


def lowcomm(*args, **kw):
    return subprocess.run([*LOWCOMM, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, **kw)


def nothing_left():
    from lowcomm.wan import ours
    return ours() == {"namespaces": [], "devices": [], "forwarder": False, "state_file": False}


@pytest.fixture
def clean():
    """Each test starts and must end without a WAN of ours."""
    if os.geteuid() == 0:
        assert nothing_left(), "a WAN of ours was up before the test; run 'lowcomm wan down'"
    yield
    if os.geteuid() == 0:
        left = not nothing_left()
        lowcomm("wan", "down")
        assert not left, "the test left WAN namespaces, devices or the forwarder behind"


def test_wan_needs_root_and_says_so():
    code = ("import os, lowcomm.wan as w\nos.geteuid = lambda: 1000\n"
            "try:\n    w.require_root('lowcomm wan up')\nexcept w.WanError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert "needs root" in out and "--wan model" in out, out


@root_only
def test_wan_up_and_down_leaves_nothing(clean):
    r = lowcomm("wan", "up", "--dcs", "3", "--delay-ms", "5", "--rate-mbit", "50", "--link", "0,2,40,10")
    assert r.returncode == 0, r.stderr
    assert "dc0 -> dc2: 40 ms, 10 Mbit/s" in r.stdout and "dc0 -> dc1: 5 ms, 50 Mbit/s" in r.stdout, r.stdout
    from lowcomm.wan import ours
    now = ours()
    assert sorted(now["namespaces"]) == ["lowcomm-dc0", "lowcomm-dc1", "lowcomm-dc2"] and now["forwarder"], now
    for i in range(3):
        addr = subprocess.run(["ip", "-n", f"lowcomm-dc{i}", "-o", "addr", "show", f"lcwan{i}"],
                              capture_output=True, text=True).stdout
        assert f"10.77.0.{i + 1}/24" in addr, addr
    again = lowcomm("wan", "up", "--dcs", "2")
    assert again.returncode != 0 and "already up" in again.stderr, again.stderr
    d = lowcomm("wan", "down")
    assert d.returncode == 0 and "namespace lowcomm-dc2" in d.stdout, d.stdout + d.stderr
    assert nothing_left()
    assert "nothing" in lowcomm("wan", "down").stdout   # twice is fine


@root_only
def test_transfer_16mib_matches_alpha_beta_model(clean, tmp_path):
    result = tmp_path / "transfer.json"
    os.environ["LOWCOMM_WAN_RESULT"] = str(result)
    try:
        run_worker(2, "wan_transfer.py", timeout=120, launcher=WAN, launcher_args=["--dcs", "2"])
    finally:
        del os.environ["LOWCOMM_WAN_RESULT"]
    got = json.loads(result.read_text())
    print(f"16 MiB over 25 ms / 100 Mbit/s: {got['measured_s']:.3f} s, model {got['model_s']:.3f} s, "
          f"ratio {got['ratio']:.2f}")
    assert nothing_left()


@root_only
def test_hierarchical_allreduce_across_two_datacenters(clean):
    run_worker(4, "wan_hierarchical.py", timeout=150, launcher=WAN, launcher_args=["--dcs", "2"])
    assert nothing_left()


@root_only
def test_failed_run_still_cleans_up(clean):
    r = run_ranks(4, sys.executable, WORKERS / "wan_fail.py", timeout=120, launcher=WAN,
                  launcher_args=["--dcs", "2"])
    assert r.returncode != 0 and "rank 3 fails on purpose" in r.stderr, r.output
    assert nothing_left(), "wan.sh left its WAN behind after a failed run"
