"""WAN emulation with real packets (root): namespaces up and down leaving nothing behind, faults
(a link down, packet loss) on real packets, a 16 MiB transfer between two emulated datacenters
within 0.8–1.5x of the α–β model, the hierarchical all-reduce across 2 datacenters, DiLoCo
riding out an outage and packet loss bit-exactly while an outage past the watchdog's allowance
ends the job, and cleanup after a failed run."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, run_ranks, run_worker, scaled  # noqa: F401

WAN = ROOT / "launchers" / "wan.sh"
LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="WAN emulation needs root")


def lowcomm(*args, **kw):
    return subprocess.run([*LOWCOMM, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(60), **kw)


def nothing_left():
    from lowcomm.tools.wan import ours
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
    code = ("import os, lowcomm.tools.wan as w\nos.geteuid = lambda: 1000\n"
            "try:\n    w.require_root('lowcomm wan up')\nexcept w.WanError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert "needs root" in out and "--wan model" in out, out


def test_wan_launcher_refuses_a_bad_eager_limit_before_touching_the_network(clean):
    """(``clean`` checks, as root, that nothing of a WAN was made.)"""
    env = {**os.environ, "LOWCOMM_WAN_EAGER_BYTES": "4MiB"}
    r = subprocess.run(["bash", str(WAN), "-n", "4", "--dcs", "2", "true"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=scaled(60))
    assert r.returncode == 2 and "LOWCOMM_WAN_EAGER_BYTES must be a byte count, got '4MiB'" in r.stderr, r


@root_only
def test_wan_up_and_down_leaves_nothing(clean):
    from lowcomm.tools.wan_faults import make
    r = lowcomm("wan", "up", "--dcs", "3", "--delay-ms", "5", "--rate-mbit", "50", "--link", "0,2,40,10",
                "--fault", "down:0-2:for=60s")
    assert r.returncode == 0, r.stderr
    assert "dc0 -> dc2: 40 ms, 10 Mbit/s" in r.stdout and "dc0 -> dc1: 5 ms, 50 Mbit/s" in r.stdout, r.stdout
    from lowcomm.tools.wan import ours
    now = ours()
    assert sorted(now["namespaces"]) == ["lowcomm-dc0", "lowcomm-dc1", "lowcomm-dc2"] and now["forwarder"], now
    for i in range(3):
        addr = subprocess.run(["ip", "-n", f"lowcomm-dc{i}", "-o", "addr", "show", f"lcwan{i}"],
                              capture_output=True, text=True).stdout
        assert f"10.77.0.{i + 1}/24" in addr, addr
    assert "fault #1 link 0-2: down (dropped) for 60 s; active" in r.stdout, r.stdout
    # faults on real packets: 0-2 is down (scheduled at up), 0-1 is not; then cleared
    from lowcomm.tools import wan
    assert connects(0, 1) and not connects(0, 2)
    added = wan.fault([], clear=True) + wan.fault([make("loss", "1>0", rate=0.01, seed=4)])
    assert connects(0, 2)
    time.sleep(1.2)                     # the forwarder's counters are at most a second old
    now = {f["id"]: f for f in wan.faults_now()}
    assert not now[1]["active"] and now[1]["packets"] > 0, now       # it dropped the SYNs
    assert now[added[0].id]["active"] and "loss 1 % (seed 4) until cleared" in now[added[0].id]["what"]
    from click.testing import CliRunner

    from lowcomm.cli.wan import wan as wan_cli
    status = json.loads(CliRunner().invoke(wan_cli, ["status"]).output)
    assert [f["id"] for f in status["faults"]] == [1, added[0].id], status
    again = lowcomm("wan", "up", "--dcs", "2")
    assert again.returncode != 0 and "already up" in again.stderr, again.stderr
    d = lowcomm("wan", "down")
    assert d.returncode == 0 and "namespace lowcomm-dc2" in d.stdout, d.stdout + d.stderr
    assert nothing_left()
    assert "nothing" in lowcomm("wan", "down").stdout   # twice is fine


@root_only
def test_transfer_matches_alpha_beta_and_hierarchical_allreduce_across_two_datacenters(clean, tmp_path):
    """tests/workers/wan_hierarchical.py: a 16 MiB transfer dc0 -> dc1 within 0.8–1.5x of the α–β
    model, then the hierarchical all-reduce against MPI_Allreduce with exact bytes per level."""
    result = tmp_path / "transfer.json"
    run_worker(4, "wan_hierarchical.py", timeout=180, launcher=WAN, launcher_args=["--dcs", "2"],
               env={"LOWCOMM_WAN_RESULT": str(result),      # the watchdog's floor, scaled too
                    "LOWCOMM_TIMEOUT_S": f"{scaled(60):g}"})
    got = json.loads(result.read_text())
    print(f"16 MiB over 25 ms / 100 Mbit/s: {got['measured_s']:.3f} s, model {got['model_s']:.3f} s, "
          f"ratio {got['ratio']:.2f}")
    assert nothing_left()


@root_only
def test_compare_over_the_emulated_wan_measures_each_method_and_takes_the_wan_down(clean, tmp_path):
    """``lowcomm compare --wan 25,100``: every method runs its steps on the emulated WAN it brings
    up (launchers/wan.sh), the table says its wall-clock is measured there, and the WAN is gone
    after."""
    r = subprocess.run([*LOWCOMM, "compare", "--np", "2", "--dcs", "2", "--wan", "25,100",
                        "--methods", "ddp,diloco", "--steps", "6", "--set", "model.d_model=32",
                        "--set", "model.n_layers=1", "--set", "eval_batches=2", "--set", "log_every=2",
                        "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=scaled(240))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "over an emulated WAN of 2 datacenters, 25 ms, 100 Mbit/s (measured)" in r.stdout, r.stdout
    results = {x["method"]: x for x in json.loads((tmp_path / "results.json").read_text())}
    assert set(results) == {"ddp", "diloco"} and all(x["status"] == "ok" for x in results.values())
    for name in results:
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 6 and summary["ranks"] == 2, summary
    assert nothing_left(), "compare --wan left its WAN behind"


@root_only
def test_failed_run_still_cleans_up(clean):
    r = run_ranks(4, sys.executable, WORKERS / "wan_fail.py", timeout=120, launcher=WAN,
                  launcher_args=["--dcs", "2"])
    assert r.returncode != 0 and "rank 3 fails on purpose" in r.stderr, r.output
    assert nothing_left(), "wan.sh left its WAN behind after a failed run"


@root_only
def test_diloco_rides_out_an_outage_and_loss_bit_exactly_and_a_long_outage_ends_the_job(clean, tmp_path):
    """tests/workers/wan_faults.py: runs A (no fault), B (link down 2.5 s), C (5 % loss) equal
    bit for bit on every rank; then D (link down 12 s, watchdog allowance 3 + 2 s) must end the
    job with the watchdog's line naming rank, op and level."""
    with tempfile.TemporaryDirectory() as reports:
        r = run_ranks(4, sys.executable, WORKERS / "wan_faults.py", tmp_path, timeout=240, launcher=WAN,
                      launcher_args=["--dcs", "2"], env={"LOWCOMM_TEST_REPORTS": reports})
        oks = {int(f.name[4:]): int(f.read_text()) for f in Path(reports).glob("rank*")}
    print(r.stdout)
    assert oks == {k: 7 for k in range(4)}, r.output          # A, B and C checked on every rank
    assert r.returncode != 0 and "run d finished" not in r.stderr, r.output
    line = re.search(r"lowcomm watchdog: rank \d waited [0-9.]+ s \(timeout 5 s = max\(floor 3 s, .*\) "
                     r"\+ outage allowance 2 s \(wide-area link\)\) in op \S+ \(\d+ bytes\) on level "
                     r"world, waiting for all 4 ranks of level world; ending the job", r.stderr)
    assert line, r.output
    assert nothing_left()


