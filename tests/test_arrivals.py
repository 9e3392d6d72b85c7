"""Asynchronous DiLoCo's arrivals, with no process: the coordinator's arrival server against the
paper's delayed Nesterov written out here, and the membership's rules for arrivals (answered at
once, the final ones together, a joiner handed over by the next member to arrive, a stop at a
boundary every member reaches); a coordinator serving real arrivals through its store; the
method refused where it means nothing."""
import json
import subprocess
import sys

import pytest
import torch

from lowcomm.errors import ConfigError
from lowcomm.run.fleet.arrivals import Arrivals
from lowcomm.run.fleet.membership import Membership, Timeouts
from lowcomm.run.fleet.rounds import Rounds
from lowcomm.run.fleet.server import ArrivalServer


def delayed_nesterov(theta, arrivals, lr, beta, n):
    """Liu et al. 2024, §3.2, from the equations: d ← d + g; every N-th arrival m ← β·m + d/N,
    θ ← θ − η·β·m − η·g/N, d ← 0; otherwise θ ← θ − η·g/N."""
    theta, d, m = theta.clone(), torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(arrivals, start=1):
        d = d + g
        if t % n == 0:
            m = beta * m + d / n
            theta = theta - lr * beta * m - lr * g / n
            d = torch.zeros_like(theta)
        else:
            theta = theta - lr * g / n
    return theta


def test_the_server_applies_each_arrival_with_delayed_nesterov_as_the_paper_writes_it():
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(50, generator=gen)
    deltas = [torch.randn(50, generator=gen) * 0.1 for _ in range(7)]
    s = ArrivalServer(lr=0.7, momentum=0.5, every=3)
    s.start(theta0)
    for k, g in enumerate(deltas):
        s.arrive(k % 3, g)
        want = delayed_nesterov(theta0, deltas[:k + 1], 0.7, 0.5, 3)
        assert torch.allclose(s.theta.detach(), want, atol=1e-6), k
    assert s.arrivals == 7
    s.start(torch.zeros(50))                       # θ in place: a later first arrival changes nothing
    assert torch.allclose(s.theta.detach(), want, atol=1e-6)
    s.arrive(1, None)                              # nothing to apply: no arrival counted
    assert s.arrivals == 7 and torch.allclose(s.theta.detach(), want, atol=1e-6)


def test_the_servers_state_resumes_mid_cycle_and_refuses_other_settings():
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(20, generator=gen) for _ in range(5)]
    a = ArrivalServer(0.5, 0.9, 2)
    a.start(torch.ones(20))
    for g in deltas[:3]:
        a.arrive(0, g)
    b = ArrivalServer(0.5, 0.9, 2)
    b.load_state_dict(a.state_dict())
    for g in deltas[3:]:
        a.arrive(1, g)
        b.arrive(1, g)
    assert torch.equal(a.theta.detach(), b.theta.detach()) and b.arrivals == 5
    with pytest.raises(ValueError, match="ran with"):
        ArrivalServer(0.5, 0.9, 3).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="sent 3 values"):
        a.arrive(0, torch.zeros(3))


def test_the_buffers_handed_back_are_the_mean_of_each_members_latest():
    s = ArrivalServer(0.7, 0.5, 2)
    s.start(torch.zeros(2))
    s.arrive(0, torch.zeros(2), torch.tensor([1.0, 2.0]))
    s.arrive(1, torch.zeros(2), torch.tensor([3.0, 4.0]))
    s.arrive(0, torch.zeros(2), torch.tensor([5.0, 6.0]))      # replaces member 0's
    assert torch.equal(s.mean_buffers(), torch.tensor([4.0, 5.0]))


class Fleet:
    """A Membership of arrivals driven by hand (``say``, ``tick``, ``mail``)."""

    def __init__(self, dcs=3, min_dcs=2, founders=True):
        self.now = 0.0
        self.m = Membership(dcs, min_dcs, self.now, Timeouts(3.0, start_s=10.0, quorum_s=20.0),
                            Arrivals())
        self.n = {d: 0 for d in range(dcs)}
        for d in range(dcs if founders else 0):
            self.say(d, "hello")

    def say(self, dc, kind, inc=0, **fields):
        self.m.message({"type": kind, "dc": dc, "inc": inc, **fields}, self.now)

    def arrive(self, dc, step, final=False, period=10, speed=1.0):
        self.say(dc, "arrive", self.m.sites[dc].inc, n=self.n[dc], step=step, period=period,
                 steps=period, speed=speed, final=final)
        self.n[dc] += 1

    def serve(self):
        """The coordinator's part: answer what is queued, then the released final ones."""
        answered = [(d, self.m.policy.answer(d, msg, 0)) for d, _, msg in self.m.policy.queue]
        self.m.policy.queue.clear()
        answered += [(d, self.m.policy.answer(d, msg, 0)) for d, _, msg in self.m.policy.barrier]
        self.m.policy.barrier = []
        return answered

    def mail(self, dc):
        return [msg for d, _, msg in self.m.outbox if d == dc]


