"""The fleet coordinator's decisions (lowcomm.run.fleet.membership), with no process: rounds, the
quorum that keeps a partition from splitting the run, fencing, admission, retries, the end."""
import pytest

from lowcomm.comm.round_tag import RoundTag, TagKind
from lowcomm.run.fleet.membership import Membership, NoQuorum, Timeouts
from lowcomm.run.fleet.rounds import MAX_ATTEMPTS, Rounds


class Fleet:
    """A Membership driven by hand: ``say`` sends a member's message, ``mail(dc)`` reads what
    the coordinator put in dc's mailbox since the last look."""

    def __init__(self, dcs=3, min_dcs=2, limit_s=3.0, founders=True):
        self.now = 0.0
        self.m = Membership(dcs, min_dcs, self.now, Timeouts(limit_s, start_s=10.0, quorum_s=20.0),
                            Rounds())
        self.read = 0
        if founders:
            for d in range(dcs):
                self.say(d, "hello")

    def say(self, dc, kind, inc=0, **fields):
        self.m.message({"type": kind, "dc": dc, "inc": inc, **fields}, self.now)

    def tick(self, dt=0.0, beat=()):
        self.now += dt
        for d in beat:
            self.m.heartbeat(d, self.m.sites[d].inc, self.now)
        self.m.tick(self.now)

    def mail(self, dc):
        return [msg for d, _, msg in self.m.outbox if d == dc]

    def events(self, kind):
        return [e for e in self.m.events if e["event"] == kind]

    def ready(self, dcs, tag="t4.f0", **extra):
        for d in dcs:
            self.say(d, "ready", self.m.sites[d].inc, round=self.m.policy.round, tag=tag, numel=10,
                     **extra)

    def done(self, dcs, ok=True):
        for d in dcs:
            self.say(d, "done", self.m.sites[d].inc, round=self.m.policy.round,
                     attempt=self.m.policy.attempt, ok=ok, error=None if ok else "peer gone")

    def round(self, dcs, tag="t4.f0", **extra):
        self.ready(dcs, tag, **extra)
        self.tick()
        d = self.m.policy.decision
        self.done(d["members"])
        self.tick()
        return d


def test_a_round_is_decided_when_every_member_is_ready_and_committed_when_every_one_is_done():
    f = Fleet()
    f.ready([0, 1])
    f.tick()
    assert f.m.policy.decision is None, "decided before datacenter 2 was ready"
    f.ready([2])
    f.tick()
    d = f.m.policy.decision
    assert d["members"] == [0, 1, 2] and d["tag"] == "t4.f0" and d["donor"] == 0, d
    assert all(f.mail(i)[-1]["type"] == "decision" for i in range(3))
    f.done([0, 1])
    f.tick()
    assert f.m.policy.round == 0, "committed before datacenter 2 reported"
    f.done([2])
    f.tick()
    assert f.m.policy.round == 1 and all(
        f.mail(i)[-1] == {"type": "outcome", "round": 0, "commit": True} for i in range(3))


def test_a_datacenter_whose_job_ended_is_out_at_once_and_the_others_go_on():
    f = Fleet()
    f.round([0, 1, 2])
    f.ready([0, 2], "t8.f0")
    f.m.down(1, 0, "killed by SIGKILL", f.now)
    f.tick()
    assert f.m.policy.decision["members"] == [0, 2] and f.m.policy.decision["round"] == 1
    fail = f.events("failure")[0]
    assert fail["dc"] == 1 and fail["cause"] == "killed by SIGKILL" and not fail["kill"], fail
    assert f.mail(1)[-1]["type"] == "fence"