def test_fault_arguments_are_checked_with_clear_errors():
    from lowcomm.tools.wan_faults import FaultError, parse_duration, parse_rate, parse_spec
    f = parse_spec("down:0-1:at=20s:for=10s", 2)
    assert (f.kind, f.link, f.start, f.end, f.hold) == ("down", "0-1", 20, 30, False)
    assert f.at(100.0).start == 120 and f.directions(2) == [(0, 1), (1, 0)]
    g = parse_spec("loss:1>0:rate=1.5%:seed=7", 3)
    assert (g.rate, g.seed, g.directions(3), g.end) == (0.015, 7, [(1, 0)], float("inf"))
    assert parse_spec("down:all:for=500ms:hold", 3).directions(3) == [(a, b) for a in range(3)
                                                                      for b in range(3) if a != b]
    assert parse_duration("2m", "--at") == 120 and parse_rate("0.01", "--loss") == 0.01
    for bad, says in [("down:0-1", "needs its length"), ("down:0-2:for=1s", "0..1"),
                      ("loss:0-1:rate=1", "write 1% for 1 percent"), ("loss:0-1:rate=100%", "strictly"),
                      ("down:0-1:for=1s:rate=1%", "belong to a loss"), ("loss:0-1:rate=1%:hold", "hold"),
                      ("down:0-1:for=10x", "duration"), ("down:0-0:for=1s", "two different"),
                      ("cut:0-1:for=1s", "kind 'cut'"), ("down", "KIND:LINK"),
                      ("down:0-1:for=1s:for=2s", "twice"), ("down:0-1:for=1s:when=3", "unknown item"),
                      ("loss:0-1:rate=1%:seed=-1", "seed"), ("down:0-1:for=0s", "more than 0 s")]:
        with pytest.raises(FaultError, match=re.escape(says)) as e:
            parse_spec(bad, 2)
        assert repr(bad) in str(e.value), e.value
    from click.testing import CliRunner

    from lowcomm.cli.wan import wan
    for args, says in [([], "give --down DURATION, --loss RATE or --clear"),
                       (["--hold", "--loss", "1%"], "--hold goes with --down"),
                       (["--loss", "1"], "write 1% for 1 percent"), (["--down", "soon"], "--down 'soon'"),
                       (["--seed", "3", "--down", "1s"], "--seed and --for go with --loss")]:
        out = CliRunner().invoke(wan, ["fault", *args])
        assert out.exit_code == 2 and says in out.output, (args, out.output)