def test_arrivals_are_answered_at_once_with_every_members_speed_and_none_waits():
    f = Fleet()
    f.arrive(2, 10, speed=4.0)
    f.m.tick(f.now)
    (dc, a), = f.serve()
    assert dc == 2 and a["speeds"] == [0.0, 0.0, 4.0] and a["halt"] is None and not a["donate"]
    f.now += 0.5
    f.arrive(0, 10, speed=8.0)
    f.arrive(0, 20, speed=8.0)                     # dc 0 twice before dc 1 once: nobody waits
    f.m.tick(f.now)
    answers = f.serve()
    assert [d for d, _ in answers] == [0, 0]
    # how long after the first to reach the same step each came (what catches it up)
    assert a["behind_s"] == 0 and [x["behind_s"] for _, x in answers] == [0.5, 0]
    assert [e["dc"] for e in f.m.events if e["event"] == "arrival"] == [2, 0, 0]


def test_how_far_behind_a_member_is_leaves_out_the_lag_it_started_with():
    f = Fleet(founders=False)
    for d, at in ((0, 0.0), (1, 0.3), (2, 0.3)):
        f.now = at
        f.say(d, "hello")
    f.now = 10.0
    for d in (0, 1, 2):
        f.arrive(d, 10)
        f.now += 0.4                               # dc 1 started 0.3 s late, dc 2 likewise
    f.m.tick(f.now)
    assert [round(x["behind_s"], 6) for _, x in f.serve()] == [0, 0.1, 0.5]
    f.m.down(1, 0, "killed", f.now)
    f.say(1, "hello", inc=1, joining=True)
    f.say(0, "donated", to=[1], key="k", step=10, bytes=1)   # (no donor asked: ignored)
    f.m.policy.donor_of[1] = 0
    f.say(0, "donated", to=[1], key="k", step=10, bytes=1)
    f.n[1] = 0
    f.arrive(1, 10)                                # a joiner: where it came in is its start
    f.m.tick(f.now)
    assert [x["behind_s"] for _, x in f.serve()] == [0]


def test_the_final_arrivals_are_held_until_every_active_member_sent_its_own():
    f = Fleet()
    f.arrive(0, 30, final=True)
    f.arrive(1, 30, final=True)
    f.m.tick(f.now)
    assert f.serve() == [], "answered before datacenter 2's final arrival"
    f.arrive(2, 20)                                # still training: answered at once
    f.m.tick(f.now)
    assert [d for d, _ in f.serve()] == [2]
    f.m.down(2, 0, "killed", f.now)                # out: the others no longer wait for it
    f.m.tick(f.now)
    assert sorted(d for d, _ in f.serve()) == [0, 1]


def test_a_joining_datacenter_is_handed_over_by_the_next_member_to_arrive():
    f = Fleet()
    f.m.down(1, 0, "killed", f.now)
    f.say(1, "hello", inc=1, joining=True)
    f.arrive(2, 20)
    f.m.tick(f.now)
    (_, a), = f.serve()
    assert a["donate"] == [1] and f.m.policy.donor_of == {1: 2}
    f.m.down(2, 0, "killed", f.now)                # the donor died before handing over
    assert f.m.policy.donor_of == {1: None}
    f.arrive(0, 20)
    f.m.tick(f.now)
    (_, a), = f.serve()
    assert a["donate"] == [1]
    f.say(0, "donated", to=[1], key="state/1/0.0/20", step=20, bytes=99)
    got = f.mail(1)[-1]
    assert got["type"] == "admitted" and got["step"] == 20 and got["key"] == "state/1/0.0/20"
    assert f.m.sites[1].state == "active" and not f.m.policy.donor_of


