"""Fleets of datacenters on this machine (one mpirun per datacenter, the coordinator on
loopback): with no failure the parameters of one MPI job, bit for bit; a datacenter whose
rank is SIGKILLed mid-run does not stop the others and heals back in live; a coordinator
that dies falls back to the checkpoint restart; a datacenter that keeps failing is left out.
The runs share one set-up and run at once (the task sleeps instead of computing). The emulated
WAN's link faults: tests/test_fleet_wan.py."""
import json
import os
import signal
import time

import pytest

from conftest import cli, scaled
from fleet_helpers import (children, fleet, fleet_from_python, kill_rank0, metrics, reached,
                           single_job, when)

STEPS, PERIOD = 80, 20
#: rounds of about 5 s (longer than a relaunch), converging; on a busy machine the steps, like the
#: relaunch, take longer by the measured slowdown, so a round still outlasts a relaunch
STEP_MS = round(scaled(250))
COMMON = [f"steps={STEPS}", f"task.step_ms={STEP_MS}", "lr=0.05", "optimizer.schedule=cosine",
          "optimizer.min_lr_ratio=0.01"]
DC = f"period={PERIOD},outer_momentum=0.5,algorithm=ring"
RUN = [*COMMON, "strategy.name=diloco", *(f"strategy.{kv}" for kv in DC.split(","))]
POLICY = [*COMMON, "topology=dc:3,rank:1", f"policy.dc=diloco:{DC}", "policy.rank=syncdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five runs at once: one MPI job (today's run), an unfaulted fleet (started from Python by
    ``lowcomm.train_fleet``), a fleet whose
    datacenter 1 loses rank 0 to SIGKILL at step 12, one whose coordinator is SIGKILLed at
    step 45 (checkpoints every 20 steps), one whose datacenter 1 keeps failing."""
    tmp = tmp_path_factory.mktemp("fleet")
    deadline = time.monotonic() + scaled(170)
    started = {
        "single": single_job(tmp / "single", *POLICY),
        "plain": fleet_from_python(tmp / "plain", *RUN),
        "kill": fleet(tmp / "kill", *RUN),
        "coord": fleet(tmp / "coord", *RUN, f"checkpoint.every={PERIOD}"),
        "flaky": fleet(tmp / "flaky", *RUN, "task.crash_dc=1", "task.crash_step=12",
                       "fleet.max_failures=2"),
    }
    when(lambda: reached(tmp / "kill" / "dc1" / "metrics.jsonl", 12),
         lambda: kill_rank0(tmp / "kill" / "dc1"), deadline)
    coord = started["coord"].p.pid
    when(lambda: reached(tmp / "coord" / "dc0" / "metrics.jsonl", 45),
         lambda: [os.kill(pid, signal.SIGKILL)
                  for pid in children(coord, "lowcomm.run.coordinator")], deadline)
    done = {name: (r, *r.wait(deadline)) for name, r in started.items()}
    return done


def test_with_no_failure_a_fleet_ends_with_the_parameters_of_one_mpi_job(runs):
    single, rc, out = runs["single"]
    assert rc == 0, out[-3000:]
    plain, rc, out = runs["plain"]
    assert rc == 0, out[-3000:]
    s, ref = plain.summary(), single.summary()
    assert s["state_sha256"] == ref["state_sha256"] and s["dcs_agree"], (s, ref["state_sha256"])
    assert s["finished_dcs"] == [0, 1, 2] and not s["fleet"]["failures"]
    assert [r["members"] for r in s["fleet"]["membership"]] == [[0, 1, 2]] * (STEPS // PERIOD)
    assert s["method"] == ref["method"], "the fleet runs the dc level of the same policy"


def test_a_killed_datacenter_does_not_stop_the_others_and_heals_back_in_live(runs):
    kill, rc, out = runs["kill"]
    assert rc == 0, out[-3000:]
    s, plain = kill.summary(), runs["plain"][0].summary()
    f = s["fleet"]
    assert s["finished_dcs"] == [0, 1, 2] and s["dcs_agree"], s["finished_dcs"]
    assert [x["dc"] for x in f["failures"]] == [1] and "signal 9" in f["failures"][0]["cause"]
    assert f["steps_lost"] == {"0": 0, "2": 0}, f["steps_lost"]
    for dc in (0, 2):               # every step taken and logged, one incarnation each
        steps = [x["step"] for x in metrics(kill.out / f"dc{dc}")]
        assert steps == list(range(5, STEPS + 1, 5)), (dc, steps)
        assert [i["exit"] for i in f["datacenters"][str(dc)]] == [0]
    heal = f["heals"][0]
    assert heal["dc"] == 1 and heal["step"] % PERIOD == 0 and heal["bytes"] > 0, heal
    assert heal["rounds_since_failure"] <= 2, heal
    back = [r for r in f["membership"] if 1 in r["joiners"]]
    assert back and back[0]["tag"] == f"t{heal['step']}.admit", f["membership"]
    again = metrics(kill.out / "dc1.1")
    assert again[0]["step"] == heal["step"] + 5 and again[-1]["step"] == STEPS, again
    assert abs(s["eval_loss"] - plain["eval_loss"]) <= 0.01 * plain["eval_loss"], \
        (s["eval_loss"], plain["eval_loss"])
    rows = json.loads((kill.out / "dc0" / "summary.json").read_text())["ledger_rank0"]
    assert any(r["op"] == "heal" and r["bytes_sent"] >= heal["bytes"] for r in rows), rows


def test_a_lost_coordinator_falls_back_to_the_checkpoint_restart(runs):
    coord, rc, out = runs["coord"]
    assert rc == 0, out[-3000:]
    s, plain = coord.summary(), runs["plain"][0].summary()
    fb = s["fleet"]["fallbacks"]
    assert len(fb) == 1 and "coordinator ended" in fb[0]["why"] and fb[0]["resumed_from_step"] == 40, fb
    assert s["finished_dcs"] == [0, 1, 2] and s["state_sha256"] == plain["state_sha256"], s


def test_a_datacenter_that_keeps_failing_is_left_out_and_the_run_goes_on(runs):
    flaky, rc, out = runs["flaky"]
    assert rc == 0, out[-3000:]
    s = flaky.summary()
    f = s["fleet"]
    assert [x["dc"] for x in f["left_out"]] == [1] and "failed 3 times" in f["left_out"][0]["why"]
    assert [i["exit"] != 0 for i in f["datacenters"]["1"]] == [True] * 3
    assert s["finished_dcs"] == [0, 2] and f["steps_lost"] == {"0": 0, "2": 0}
    assert [r["members"] for r in f["membership"]][-1] == [0, 2]


@pytest.mark.parametrize("args,says", [
    (["--np", "4"], "4 ranks do not split evenly over 3 datacenters"),
    (["--np", "3", "--set", "strategy.name=syncdp"], "'strategy.name': syncdp synchronises every step"),
    (["--np", "3", "--set", "strategy.name=diloco", "--set", "strategy.compressor=int8"],
     "'policy.dc.compressor'"),
    (["--np", "3", "--set", "strategy.name=streaming-diloco", "--set", "strategy.period=4",
      "--set", "strategy.delay=1"], "'policy.dc.delay'"),
    (["--np", "3", "--set", "strategy.name=diloco", "--set", "fleet.heal_inner=keep"],
     "'fleet.heal_inner': unknown value 'keep'"),
    (["--set", "strategy.name=diloco"], "--dcs needs --np"),
])
def test_what_a_fleet_cannot_run_is_refused_before_anything_starts(args, says, tmp_path):
    r = cli("train", "--dcs", "3", "--out", tmp_path / "x", *args)
    assert r.returncode != 0 and says in r.stderr, r.output
    assert not (tmp_path / "x").exists()


def test_train_fleet_refuses_a_bad_argument_before_anything_starts(tmp_path):
    import lowcomm
    from lowcomm.errors import ArgumentError
    with pytest.raises(ArgumentError, match="argument 'place': unknown value 'moon'"):
        lowcomm.train_fleet(overrides=["strategy.name=diloco"], dcs=3, np=3, out=tmp_path / "x",
                            place="moon")
    assert not (tmp_path / "x").exists()


def test_a_fleet_config_outside_a_fleet_is_an_error_naming_the_key(tmp_path):
    r = cli("train", "--out", tmp_path / "x", "--set", "fleet.dcs=3", "--set", "steps=1")
    assert r.returncode != 0 and "'fleet.dcs': a fleet is launched" in r.stderr, r.output