def test_a_silent_datacenter_is_out_after_the_limit_but_only_while_a_quorum_remains():
    f = Fleet(limit_s=3.0)
    f.ready([0, 2])
    f.tick(2.9, beat=[0, 2])
    assert f.m.policy.decision is None and f.m.sites[1].state == "active"
    f.tick(0.2, beat=[0, 2])
    assert f.m.sites[1].state == "gone" and f.m.policy.decision["members"] == [0, 2]
    assert f.events("failure")[0]["kill"], "the fleet must tear a silent datacenter's job down"
    # a partition: 0 alone cannot count 2 out (it would be a minority deciding alone)
    f.done([0, 2])
    f.tick()
    f.ready([0])
    f.tick(5.0, beat=[0])
    assert f.m.sites[2].state == "active" and f.m.policy.phase == "collect", "a minority decided"
    assert f.events("no_quorum"), "waiting without a quorum is logged"
    with pytest.raises(NoQuorum, match="only 1 of the 2"):
        f.tick(30.0, beat=[0])


def test_a_fenced_incarnation_is_answered_with_a_fence_whatever_it_says_later():
    f = Fleet()
    f.m.down(1, 0, "link down", f.now)
    f.tick()
    f.m.outbox.clear()
    f.say(1, "ready", round=0, tag="t4.f0", numel=10)
    assert f.mail(1) == [], "fenced once only"
    f.m.sites[1].fenced.clear()
    f.say(1, "ready", round=0, tag="t4.f0", numel=10)
    assert f.mail(1)[0]["type"] == "fence" and 1 not in f.m.policy.readies


def test_a_relaunched_datacenter_is_admitted_at_the_next_boundary_with_a_donor():
    f = Fleet()
    f.m.down(1, 0, "killed", f.now)
    f.round([0, 2], "t4.f0")
    f.say(1, "hello", inc=1, joining=True)
    assert f.m.sites[1].state == "joining" and f.m.sites[1].inc == 1
    d = f.round([0, 2], "t8.f0")
    assert d["admit_next"] and d["members"] == [0, 2], d
    f.ready([0, 2], "t8.admit", admit=True)
    f.tick()
    a = f.m.policy.decision
    assert a["members"] == [0, 1, 2] and a["joiners"] == [1] and a["donor"] == 0, a
    assert [m for d, inc, m in f.m.outbox if d == 1 and inc == 1][-1]["type"] == "decision"
    f.done([0, 1, 2])
    f.tick()
    assert f.m.sites[1].state == "active" and f.events("admitted")[0]["dc"] == 1
    assert f.round([0, 1, 2], "t12.f0")["members"] == [0, 1, 2]


def test_a_round_that_failed_goes_again_without_the_dead_member_and_in_a_new_group():
    f = Fleet()
    d0 = f.round([0, 1, 2])
    f.ready([0, 1, 2], "t8.f0")
    f.tick()
    first = f.m.policy.decision
    assert first["group"] == d0["group"], "an unchanged membership keeps its gloo group"
    f.done([0, 2], ok=False)                 # 1 died half-way through the reduction
    f.tick()
    assert f.m.policy.round == 1 and f.m.policy.decision is first, \
        "retried before 1's fate was known"
    f.m.down(1, 0, "killed", f.now)
    f.tick()
    again = f.m.policy.decision
    assert again["attempt"] == 1 and again["members"] == [0, 2] and again["group"] != first["group"]
    assert f.mail(0)[-2] == {"type": "outcome", "round": 1, "commit": False}
    assert f.events("retry")[0]["failed"] == {0: "peer gone", 2: "peer gone"}
    f.done([0, 2])
    f.tick()
    assert f.m.policy.round == 2


def test_a_round_failing_every_attempt_makes_the_coordinator_give_up():
    f = Fleet()
    f.ready([0, 1, 2])
    with pytest.raises(NoQuorum, match=f"failed {MAX_ATTEMPTS} times"):
        for _ in range(MAX_ATTEMPTS):
            f.tick()
            f.done([0, 1, 2], ok=False)
            f.tick()


def test_datacenters_at_different_synchronisations_are_an_error_naming_them():
    f = Fleet()
    f.ready([0, 1], "t4.f0")
    f.ready([2], "t8.f0")
    with pytest.raises(NoQuorum, match="2: t8.f0"):
        f.tick()