def test_a_stop_ends_every_member_at_the_first_boundary_each_can_still_reach():
    f = Fleet()
    f.arrive(0, 40)
    f.arrive(1, 30)
    f.arrive(2, 20)
    f.m.tick(f.now)
    f.serve()
    f.m.halt(15)
    assert f.m.policy.halt_at == 50                       # the furthest member's next boundary
    f.arrive(2, 30)
    f.m.tick(f.now)
    (_, a), = f.serve()
    assert a["halt"] == [50, 15]


def test_an_arrival_in_a_fleet_of_rounds_is_fenced():
    m = Membership(2, 2, 0.0, Timeouts(3.0), Rounds())
    for d in range(2):
        m.message({"type": "hello", "dc": d, "inc": 0}, 0.0)
    m.message({"type": "arrive", "dc": 0, "inc": 0, "n": 0, "step": 10, "period": 10}, 0.0)
    assert [msg["type"] for d, _, msg in m.outbox if d == 0] == ["fence"]


def test_a_coordinator_serves_arrivals_through_its_store(monkeypatch):
    """The real coordinator process: two members' arrivals through its store, each answered with
    the θ the server holds after it (delayed Nesterov as written out above)."""
    import secrets
    from lowcomm.run.fleet.channel import Channel
    from lowcomm.run.fleet.store import Seat
    from lowcomm.run.fleet.trust import session_env
    session = session_env(secrets.token_bytes(32))
    for name, value in session.items():
        monkeypatch.setenv(name, value)
    p = subprocess.Popen([sys.executable, "-m", "lowcomm.run.fleet.coordinator", "--dcs", "2",
                          "--min-dcs", "1", "--limit-s", "30",
                          "--server", json.dumps({"lr": 0.7, "momentum": 0.5, "every": 2})],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline().split()[1])
        chans = []
        for d in range(2):
            p.stdin.write(json.dumps({"cmd": "launch", "dc": d, "inc": 0}) + "\n")
            p.stdin.flush()
            chans.append(Channel(f"127.0.0.1:{port}", Seat(dc=d, dcs=2), arrivals=True))
            chans[-1].send("hello", joining=False, ranks=1)
        gen = torch.Generator().manual_seed(2)
        theta0 = torch.randn(1000, generator=gen)
        deltas, order = [torch.randn(1000, generator=gen) * 0.1 for _ in range(3)], [0, 1, 0]
        for k, (d, g) in enumerate(zip(order, deltas)):
            theta, buffers, answer = chans[d].arrive(g, theta0, torch.tensor([float(d)]), step=10,
                                                     period=10, steps=10, speed=1.0 + d)
            assert torch.allclose(theta, delayed_nesterov(theta0, deltas[:k + 1], 0.7, 0.5, 2),
                                  atol=1e-6), k
            assert answer["arrivals"] == k + 1
        assert answer["speeds"] == [1.0, 2.0] and torch.equal(buffers, torch.tensor([0.5]))
        assert chans[0].ledger.rows()[0]["op"] == "arrival"
        for c in chans:
            c.close()
        # a member holding another secret fails at once, naming the coordinator's address
        from lowcomm.run.fleet.store import FleetError, store_client
        monkeypatch.setenv("LOWCOMM_FLEET_SECRET", secrets.token_bytes(32).hex())
        with pytest.raises(FleetError, match=f"authentication failed with the coordinator at "
                                             f"127.0.0.1:{port}"):
            store_client(f"127.0.0.1:{port}", 5.0, 1, 0)
    finally:
        p.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
        p.stdin.flush()
        p.wait(30)


@pytest.mark.parametrize("sets, key", [
    ([], "strategy.name"),                                         # one MPI job
    (["fleet.dcs=3", "strategy.warmup_steps=5"], "strategy.warmup_steps"),
    (["fleet.dcs=3", "strategy.bn_recompute=4"], "strategy.bn_recompute"),
    (["fleet.dcs=3", "strategy.outer_optimizer=nesterov"], "strategy.outer_optimizer"),
    (["strategy.name=syncdp", "fleet.dcs=3", "topology=dc:3,rank:1", "policy.dc=diloco",
      "policy.rank=diloco-async"], "policy.rank"),                # not the level across
])
def test_diloco_async_where_it_means_nothing_is_refused_naming_the_key(sets, key):
    from lowcomm.run.config import load_config
    from lowcomm.run.registry import check
    with pytest.raises(ConfigError) as e:
        check(load_config(None, ["strategy.name=diloco-async", *sets]))
    assert e.value.key == key, str(e.value)