def connects(src: int, dst: int) -> bool:
    """Whether a TCP connection from datacenter ``src`` to ``dst`` opens within 1.5 s."""
    server = subprocess.Popen(["ip", "netns", "exec", f"lowcomm-dc{dst}", sys.executable, "-c",
                               "import socket; s = socket.create_server(('', 7999)); s.settimeout(4); "
                               "print('ready', flush=True); s.accept()"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(["ip", "netns", "exec", f"lowcomm-dc{src}", sys.executable, "-c",
                                 f"import socket; socket.create_connection(('10.77.0.{dst + 1}', 7999), 1.5)"],
                                capture_output=True, timeout=20)
        return client.returncode == 0
    finally:
        server.kill()
        server.wait()


def test_fault_table_drops_holds_and_loses_packets_as_written(tmp_path):
    """The forwarder's side of the control file, in process: a down link drops (or holds until
    it is back), loss draws are seeded per direction and reproducible, faults outside their
    window or on other links do nothing, and a torn file keeps the faults in force."""
    from lowcomm.tools.wan_faults import FaultTable, add, make
    t0 = 1000.0
    add(tmp_path, [make("down", "0-1", at=10, duration=5).at(t0),
                   make("down", "2>0", at=0, duration=3, hold=True).at(t0),
                   make("loss", "1>2", rate=0.25, seed=9).at(t0)])
    table = FaultTable(tmp_path, 3)
    table.poll()
    assert table.verdict(0, 1, t0 + 9.9) == ("pass", 0.0) and table.verdict(0, 1, t0 + 10) == ("drop", 0.0)
    assert table.verdict(1, 0, t0 + 14.9) == ("drop", 0.0) and table.verdict(1, 0, t0 + 15) == ("pass", 0.0)
    assert table.verdict(2, 0, t0 + 1) == ("hold", t0 + 3) and table.verdict(0, 2, t0 + 1) == ("pass", 0.0)
    draws = [table.verdict(1, 2, t0)[0] for _ in range(2000)]
    again = FaultTable(tmp_path, 3)
    again.poll()
    assert draws == [again.verdict(1, 2, t0)[0] for _ in range(2000)]       # seeded: reproducible
    assert 0.2 < draws.count("drop") / 2000 < 0.3 and table.verdict(2, 1, t0) == ("pass", 0.0)
    assert table.counts == {1: 2, 2: 1, 3: draws.count("drop")}
    (tmp_path / "faults.json").write_text('{"faults": [')                    # a torn write
    table.poll()
    assert table.verdict(0, 1, t0 + 12) == ("drop", 0.0)