def test_founders_are_awaited_then_counted_out_when_they_never_come():
    f = Fleet(founders=False)
    f.say(0, "hello")
    f.say(2, "hello")
    f.ready([0, 2])
    f.tick(5.0, beat=[0, 2])
    assert f.m.policy.decision is None, "decided while founder 1 may still be starting"
    f.tick(6.0, beat=[0, 2])
    assert f.m.sites[1].state == "gone" and f.m.policy.decision["members"] == [0, 2]


def test_the_end_tells_a_waiting_datacenter_that_it_was_not_admitted():
    f = Fleet()
    f.m.down(1, 0, "killed", f.now)
    f.say(1, "hello", inc=1, joining=True)
    for d in (0, 2):
        f.say(d, "bye", reason="finished")
    f.tick()
    assert f.m.over and [m for d, inc, m in f.m.outbox if d == 1][-1] == {"type": "over"}
    f.say(1, "hello", inc=2, joining=True)
    assert [m for d, inc, m in f.m.outbox if (d, inc) == (1, 2)] == [{"type": "over"}]


def test_a_job_that_failed_says_so_and_is_out_at_once_and_a_retired_one_is_fenced():
    f = Fleet()
    f.say(2, "bye", reason="failed")
    assert f.m.sites[2].state == "gone" and "its job failed" in f.events("failure")[0]["cause"]
    f.m.retire(2, "failed 4 times")
    f.say(2, "hello", inc=3, joining=True)
    assert [m for d, inc, m in f.m.outbox if (d, inc) == (2, 3)][0]["type"] == "fence"
    assert f.events("left_out")[0] == {**f.events("left_out")[0], "dc": 2, "why": "failed 4 times"}


def test_nobody_left_to_hand_the_state_on_is_an_error():
    f = Fleet(dcs=2, min_dcs=1)
    f.m.down(0, 0, "killed", f.now)
    f.m.down(1, 0, "killed", f.now)
    with pytest.raises(NoQuorum, match="no datacenter is left"):
        f.tick()


def test_of_two_datacenters_a_relaunched_one_is_admitted_to_restore_the_quorum():
    """2 datacenters (a quorum of 2), one killed: the other's round goes ahead once the
    relaunched one says hello (it would else wait for a quorum that only the admission round
    restores), then the admission round brings it back."""
    f = Fleet(dcs=2, min_dcs=2)
    f.round([0, 1], "t4.f0")
    f.m.down(1, 0, "killed", f.now)
    f.ready([0], "t8.f0")
    f.tick(1.0, beat=[0])
    assert f.m.policy.decision is None or f.m.policy.decision["round"] == 0, \
        "decided without a quorum"
    assert f.events("no_quorum")
    f.say(1, "hello", inc=1, joining=True)
    f.tick()
    d = f.m.policy.decision
    assert d["round"] == 1 and d["members"] == [0] and d["admit_next"], d
    f.done([0])
    f.tick()
    f.ready([0], "t8.admit", admit=True)
    f.tick()
    a = f.m.policy.decision
    assert a["members"] == [0, 1] and a["joiners"] == [1] and a["donor"] == 0, a
    f.done([0, 1])
    f.tick()
    assert f.m.sites[1].state == "active" and f.events("admitted")[0]["dc"] == 1
    assert f.round([0, 1], "t12.f0")["members"] == [0, 1]


def test_too_few_datacenters_left_in_the_run_make_the_coordinator_give_up_at_once():
    f = Fleet(dcs=2, min_dcs=2)
    f.m.down(1, 0, "killed", f.now)
    f.m.retire(1, "failed 4 times")
    with pytest.raises(NoQuorum, match=r"only datacenter\(s\) \[0\] are left .* a round needs 2"):
        f.tick()


def test_a_halt_rides_on_the_next_decision_and_a_stopped_member_is_no_failure():
    f = Fleet()
    f.m.down(1, 0, "killed", f.now)
    f.say(1, "hello", inc=1, joining=True)
    f.m.halt(15)
    assert [m for d, inc, m in f.m.outbox if (d, inc) == (1, 1)][-1] == {"type": "over"}
    d = f.round([0, 2], "t8.f0")
    assert d["halt"] == 15 and d["members"] == [0, 2] and not d["joiners"], d
    for dc in (0, 2):
        f.say(dc, "bye", reason="stopped")
    f.tick()
    assert not f.events("failure")[1:] and f.m.over, f.m.events


