"""Fleets of datacenters on this machine (one mpirun per datacenter, the coordinator on
loopback): with no failure the parameters of one MPI job, bit for bit; a datacenter whose
rank is SIGKILLed mid-run does not stop the others and heals back in live; a coordinator
that dies falls back to the checkpoint restart; a datacenter that keeps failing is left out.
The runs share one set-up and run at once (the task sleeps instead of computing). The emulated
WAN's link faults: tests/test_fleet_wan.py."""
import json
import os
import signal
import sys
import time

import pytest

from conftest import cli, scaled
from fleet_helpers import (Run, assert_healed_once, assert_same_model, children, finished, fleet,
                           fleet_from_python, kill_rank0, metrics, outsider, reached, sets,
                           single_job, when)

STEPS, PERIOD = 80, 20
#: the most a fixture's fleets, started together, may take (an idle machine's: a dozen fleets'
#: start-ups share the cores, and the slowest took 120 s of a quiet machine's 170 s): a bound on
#: a hang (under the tests' own 300 s), never a margin a test relies on
DEADLINE_S = 240
#: rounds of about 5 s (longer than a relaunch), converging; on a busy machine the steps, like the
#: relaunch, take longer by the measured slowdown, so a round still outlasts a relaunch
STEP_MS = round(scaled(250))
COMMON = [f"steps={STEPS}", f"task.step_ms={STEP_MS}", "lr=0.05", "optimizer.schedule=cosine",
          "optimizer.min_lr_ratio=0.01"]
DC = f"period={PERIOD},outer_momentum=0.5,algorithm=ring"
RUN = [*COMMON, "strategy.name=diloco", *(f"strategy.{kv}" for kv in DC.split(","))]
POLICY = [*COMMON, "topology=dc:3,rank:1", f"policy.dc=diloco:{DC}", "policy.rank=syncdp"]
#: DiLoCo between 2 datacenters of 2 ranks that shard inside (ZeRO-2): each rank keeps and
#: reduces its range of the outer state with its counterpart
SHARDED = [*COMMON, "topology=dc:2,rank:2", f"policy.dc=diloco:{DC}", "policy.rank=zero2"]
#: DiLoCo with dynamic local updates: a slowed datacenter takes its speed's share of each period;
#: twice the steps, so that the datacenter killed while another is slow is back before the end
#: however long its relaunch takes while a dozen fleets start beside it
LONG = 2 * STEPS
DYLU = [*COMMON, "strategy.name=diloco-dylu", *(f"strategy.{kv}" for kv in DC.split(",")),
        f"steps={LONG}"]
#: asynchronous DiLoCo: each datacenter's pseudo-gradient applied by the coordinator's server as
#: it arrives, with dynamic local updates
ASYNC = [*COMMON, "strategy.name=diloco-async", *(f"strategy.{kv}" for kv in DC.split(","))]
ASYNC_SLOW = [*ASYNC, f"steps={LONG}"]
#: ... with each arrival in flight on a thread while the next TAU steps run
TAU = 2
ASYNC_DELAYED = [*ASYNC, f"strategy.delay={TAU}"]
#: the same over FSDP inside (each rank keeps its chunk of every parameter; bit for bit ZeRO-2's)
FSDP = [*SHARDED[:-1], "policy.rank=fsdp"]
#: DiLoCo with eager updates: each round in flight on a thread for DELAY steps
DELAY = 5
EAGER = [*COMMON, "strategy.name=diloco-eager", *(f"strategy.{kv}" for kv in DC.split(",")),
         f"strategy.delay={DELAY}"]
