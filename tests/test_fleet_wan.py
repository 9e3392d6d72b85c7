"""A fleet on the emulated WAN (root; run alone: it uses the global network namespaces): 3
datacenters, 25 ms and 100 Mbit/s between them, DiLoCo across, the coordinator in datacenter
0. The link 0-1 taken down for longer than the allowance: datacenter 1 is left out while the
others go on, then healed back in live once the link returns. An outage shorter than the
allowance changes nothing: the parameters are those of the unfaulted run, bit for bit."""
import fcntl
import os
import time

import pytest

from conftest import scaled
from fleet_helpers import finished, fleet, metrics, reached, when
from test_wan import lowcomm, nothing_left

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="WAN emulation needs root")

#: the allowance: comm.outage_s = 1 s, so a datacenter silent for 2.5 s is out
#: (2 heartbeats of 0.5 s + 10 x a 50 ms round trip + 1 s)
RUN = ["steps=80", "task.step_ms=100", "strategy.name=diloco", "strategy.period=10",
       "strategy.algorithm=ring"]
LONG_S, SHORT_S = 6, 0.5


def fault(link: str, seconds: float) -> None:
    r = lowcomm("wan", "fault", "--link", link, "--down", f"{seconds}s")
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def wan_runs(tmp_path_factory):
    """Under the WAN helpers' lock: the WAN up; an unfaulted fleet on this machine (the
    reference) beside a fleet on the WAN whose link 0-1 goes down for 0.5 s at step 25; then
    a fleet on the WAN whose link 0-1 goes down for 6 s at step 15. The WAN down after."""
    tmp = tmp_path_factory.mktemp("fleet-wan")
    lock = open("/tmp/lowcomm-wan-helper.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    assert nothing_left(), "a WAN of ours was up before the test; run 'lowcomm wan down'"
    try:
        r = lowcomm("wan", "up", "--dcs", "3", "--delay-ms", "25", "--rate-mbit", "100")
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + scaled(150)
        ref = fleet(tmp / "ref", *RUN, place="local")
        short = fleet(tmp / "short", *RUN, place="wan")
        when(lambda: reached(tmp / "short" / "dc0" / "metrics.jsonl", 25),
             lambda: fault("0-1", SHORT_S), deadline)
        done = {"ref": (ref, *ref.wait(deadline)), "short": (short, *short.wait(deadline))}
        long = fleet(tmp / "long", *RUN, place="wan")
        def long_fault():           # the outage starts inside the command (its start-up)
            before = time.time()
            fault("0-1", LONG_S)
            (tmp / "fault_at").write_text(f"{before} {time.time()}")
        when(lambda: reached(tmp / "long" / "dc0" / "metrics.jsonl", 15), long_fault,
             deadline + scaled(60))
        done["long"] = (long, *long.wait(deadline + scaled(60)))
        done["fault_at"] = tuple(map(float, (tmp / "fault_at").read_text().split()))
        yield done
    finally:
        lowcomm("wan", "down")
        assert nothing_left(), "the WAN was left behind"
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def test_an_outage_within_the_allowance_leaves_the_parameters_bit_identical(wan_runs):
    ref = finished(wan_runs["ref"])
    short = finished(wan_runs["short"])
    s = short.summary()
    assert s["state_sha256"] == ref.summary()["state_sha256"] and s["dcs_agree"], s
    assert not s["fleet"]["failures"] and all(r["members"] == [0, 1, 2]
                                              for r in s["fleet"]["membership"])
    assert "ip netns exec lowcomm-dc1" in (short.out / "dc1" / "stderr.log").read_text()


def test_a_link_down_past_the_allowance_leaves_the_datacenter_out_then_heals_it_back(wan_runs):
    long = finished(wan_runs["long"])
    s = long.summary()
    f = s["fleet"]
    fail = f["failures"][0]
    assert [x["dc"] for x in f["failures"]] == [1] and fail["detected_by"].startswith("the coord")
    began, set_by = wan_runs["fault_at"]        # the outage began between these two times
    assert "no heartbeat" in fail["cause"] and began < fail["t"] < set_by + LONG_S, fail
    out_rounds = [r for r in f["membership"] if ".f" in r["tag"] and r["members"] == [0, 2]]
    assert out_rounds, "no round went on without datacenter 1"
    heal = f["heals"][0]
    assert heal["dc"] == 1 and heal["t"] > began + LONG_S, (heal, began)
    assert f["membership"][-1]["members"] == [0, 1, 2] and s["finished_dcs"] == [0, 1, 2]
    assert s["dcs_agree"] and f["steps_lost"] == {"0": 0, "2": 0}, f["steps_lost"]
    for dc in (0, 2):
        assert [x["step"] for x in metrics(long.out / f"dc{dc}")] == list(range(5, 81, 5))