def test_a_halt_stops_a_datacenter_left_without_a_quorum():
    """2 datacenters, one relaunching: a stop must not wait for a quorum that cannot come."""
    f = Fleet(dcs=2, min_dcs=2)
    f.m.down(1, 0, "killed", f.now)
    f.ready([0], "t8.f0")
    f.tick()
    assert f.m.policy.phase == "collect", "decided without a quorum"
    f.m.halt(2)
    f.tick()
    d = f.m.policy.decision
    assert d["members"] == [0] and d["halt"] == 2, d


def _paced(quorum=2, grace=0.5):
    """A fleet with a quorum and a grace window whose first two rounds came 10 s apart."""
    f = Fleet()
    f.m.policy.quorum, f.m.policy.grace = quorum, grace
    for tag in ("t4.f0", "t8.f0"):
        f.round([0, 1, 2], tag)
        f.tick(10.0, beat=(0, 1, 2))
    assert f.m.policy.grace_s() == pytest.approx(5.0)        # half the median interval
    return f


def test_with_a_quorum_a_round_waits_the_grace_window_then_leaves_the_slow_one_late():
    f = _paced()
    f.ready([0, 1], "t12.f0")
    f.tick(4.9, beat=(0, 1, 2))
    assert f.m.policy.decision["tag"] == "t8.f0", "decided before the grace window ended"
    f.tick(0.2, beat=(0, 1, 2))
    d = f.m.policy.decision
    assert d["tag"] == "t12.f0" and d["members"] == [0, 1] and d["late"] == [2], d
    assert f.events("grace_over")[-1]["late"] == [2]
    f.done([0, 1])
    f.tick()
    assert f.m.policy.round == 3 and f.m.sites[2].state == "active", "late is not dead"
    # its ready for the round that went without it: told it is late, its 8 steps carried on
    f.say(2, "ready", round=2, tag="t12.f0", numel=10, steps=8)
    late = [m for m in f.mail(2) if m["type"] == "late"]
    assert late and late[-1]["round"] == 2 and late[-1]["members"] == [0, 1], f.mail(2)
    # the next round waits for it however long (it must catch up), then merges its steps (all
    # 16 since the older outer state it trained from)
    f.ready([0, 1], "t16.f0")
    f.tick(60.0, beat=(0, 1, 2))
    assert f.m.policy.decision["round"] == 2, "went ahead without a datacenter catching up"
    f.ready([2], "t16.f0", steps=16, carried=True)
    f.tick()
    d = f.m.policy.decision
    assert d["members"] == [0, 1, 2] and d["catching_up"] == {"2": 16} and d["donor"] == 0, d
    f.done([0, 1, 2])
    f.tick()
    assert f.m.policy.catching_up == set() and f.m.policy.late == {}


def test_the_first_rounds_an_admission_and_a_late_one_are_waited_for():
    f = Fleet()
    f.m.policy.quorum, f.m.policy.grace = 2, 0.5
    f.ready([0, 1])
    f.tick(100.0, beat=(0, 1, 2))
    assert f.m.policy.decision is None, \
        "no interval seen yet: nothing to derive a grace window from"
    f = _paced()
    f.ready([0, 1], "t12.f0", admit=True)
    f.tick(100.0, beat=(0, 1, 2))
    assert f.m.policy.decision["tag"] == "t8.f0", "an admission round left a datacenter out"


def test_a_late_datacenters_ready_for_another_synchronisation_is_fenced():
    f = _paced()
    f.ready([0, 1], "t12.f0")
    f.tick(6.0, beat=(0, 1, 2))
    f.done([0, 1])
    f.tick()
    f.say(2, "ready", round=2, tag="t13.f0", numel=10, steps=8)
    assert any(m["type"] == "fence" and "t12.f0" in m["why"] for m in f.mail(2)), f.mail(2)