EAGER_POLICY = [*COMMON, "topology=dc:3,rank:1", f"policy.dc=diloco-eager:{DC},delay={DELAY}",
                "policy.rank=syncdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five runs at once: one MPI job (today's run), a fleet started from Python by
    ``lowcomm.train_fleet`` whose datacenter 2 runs at half speed (``lowcomm fault slow`` from
    outside: no failure, the result unchanged), a fleet whose datacenter 1 loses rank 0 to
    SIGKILL at step 12 (``lowcomm fault kill``), one whose coordinator is SIGKILLed at step 45
    (checkpoints every 20 steps), one whose datacenter 1 keeps failing."""
    tmp = tmp_path_factory.mktemp("fleet")
    deadline = time.monotonic() + scaled(DEADLINE_S)
    started = {
        "single": single_job(tmp / "single", *POLICY),
        # half the step time at half the speed: as long as the others (the sleep is not numerics)
        "plain": fleet_from_python(tmp / "plain", *RUN, f"task.step_ms={STEP_MS // 2}"),
        "kill": fleet(tmp / "kill", *RUN),
        "coord": fleet(tmp / "coord", *RUN, f"checkpoint.every={PERIOD}"),
        # the others wait at step 30 until datacenter 1 has failed its 3 times
        "flaky": fleet(tmp / "flaky", *RUN, "task.crash_dc=1", "task.crash_step=12",
                       "fleet.max_failures=2", f"task.marks={tmp / 'flaky-marks'}",
                       "task.hold_step=30", "task.hold_for=3"),
    }
    killed = {}
    when(lambda: reached(tmp / "kill" / "dc1" / "metrics.jsonl", 12),
         lambda: killed.update(ran=cli("fault", "kill", tmp / "kill", "--dc", "1", "--rank", "0"),
                               lock=(tmp / "kill" / "dc1" / ".lowcomm.lock").read_text()),
         deadline)
    slowed = {}
    when(lambda: (tmp / "plain" / "dc2" / ".lowcomm.lock").exists(),
         lambda: slowed.update(ran=Run(tmp / "slow", [sys.executable, "-m", "lowcomm.cli", "fault",
                                                      "slow", str(tmp / "plain"), "--dc", "2",
                                                      "--speed", "0.5", "--cycle", "200ms"]),
                               lock=(tmp / "plain" / "dc2" / ".lowcomm.lock").read_text()),
         deadline)
    intruded = {}          # a process without the secret at the plain fleet's port, mid-run
    when(lambda: reached(tmp / "plain" / "dc0" / "metrics.jsonl", 12),
         lambda: intruded.update(outsider(tmp / "plain", 3)), deadline)
    coord = started["coord"].p.pid
    when(lambda: reached(tmp / "coord" / "dc0" / "metrics.jsonl", 45),
         lambda: [os.kill(pid, signal.SIGKILL)
                  for pid in children(coord, "lowcomm.run.fleet.coordinator")], deadline)
    done = {name: (r, *r.wait(deadline)) for name, r in started.items()}
    done["killed"], done["intruded"] = killed, intruded
    done["slowed"] = dict(slowed, done=slowed["ran"].wait(deadline) if "ran" in slowed else None)
    return done


@pytest.fixture(scope="module")
def more(runs, tmp_path_factory):
    """After those (not to slow their start-up): a fleet of 2 datacenters under DiLoCo with
    eager updates (rounds in flight on a thread) whose datacenter 1 loses rank 0 at step 12, on
    whose folder a fleet with --overwrite is tried at step 10; the same method over 3
    datacenters as a fleet and as one MPI job; a fleet with a quorum of 2 whose datacenter 2 is
    nearly stopped for about 1.5 periods (late once); one stopped by SIGTERM at step 25; DiLoCo over ZeRO-2 datacenters (``SHARDED``) as one MPI
    job and as a fleet, and over FSDP datacenters as a fleet whose datacenter 1 loses rank 0 at
    step 12; DiLoCo with dynamic local updates and asynchronous DiLoCo, each with datacenter 2
    at half speed while datacenter 1 is killed at step 12 (both from outside: ``lowcomm
    fault``); asynchronous DiLoCo, its arrivals in flight for ``TAU`` steps, stopped by
    SIGTERM at step 25."""
    from lowcomm.errors import RunFolderError
    from lowcomm.tools.fleet_launch import FleetLaunch, prepare
    from lowcomm.tools.slow import slow_datacenter
    tmp = tmp_path_factory.mktemp("fleet-more")
    deadline = time.monotonic() + scaled(DEADLINE_S)
    started = {"pair": fleet(tmp / "pair", *EAGER, dcs=2, np=2), "stop": fleet(tmp / "stop", *RUN),
               "quorum": fleet(tmp / "quorum", *RUN, "fleet.quorum=2", "fleet.grace=0.5"),
               "eager": fleet(tmp / "eager", *EAGER),
               "eager_single": single_job(tmp / "eager_single", *EAGER_POLICY),
               "sharded_single": single_job(tmp / "sharded_single", *SHARDED, np=4),
               "sharded": fleet(tmp / "sharded", *SHARDED, dcs=2, np=4),
               "sharded_kill": fleet(tmp / "sharded_kill", *FSDP, dcs=2, np=4),
               "dylu": fleet(tmp / "dylu", *DYLU), "async": fleet(tmp / "async", *ASYNC_SLOW),
               "async_stop": fleet(tmp / "async_stop", *ASYNC_DELAYED)}
    slow = {}
    for name in ("dylu", "async"):
        when(lambda name=name: reached(tmp / name / "dc1" / "metrics.jsonl", 12),
             lambda name=name: cli("fault", "kill", tmp / name, "--dc", "1"), deadline)
        when(lambda name=name: (tmp / name / "dc2" / ".lowcomm.lock").exists(),
             lambda name=name: slow.update({name: Run(tmp / f"{name}-slow", [
                 sys.executable, "-m", "lowcomm.cli", "fault", "slow", str(tmp / name), "--dc",
                 "2", "--speed", "0.5"])}), deadline)
    late = {}          # datacenter 2 nearly stopped for 8 s (about 1.5 periods) once the
    # second round committed (the first with an interval to derive a grace window from)
    when(lambda: committed(tmp / "quorum", f"t{2 * PERIOD}.f0"),
         lambda: late.update(done=slow_datacenter(tmp / "quorum", 2, 0.1, 0.4, scaled(8))),
         deadline)
    for name in ("pair", "sharded_kill"):
        when(lambda name=name: reached(tmp / name / "dc1" / "metrics.jsonl", 12),
             lambda name=name: kill_rank0(tmp / name / "dc1"), deadline)
    overwrite = {}

    def replace_it():               # in this process (imported before): at once
        try:
            prepare(FleetLaunch(2, 2, None, tuple(RUN), tmp / "pair", "local", overwrite=True))
            overwrite["error"] = None
        except RunFolderError as e:
            overwrite["error"] = str(e)
        overwrite["running"] = not (tmp / "pair" / "summary.json").exists()
    when(lambda: reached(tmp / "pair" / "dc0" / "metrics.jsonl", 10), replace_it, deadline)
    for name in ("stop", "async_stop"):
        when(lambda name=name: reached(tmp / name / "dc0" / "metrics.jsonl", 25),
             lambda name=name: os.kill(started[name].p.pid, signal.SIGTERM), deadline)
    done = {name: (r, *r.wait(deadline)) for name, r in started.items()}
    done["overwrite"] = overwrite
    done["late"] = late
    for name in ("dylu", "async"):
        done[f"{name}_slow"] = slow[name].wait(deadline) if name in slow else None
    return done


def test_with_no_failure_a_fleet_ends_with_the_parameters_of_one_mpi_job(runs):
    single = finished(runs["single"])
    plain = finished(runs["plain"])
    s, ref = plain.summary(), single.summary()
    assert_same_model(s, ref)
    assert s["finished_dcs"] == [0, 1, 2] and not s["fleet"]["failures"]
    assert [r["members"] for r in s["fleet"]["membership"]] == [[0, 1, 2]] * (STEPS // PERIOD)
    assert s["method"] == ref["method"], "the fleet runs the dc level of the same policy"
    assert s["config"]["fleet"]["transport"] == "tls", "its rounds ran over TLS (the default)"


def test_an_outsider_reads_nothing_and_its_forged_replayed_and_garbage_writes_are_dropped(runs):
    """The plain fleet (bit for bit the one MPI job's model, above) had a process without the
    fleet's secret at its coordinator's port mid-run: what it read of a member's message is no
    JSON (sealed); its forged ``failed`` message, its replay of a member's own earlier message and
    its random bytes were each dropped and logged by the coordinator, never acted on (no
    failure, nothing restarted); its forged mailbox message was dropped by the member."""
    did = runs["intruded"]
    assert did.get("read"), "the outsider never ran"
    with pytest.raises(ValueError):
        json.loads(did["read"])
    plain, rc, out = runs["plain"]
    assert rc == 0, out[-3000:]
    events = [json.loads(x) for x in (plain.out / "membership.jsonl").read_text().splitlines()]
    dropped = {e["key"] for e in events if e["event"] == "dropped"}
    inbox = {k for k in did["wrote"] if k.startswith("in/")}
    assert len(inbox) >= 2 and dropped == inbox, (dropped, did["wrote"])
    assert {e["why"] for e in events if e["event"] == "dropped"} == {"does not authenticate"}
    s = plain.summary()
    assert not s["fleet"]["failures"] and not s["fleet"].get("fallbacks"), s["fleet"]
    mailbox = [k for k in did["wrote"] if k.startswith("out/")]
    logged = (plain.out / "dc0" / "stderr.log").read_text()
    assert all(f"'{k}' in the fleet's store does not authenticate" in logged for k in mailbox)


def test_a_slowed_datacenter_is_waited_for_and_the_fleet_summary_says_where_the_time_went(runs):
    slowed = runs["slowed"]
    assert slowed.get("done"), "lowcomm fault slow never started"
    rc, out = slowed["done"]
    assert rc == 0, out[-3000:]
    done = json.loads(out.strip().splitlines()[-1])
    rank0 = int(slowed["lock"].split()[1])           # dc2's job: its lock names rank 0's pid
    assert done["pids"] == [rank0] and done["cycles"] >= 10 and done["stopped_s"] > 0, done
    plain = finished(runs["plain"])
    t = plain.summary()["fleet"]["time"]
    by = t["by_dc"]
    assert sorted(by) == ["0", "1", "2"], by
    for dc, x in by.items():          # the seconds add up
        # every step and sample; this task does not say its tokens: none are guessed
        assert (x["steps"], x["samples"], x["tokens"]) == (STEPS, STEPS * 64, None), x
        assert abs(x["busy_s"] + x["rounds_s"] - x["run_s"]) < 1e-2 and x["idle_s"] <= x["rounds_s"]
    # the two at full speed wait for the slowed one at every round; it hardly waits at all
    assert min(by["0"]["idle_s"], by["1"]["idle_s"]) > 2 * by["2"]["idle_s"], by
    run = sum(x["run_s"] for x in by.values())
    assert abs(t["goodput"] - sum(x["busy_s"] for x in by.values()) / run) < 1e-3, t
    assert abs(t["idle_fraction"] - sum(x["idle_s"] for x in by.values()) / run) < 1e-3, t
    assert t["goodput"] < 1, t


def test_a_killed_datacenter_does_not_stop_the_others_and_heals_back_in_live(runs):
    kill = finished(runs["kill"])
    ran = runs["killed"]["ran"]
    assert ran.returncode == 0, ran.output
    assert json.loads(ran.stdout)["killed"] == [int(runs["killed"]["lock"].split()[1])], ran.output
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
    # admitted at the first round boundary after its new incarnation was ready: it waited at
    # most one round, as long as dc0's rounds took beside it (not a margin the load decides)
    wall = {x["step"]: x["wall_s"] for x in metrics(kill.out / "dc0")}
    round_s = max(wall[t] - wall[t - PERIOD] for t in range(PERIOD * 2, heal["step"] + 1, PERIOD))
    assert heal["wait_s"] <= 1.25 * round_s, (heal, round_s)
    back = [r for r in f["membership"] if 1 in r["joiners"]]
    assert back and back[0]["tag"] == f"t{heal['step']}.admit", f["membership"]
    again = metrics(kill.out / "dc1.1")
    assert again[0]["step"] == heal["step"] + 5 and again[-1]["step"] == STEPS, again
    assert abs(s["eval_loss"] - plain["eval_loss"]) <= 0.01 * plain["eval_loss"], \
        (s["eval_loss"], plain["eval_loss"])
    rows = json.loads((kill.out / "dc0" / "summary.json").read_text())["ledger_rank0"]
    assert any(r["op"] == "heal" and r["bytes_sent"] >= heal["bytes"] for r in rows), rows


def test_a_lost_coordinator_falls_back_to_the_checkpoint_restart(runs):
    coord = finished(runs["coord"])
    s, plain = coord.summary(), runs["plain"][0].summary()
    fb = s["fleet"]["fallbacks"]
    assert len(fb) == 1 and "coordinator ended" in fb[0]["why"] and fb[0]["resumed_from_step"] == 40, fb
    assert s["finished_dcs"] == [0, 1, 2] and s["state_sha256"] == plain["state_sha256"], s


def test_a_datacenter_that_keeps_failing_is_left_out_and_the_run_goes_on(runs):
    flaky = finished(runs["flaky"])
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
    (["--np", "4", "--dcs", "2", *sets(*SHARDED[len(COMMON):]), "--set",
      "policy.dc=diloco-eager:period=4,delay=1"], "'policy.dc.delay'"),
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


def test_of_two_datacenters_a_killed_one_is_admitted_back_to_restore_the_quorum(more):
    """2 datacenters need both for a round: the survivor's round goes ahead for the relaunched
    one's sake, then it is admitted (before: the survivor waited for a quorum forever)."""
    pair = finished(more["pair"])
    s = pair.summary()
    f = s["fleet"]
    assert s["finished_dcs"] == [0, 1] and s["dcs_agree"], s["finished_dcs"]
    assert [x["dc"] for x in f["failures"]] == [1] and [h["dc"] for h in f["heals"]] == [1], f
    back = [r for r in f["membership"] if 1 in r["joiners"]]
    assert back and back[0]["members"] == [0, 1], f["membership"]
    assert f["membership"][-1]["members"] == [0, 1]
    assert metrics(pair.out / "dc1.1")[-1]["step"] == STEPS


def test_eager_updates_across_datacenters_overlap_each_round_and_train_as_one_mpi_job(more):
    """diloco-eager as a fleet: each round runs on the reduction thread while DELAY steps go on,
    lands at the same step as in one MPI job of the same policy, so every step's loss is the
    job's (bit for bit up to the mean's order); the last rounds, still in flight at the end,
    are averaged by the fleet's ring instead of MPI's (eval loss equal to 1e-6)."""
    fl = finished(more["eager"])
    single = finished(more["eager_single"])
    s, ref = fl.summary(), single.summary()
    assert s["finished_dcs"] == [0, 1, 2] and s["dcs_agree"] and not s["fleet"]["failures"], s
    assert s["method"] == ref["method"]
    tags = [r["tag"] for r in s["fleet"]["membership"] if r.get("tag", "").startswith("t")]
    assert tags == [f"t{t}.f0" for t in range(PERIOD, STEPS + 1, PERIOD)], tags
    ours = {}
    for line in metrics(fl.out):
        if "loss" in line and "dc" in line:
            ours.setdefault(line["step"], {})[line["dc"]] = line["loss"]
    theirs = {line["step"]: line["loss"] for line in metrics(single.out) if "loss" in line}
    assert theirs and set(theirs) <= set(ours), (sorted(theirs), sorted(ours))
    for step, loss in theirs.items():
        mean = sum(ours[step].values()) / len(ours[step])
        assert len(ours[step]) == 3 and abs(mean - loss) <= 1e-9 * abs(loss), (step, mean, loss)
    assert abs(s["eval_loss"] - ref["eval_loss"]) <= 1e-6 * abs(ref["eval_loss"])


def test_with_a_quorum_a_late_datacenter_is_not_waited_for_and_its_steps_merge_next_round(
        more, runs):
    """``fleet.quorum = 2``, ``fleet.grace = 0.5``: datacenter 2 nearly stopped for about 1.5
    periods is left out of one round once the others waited half a period for it, is told it is
    late, trains on from the θ it had, and its 2H steps count twice in the next round, where the
    donor hands it the outer state: no failure, one model on every datacenter, the eval loss of
    the synchronous fleet within 5 %."""
    q = finished(more["quorum"])
    assert more["late"].get("done"), "datacenter 2 was never slowed"
    s = q.summary()
    assert s["finished_dcs"] == [0, 1, 2] and s["dcs_agree"] and not s["fleet"]["failures"], s
    events = [json.loads(x) for x in (q.out / "membership.jsonl").read_text().splitlines()]
    over = [e for e in events if e["event"] == "grace_over"]
    assert over and over[0]["late"] == [2] and over[0]["members"] == [0, 1], over
    told = [e for e in events if e["event"] == "late"]
    assert [e["dc"] for e in told] == [2] and told[0]["round"] == over[0]["round"], told
    merged = [e for e in events if e["event"] == "decision" and e.get("catching_up")]
    assert merged and merged[0]["catching_up"] == {"2": 2 * PERIOD} and \
        merged[0]["round"] == over[0]["round"] + 1 and merged[0]["members"] == [0, 1, 2], merged
    plain = runs["plain"][0].summary()["eval_loss"]
    assert abs(s["eval_loss"] - plain) <= 0.05 * plain, (s["eval_loss"], plain)


def committed(out, tag) -> bool:
    """Whether the fleet in ``out`` committed the round ``tag``."""
    try:
        return f'"tag": "{tag}"' in "".join(x for x in (out / "membership.jsonl").read_text()
                                            .splitlines() if '"event": "commit"' in x)
    except OSError:
        return False


def test_a_fleet_of_sharded_datacenters_is_the_one_mpi_job_and_spreads_its_traffic(more):
    """DiLoCo between datacenters that shard inside (``policy.rank=zero2``): the fleet ends with
    the parameters of the same policy run as one MPI job, bit for bit, and the cross-datacenter
    bytes are that job's; each rank sends its own range across (rank 0 about half of its
    datacenter's bytes, not all of them)."""
    single = finished(more["sharded_single"])
    fl = finished(more["sharded"])
    s, ref = fl.summary(), single.summary()
    assert_same_model(s, ref)
    assert s["bytes_by_level"]["dc"] == ref["bytes_by_level"]["dc"], (s["bytes_by_level"],
                                                                       ref["bytes_by_level"])
    dc0 = json.loads((fl.out / "dc0" / "summary.json").read_text())
    assert dc0["sharded"] and dc0["ranks_agree"], dc0
    rank0 = sum(r["bytes_sent"] for r in dc0["ledger_rank0"] if r["level"] == "dc")
    assert 0.4 * dc0["bytes_by_level"]["dc"] <= rank0 <= 0.6 * dc0["bytes_by_level"]["dc"], \
        (rank0, dc0["bytes_by_level"])


def test_a_killed_sharded_datacenter_heals_back_rank_by_rank(more):
    """A datacenter sharded by FSDP that loses rank 0 is relaunched and admitted: each of its
    ranks takes the donor's rank of the same index (its chunks of the model and of the outer
    state), and the fleet ends with every datacenter on the same model, as close to the
    unfaulted fleet (over ZeRO-2, otherwise bit for bit the same) as a heal allows."""
    kill = finished(more["sharded_kill"])
    assert_healed_once(kill.summary(), more["sharded"][0].summary(), 0.02)


def slowed_and_healed(more, name):
    """Fleet ``name``, dc2 at half speed while dc1 was SIGKILLed: it finished with one model,
    dc1 failed once and healed back once, dc2 passed over more of the periods than dc0; (the
    run, its fleet summary, dc0's and dc2's summaries)."""
    run = finished(more[name])
    assert more[f"{name}_slow"] and more[f"{name}_slow"][0] == 0, more[f"{name}_slow"]
    s = run.summary()
    assert s["finished_dcs"] == [0, 1, 2] and s["dcs_agree"], s["finished_dcs"]
    f = s["fleet"]
    assert [x["dc"] for x in f["failures"]] == [1] and [h["dc"] for h in f["heals"]] == [1], f
    dc = {d: json.loads((run.out / f"dc{d}" / "summary.json").read_text()) for d in (0, 2)}
    slow, fast = dc[2]["local_steps"], dc[0]["local_steps"]
    assert slow["passed"] > fast["passed"] and min(slow["by_period"]) < PERIOD, (slow, fast)
    return run, f, dc


def test_dynamic_local_updates_let_a_slowed_datacenter_take_fewer_steps_while_another_heals(more):
    """dc2 at half speed, dc1 SIGKILLed and healed back: the run finishes with one model; dc2
    took its share of each period (the rest passed over, its tokens fewer), the others theirs."""
    run, f, dc = slowed_and_healed(more, "dylu")
    slow, fast = dc[2]["local_steps"], dc[0]["local_steps"]
    assert len(slow["by_period"]) == len(fast["by_period"]) == LONG // PERIOD, (slow, fast)
    assert dc[2]["passed_steps"] == slow["passed"] and dc[2]["steps_done"] == LONG
    by = f["time"]["by_dc"]
    assert by["2"]["steps"] == LONG - slow["passed"] < by["0"]["steps"], by


def test_asynchronous_diloco_goes_on_without_a_killed_datacenter_and_heals_it_while_one_is_slow(
        more):
    """dc2 at half speed, dc1 SIGKILLed: no rounds — each arrival applied by the coordinator's
    server at once; dc0 and dc2 kept arriving while dc1 was down; dc1 took the live state from the
    next member to arrive; dc2 passed over its share of the periods; one model at the end."""
    run, f, dc = slowed_and_healed(more, "async")
    assert f["arrivals"]["0"] == LONG // PERIOD + 1 and not f["membership"], f["arrivals"]
    events = [json.loads(x) for x in (run.out / "membership.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "decision"], "a round in an asynchronous fleet"
    down = next(e["t"] for e in events if e["event"] == "failure")
    back = next(e for e in events if e["event"] == "admitted")
    meanwhile = {e["dc"] for e in events if e["event"] == "arrival" and down < e["t"] < back["t"]}
    assert meanwhile and meanwhile <= {0, 2}, "nobody arrived while datacenter 1 was down"
    assert back["dc"] == 1 and back["donor"] in (0, 2) and back["step"] % PERIOD == 0, back
    finals = [e for e in events if e["event"] == "arrival" and e["final"]]
    assert sorted(e["dc"] for e in finals) == [0, 1, 2] and events[-1]["event"] == "over"
    assert (run.out / "server.pt").exists()


def test_a_stopped_asynchronous_fleet_stops_at_one_boundary_and_resumes_its_servers_state(more):
    """SIGTERM: every member stops at the first period boundary all can reach, once the
    arrival sent there has landed (τ steps on) and the stop vote is through (with a checkpoint
    there); the server's state is saved; --resume loads it and ends with one model."""
    from lowcomm.run.lockstep import STOP_VOTE_LAG
    stop, rc, out = more["async_stop"]
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    s = stop.summary()
    step = s["stopped"]["step"]
    assert 25 <= step < STEPS and step % PERIOD == TAU + STOP_VOTE_LAG, s["stopped"]
    for dc in range(3):
        assert (stop.out / f"dc{dc}" / "checkpoints" / f"step-{step:08d}").is_dir()
    import torch
    saved = torch.load(stop.out / "server.pt", weights_only=True)
    again = Run(stop.out.with_name("async-resumed"), [sys.executable, "-m", "lowcomm.cli",
                                                      "train", "--dcs", "3", "--resume",
                                                      str(stop.out), "--place", "local"])
    rc, out = again.wait(time.monotonic() + 120)
    assert rc == 0, out[-3000:]
    s = stop.summary()
    assert s["finished_dcs"] == [0, 1, 2] and s["dcs_agree"], s
    loaded = [json.loads(x) for x in (stop.out / "membership.jsonl").read_text().splitlines()
              if '"server_state"' in x]
    assert loaded and loaded[-1]["arrivals"] == saved["arrivals"] > 0, loaded


def test_overwrite_on_a_running_fleets_folder_is_refused_and_deletes_nothing(more):
    tried = more["overwrite"]
    assert tried.get("running"), f"not tried while the fleet ran: {tried}"
    assert tried["error"] and "is in use by another run (pid" in tried["error"], tried
    pair, rc, out = more["pair"]
    assert rc == 0 and pair.summary()["finished_dcs"] == [0, 1], out[-2000:]
    assert [r["step"] for r in pair.summary()["fleet"]["membership"]][0] == PERIOD
    for f in ("dc0/config.json", "dc0/metrics.jsonl", "membership.jsonl", "coordinator.log"):
        assert (pair.out / f).exists(), f


def test_after_a_coordinator_fallback_each_metrics_line_is_credited_once(runs):
    coord = runs["coord"][0]
    lines = [x for x in metrics(coord.out) if "event" not in x]
    keys = [(x["dc"], x["step"]) for x in lines]
    assert sorted(keys) == sorted(set(keys)), "a datacenter's line appears twice"
    assert sorted(keys) == [(dc, st) for dc in range(3) for st in range(5, STEPS + 1, 5)], keys
    assert {x["inc"] for x in lines if x["step"] <= 40} == {0}, "the first launch ran up to 40"
    assert {x["inc"] for x in lines if x["step"] > 40} == {1}, "the resumed one ran the rest"
    runs_of = coord.summary()["fleet"]["datacenters"]
    for dc in ("0", "1", "2"):
        assert [(i["first_step"], i["last_step"]) for i in runs_of[dc]] == [(5, 40), (45, STEPS)], runs_of


def test_a_stopped_fleet_writes_its_checkpoints_says_how_to_resume_and_resumes(runs, more):
    """SIGTERM: every datacenter stops after the same round with a checkpoint, the fleet says how
    to continue and exits 143; --resume ends with the parameters of the run never stopped."""
    stop, rc, out = more["stop"]
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    s = stop.summary()
    step = s["stopped"]["step"]
    assert s["stopped"]["signal"] == "SIGTERM" and 25 <= step < STEPS, s["stopped"]
    assert f"continue with: lowcomm train --dcs 3 --resume {stop.out}" in out, out[-2000:]
    assert not s["fleet"]["failures"] and "Aborted" not in out
    for dc in range(3):
        assert (stop.out / f"dc{dc}" / "checkpoints" / f"step-{step:08d}").is_dir()
    again = Run(stop.out.with_name("stop-resumed"), [sys.executable, "-m", "lowcomm.cli", "train",
                                                     "--dcs", "3", "--resume", str(stop.out),
                                                     "--place", "local"])
    rc, out = again.wait(time.monotonic() + 120)
    assert rc == 0, out[-3000:]
    s, plain = stop.summary(), runs["plain"][0].summary()
    assert s["finished_dcs"] == [0, 1, 2] and s["state_sha256"] == plain["state_sha256"], s
    assert [x["resumed_from"] for x in s["fleet"]["datacenters"]["0"]] == [step]
    before = _files(stop.out)
    r = cli("train", "--dcs", "3", "--resume", stop.out, "--place", "local")
    assert r.returncode != 0 and "the fleet there finished" in r.stderr, r.output
    assert _files(stop.out) == before


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lowcomm.lock"}


@pytest.fixture(scope="module")
def stopped_single(tmp_path_factory):
    """A single run's folder as a run stopped before its end leaves it: config, metrics,
    checkpoints, no summary."""
    out = tmp_path_factory.mktemp("single") / "run"
    rc, log = single_job(out, "steps=4", "task.step_ms=0", "checkpoint.every=2",
                         "strategy.name=diloco", "strategy.period=2", np=1).wait(time.monotonic() + 120)
    assert rc == 0, log[-2000:]
    (out / "summary.json").unlink()
    return out


def test_a_fleet_refuses_a_stopped_single_runs_folder_without_overwrite(stopped_single):
    before = _files(stopped_single)
    r = cli("train", "--dcs", "2", "--np", "2", "--place", "local", "--out", stopped_single,
            *sets("strategy.name=diloco"))
    assert r.returncode != 0 and f"{stopped_single} holds another run (checkpoints, config.json, " \
        "metrics.jsonl" in r.stderr and "--overwrite" in r.stderr, r.output
    assert _files(stopped_single) == before


def test_fleet_overwrite_removes_only_what_a_fleet_wrote_by_its_marker(stopped_single, tmp_path, runs):
    """Beside the user's own dc2023_backup/model.bin, dc1-notes.txt and dc7/: a single run's
    folder is refused (nothing changes); in a fleet's folder only the fleet's files and the
    folders its marker names go."""
    import shutil
    from lowcomm.errors import RunFolderError
    from lowcomm.run.fleet.folder import lock_key
    from lowcomm.run.folder import close_run
    from lowcomm.tools.fleet_launch import FleetLaunch, prepare
    from lowcomm.tools.slow import slow_datacenter
    user = {"dc2023_backup/model.bin": b"weights", "dc1-notes.txt": b"notes", "dc7/mine.txt": b"mine"}
    for name, src in (("single", stopped_single), ("fleet", runs["flaky"][0].out)):
        out = tmp_path / name
        shutil.copytree(src, out)
        for f, data in user.items():
            (out / f).parent.mkdir(exist_ok=True)
            (out / f).write_bytes(data)
        before = _files(out)
        r = cli("train", "--dcs", "2", "--np", "2", "--place", "local", "--out", out,
                *sets("strategy.name=diloco"))
        assert r.returncode != 0 and "replace it with --overwrite" in r.stderr, r.output
        if name == "single":
            with pytest.raises(RunFolderError, match="holds a single run .* not a fleet's"):
                prepare(FleetLaunch(2, 2, None, ("strategy.name=diloco",), out, "local",
                                    overwrite=True))
            assert _files(out) == before
            continue
        r = cli("train", "--out", out, "--overwrite", "--set", "steps=1")
        assert r.returncode != 0 and "holds a fleet's run" in r.stderr, r.output
        assert _files(out) == before, "a single run's --overwrite took a fleet's files"
        prepare(FleetLaunch(2, 2, None, ("strategy.name=diloco",), out, "local", overwrite=True))
        close_run(lock_key(out))
        assert sorted(p.name for p in out.iterdir() if p.name != ".lowcomm.lock") == \
            ["dc1-notes.txt", "dc2023_backup", "dc7"], list(out.iterdir())
        assert _files(out) == user


def test_a_finished_datacenter_whose_job_does_not_exit_is_ended_and_not_counted_failed(tmp_path,
                                                                                       monkeypatch):
    """The supervisor's rule, in-process: a member said it finished (``bye``), its job (here a
    process that sleeps) has not exited EXIT_GRACE_S later: the fleet ends it, records why, and
    counts no failure; a job that has not said so is left running."""
    import queue
    import subprocess
    from lowcomm.run.fleet import supervisor
    from lowcomm.run.fleet.supervisor import Fleet, Incarnation
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 0.5)
    fleet_ = Fleet.__new__(Fleet)
    fleet_.coord, fleet_.events, fleet_.over = object(), queue.Queue(), True
    fleet_.failures, fleet_.retired, fleet_.due = {0: 0, 1: 0}, {}, {}
    procs = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(2)]
    try:
        fleet_.jobs = {dc: Incarnation(dc, 0, tmp_path / f"dc{dc}", p, False, time.monotonic())
                       for dc, p in enumerate(procs)}
        fleet_.events.put((fleet_.coord, {"event": "bye", "dc": 0, "inc": 0, "reason": "finished"}))
        fleet_._read_events()
        fleet_._end_lingering(time.monotonic())
        assert procs[0].poll() is None, "ended before its grace ran out"
        time.sleep(0.6)
        fleet_._end_lingering(time.monotonic())
        job = fleet_.jobs[0]
        assert procs[0].wait(10) == -signal.SIGKILL and procs[1].poll() is None
        fleet_._ended(job, time.monotonic())
        assert job.cause.startswith("finished, but its job had not exited 0.5 s later"), job.cause
        assert job.done and job.exit == -signal.SIGKILL, "its results count; its exit is told"
        assert fleet_.failures == {0: 0, 1: 0} and list(fleet_.jobs) == [1]
    finally:
        for p in procs:
            p.kill()
            p.wait()