@pytest.mark.parametrize("sets,key", [
    (["fleet.quorum=3"], "fleet.quorum"), (["fleet.quorum=1"], "fleet.quorum"),
    (["fleet.quorum=2"], "fleet.grace"), (["fleet.grace=0.2"], "fleet.grace")])
def test_a_quorum_or_grace_that_cannot_be_met_is_refused_naming_the_key(sets, key):
    from lowcomm.errors import ConfigError
    from lowcomm.run.api import load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, ["fleet.dcs=3", *sets])
    assert e.value.key == key, str(e.value)


def test_every_rule_acts_through_a_method_of_the_membership_and_every_state_has_its_rules():
    from lowcomm.run.fleet.membership import RULES, State
    assert all(callable(getattr(Membership, "_" + r.act, None)) for r in RULES if r.act)
    assert {s for r in RULES for s in r.states} == set(State)


@pytest.mark.parametrize("state,kind,to", [
    ("expected", "hello", "active"), ("gone", "join", "joining"), ("active", "join", "joining"),
    ("finished", "hello", "active"), ("retired", "hello", "retired"), ("stopped", "join", "joining")])
def test_a_new_incarnations_hello_goes_where_the_table_says(state, kind, to):
    from lowcomm.run.fleet.membership import Msg, State
    f = Fleet()
    f.m.sites[1].state = State(state)
    rule = f.m.rule(State(state), Msg(kind))
    f.say(1, "hello", inc=1, joining=kind == "join")
    assert f.m.sites[1].state == to and (rule is None or rule.to in (to, "gone")), rule
    new = [m["type"] for d, inc, m in f.m.outbox if (d, inc) == (1, 1)]
    assert new == (["fence"] if to == "retired" else []), new


def test_a_message_of_an_unknown_type_is_fenced_naming_it():
    f = Fleet()
    f.say(0, "gossip")
    assert f.mail(0) == [{"type": "fence", "why": "a message of unknown type 'gossip'"}]


def test_a_ready_whose_tag_is_no_round_tag_is_fenced_naming_it():
    f = Fleet()
    f.ready([0], "step-4")
    assert f.mail(0)[-1]["type"] == "fence" and "'step-4'" in f.mail(0)[-1]["why"]
    assert 0 not in f.m.policy.readies


@pytest.mark.parametrize("text,tag", [
    ("t40.f0", RoundTag.sync(40, 0)), ("t8.admit", RoundTag.admit(8)),
    ("finish.f3", RoundTag.finish(3)), ("span12", RoundTag.span(12))])
def test_a_round_tag_reads_back_what_it_writes(text, tag):
    assert str(tag) == text and RoundTag.parse(text) == tag
    assert (tag.step is not None) == (tag.kind in (TagKind.SYNC, TagKind.ADMIT))


@pytest.mark.parametrize("text", ["t40", "t40.f", "tx.f0", "finish.fx", "t-1.f0", "span", "", None])
def test_a_text_that_is_no_round_tag_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="not a round tag"):
        RoundTag.parse(text)


def test_a_round_tag_without_the_fields_its_kind_names_is_refused():
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        RoundTag(TagKind.SYNC, fragment=0)
    with pytest.raises(ValueError, match="names no fragment"):
        RoundTag(TagKind.ADMIT, step=4, fragment=0)


def test_a_relaunch_counts_the_old_incarnation_out_with_how_long_it_was_silent():
    f = Fleet()
    f.tick(2.0, beat=[0, 2])
    f.say(1, "hello", inc=1, joining=True)
    fail = f.events("failure")[0]
    assert (fail["dc"], fail["inc"], fail["silent_s"]) == (1, 0, 2.0), fail
    assert fail["cause"] == "relaunched as incarnation 1" and fail["was"] == "active", fail
    assert [m["type"] for d, inc, m in f.m.outbox if (d, inc) == (1, 0)] == ["fence"]
    assert (f.m.sites[1].state, f.m.sites[1].inc) == ("joining", 1)
