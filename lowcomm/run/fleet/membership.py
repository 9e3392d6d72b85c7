"""The fleet coordinator's decisions, as a state machine: messages and the clock go in, mailbox
messages and log events come out (:mod:`lowcomm.run.fleet.coordinator` moves them through the
store; :mod:`lowcomm.run.fleet.channel` is the members' side).

Each datacenter (a *site*) is ``expected`` (a founder not heard of yet), ``active`` (takes part
in rounds), ``joining`` (a relaunched job waiting to be admitted), ``gone`` (failed: fenced),
``finished`` or ``retired`` (left out after failing too often). Rules:

* **Rounds.** A round is decided when every active site is ready for it (the same tag on all:
  the same synchronisation of the same step) or found dead. Its members reduce; the round is
  committed only when every member reports its reduction complete; a member that failed or died
  makes the round go again without it (``attempt`` + 1, a new gloo group).
* **Quorum with a grace window** (``quorum`` > 0): once ``quorum`` active sites are ready, the
  round waits ``grace`` × the median interval between the last rounds' decisions (observed, so
  it follows the fleet's pace: never a fixed timeout) for the others, then goes ahead without
  them. A site left out so is *late*, not dead: its ready for that round is answered with
  ``late`` (it keeps its local progress and its pseudo-gradient), and the next round waits for
  it and names it in ``catching_up`` with the steps it carries, so its contribution is merged
  there, weighted by its steps, and the ``donor`` hands it the outer state that round made. A
  site late already, an admission round and the first round (no interval seen yet) wait for
  every site.
* **Dead.** A site whose job ended (the fleet says so: ``down``) is out at once; one silent
  for ``limit_s`` (no heartbeat, no message) is out only if the others keep a quorum — so a
  partition never splits the run: the side without ``min_dcs`` datacenters waits, and
  ``quorum_s`` without a quorum ends the coordinator (the fleet then restarts from
  checkpoints). A site counted out is *fenced*: every later message of that incarnation is
  answered with ``fence``, and the fleet tears its job down and relaunches it.
* **Admission.** A decision while a site is joining says ``admit_next``; at their next round
  boundary the members hold an admission round, whose members include the joining sites and
  whose ``donor`` (the lowest active member) sends them the live state. Admission needs
  ``min_dcs`` sites counting the joiners; so does the round before it: a round that lacks a
  quorum only until the joiners are admitted goes ahead (2 datacenters, one relaunched: the
  other's round, then the admission round restores the quorum). Fewer than ``min_dcs`` sites
  that are not left out can never make a quorum again: the coordinator gives up at once.
* **Stop.** Told to halt (the fleet got SIGINT/SIGTERM), every decision says ``halt``: each
  member stops at that round's boundary and writes its checkpoint (all at the same step) and
  says ``bye`` (stopped); joining sites are told ``over``. That round goes ahead without a
  quorum (its members only checkpoint and stop; a resume starts from the newest step
  ``min_dcs`` of them hold).
* **Arrivals** (``arrivals``: the fleet runs asynchronous DiLoCo,
  :mod:`~lowcomm.run.fleet.server`): there are no rounds. Each member's ``arrive`` is queued
  for the coordinator's arrival server (:attr:`queue`) and answered at once (:meth:`answer`)
  with the members' latest speeds and how long after the first member to reach the same step
  it came, less the lag it started with (a founder's hello after the first founder's; a
  joiner's first arrival); nobody waits for anybody. A member's last arrival
  (``final``) is held until every active member has sent its own (or is out): then all are
  applied and every member takes the same θ (one model at the end). A joining site is given
  a donor, the next active member to arrive, which hands it its live state at that boundary
  (``donated``; the site is then ``admitted`` and active). Told to halt, the members stop at
  the first period boundary every one of them can still reach, S = the latest arrival's step
  + its period (each answer from then on says ``halt`` with S).
* **End.** When no site is active any more and one has finished, joining sites are told
  ``over``; when none has finished, nobody is left to hand the state on: the coordinator gives
  up (the fleet restarts from checkpoints).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ...errors import LowcommError

#: attempts of one round before the coordinator gives up (a fault that every retry meets)
MAX_ATTEMPTS = 8

LIVE = ("expected", "active", "joining")


class NoQuorum(LowcommError):
    """The coordinator cannot decide: fewer than ``min_dcs`` datacenters for too long, or a
    round that fails every time. The fleet falls back to its checkpoints."""


@dataclass
class Site:
    """One datacenter as the coordinator sees it."""
    dc: int
    seen: float                       # the clock of its last heartbeat or message
    inc: int = 0                      # incarnation of its job (0: the first launch)
    state: str = "expected"
    hello_at: float | None = None     # when a joining incarnation said hello
    fenced: set = field(default_factory=set)


class Membership:
    """The coordinator's state (module docstring). ``dcs`` founders, a quorum of ``min_dcs``,
    ``limit_s`` of silence before a site is out, ``start_s`` for a founder's first hello,
    ``quorum_s`` without a quorum before giving up."""

    def __init__(self, dcs: int, min_dcs: int, limit_s: float, now: float,
                 start_s: float = 300.0, quorum_s: float = 600.0, quorum: int = 0,
                 grace: float = 0.0, arrivals: bool = False):
        if not 1 <= min_dcs <= dcs:
            raise ValueError(f"min_dcs must be in [1, {dcs}], got {min_dcs}")
        if quorum and not (min_dcs <= quorum <= dcs and grace > 0):
            raise ValueError(f"quorum must be in [min_dcs={min_dcs}, {dcs}] with grace > 0, got "
                             f"quorum={quorum}, grace={grace}")
        self.quorum, self.grace = quorum, grace
        self.arrivals = arrivals                   # asynchronous: arrivals, no rounds
        self.queue: list[tuple[int, int, dict]] = []   # arrivals for the server, in order
        self.finals: dict[int, dict] = {}          # final arrivals held for the end
        self.barrier: list[tuple[int, int, dict]] = []  # the final ones, released together
        self.steps: dict[int, int] = {}            # each site's latest arrival: step, period
        self.speeds: dict[int, float] = {}
        self.donor_of: dict[int, int | None] = {}  # joining site -> the member handing it over
        self.halt_at: int | None = None
        self.first_at: dict[int, float] = {}       # step -> when its first arrival came
        self.started: dict[int, float] = {}        # founder -> when it said hello
        self.skew: dict[int, float] = {}           # site -> its start's lag behind the first
        self.decided_at: list[float] = []          # when the last rounds were decided
        self.arrived: dict[int, float] = {}        # when each site said ready for this round
        self.late: dict[int, dict] = {}            # site -> the round it was left out of
        self.catching_up: set[int] = set()         # sites whose steps go back to a round before
        self.sites = {i: Site(i, now) for i in range(dcs)}
        self.min_dcs, self.limit_s, self.start_s, self.quorum_s = min_dcs, limit_s, start_s, quorum_s
        self.round, self.attempt, self.phase = 0, 0, "collect"
        self.readies: dict[int, dict] = {}
        self.decision: dict | None = None
        self.dones: dict[int, dict] = {}
        self.group, self.group_members = None, None
        self.short_since: float | None = None      # since when without a quorum
        self.outbox: list[tuple[int, int, dict]] = []
        self.events: list[dict] = []
        self.over = False
        self.halt_signum = 0                      # the fleet was stopped: decisions say halt

    # output ---------------------------------------------------------------------------------
    def _mail(self, dc: int, msg: dict, inc: int | None = None) -> None:
        self.outbox.append((dc, self.sites[dc].inc if inc is None else inc, msg))

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"event": kind, "t": time.time(), **fields})

    def _fence(self, dc: int, inc: int, why: str) -> None:
        site = self.sites[dc]
        if inc not in site.fenced:
            site.fenced.add(inc)
            self._mail(dc, {"type": "fence", "why": why}, inc)

    # input ----------------------------------------------------------------------------------
    def message(self, msg: dict, now: float) -> None:
        """A member's message (``hello``, ``ready``, ``done``, ``healed``, ``bye``)."""
        site = self.sites[msg["dc"]]
        if msg["type"] == "hello" and (msg["inc"] > site.inc or site.state == "expected"):
            self._hello(site, msg, now)
            return
        if msg["inc"] != site.inc or site.state not in (*LIVE, "finished", "stopped"):
            self._fence(site.dc, msg["inc"], f"incarnation {msg['inc']} of datacenter "
                        f"{site.dc} is no longer a member")
            return
        site.seen = now
        getattr(self, "_on_" + msg["type"])(site, msg, now)

    def _hello(self, site: Site, msg: dict, now: float) -> None:
        if site.state in ("active", "joining") and msg["inc"] > site.inc:
            self._out(site, f"relaunched as incarnation {msg['inc']}", now, kill=False)
        if site.state == "retired":
            self._fence(site.dc, msg["inc"], "left out of the run after failing too often")
            return
        site.inc, site.seen = msg["inc"], now
        if self.over or self.halt_signum and msg.get("joining"):     # nobody left to admit it
            site.state = "late"
            self._mail(site.dc, {"type": "over"})
            return
        site.state = "joining" if msg.get("joining") else "active"
        site.hello_at = now if msg.get("joining") else None
        if self.arrivals and msg.get("joining"):
            self.donor_of[site.dc] = None          # the next member to arrive hands it over
        self.skew.pop(site.dc, None)
        if msg.get("joining"):
            self.started.pop(site.dc, None)
        else:
            self.started[site.dc] = now
        self._event("hello", dc=site.dc, inc=site.inc, joining=bool(msg.get("joining")),
                    round=self.round)

    def _on_ready(self, site: Site, msg: dict, now: float) -> None:
        late = self.late.get(site.dc)
        if late is not None and msg["round"] == late["round"] and site.state == "active":
            if msg.get("tag") != late["tag"]:
                self._fence(site.dc, site.inc, f"ready for round {msg['round']} with "
                            f"{msg.get('tag')} after it committed {late['tag']}")
                return
            del self.late[site.dc]                 # answered: it carries its steps on
            self.catching_up.add(site.dc)
            self._mail(site.dc, {"type": "late", "round": late["round"], "tag": late["tag"],
                                 "members": late["members"]})
            self._event("late", dc=site.dc, inc=site.inc, round=late["round"], tag=late["tag"],
                        late_s=round(now - late["at"], 3))
            return
        if msg["round"] != self.round or site.state != "active":
            self._fence(site.dc, site.inc, f"ready for round {msg['round']} while the fleet is "
                        f"at round {self.round}")
            return
        self.readies[site.dc] = msg
        self.arrived.setdefault(site.dc, now)
        if msg.get("carried"):                     # late before (a restart forgot it): catches up
            self.catching_up.add(site.dc)

    def _on_arrive(self, site: Site, msg: dict, now: float) -> None:
        if not self.arrivals or site.state != "active":
            self._fence(site.dc, site.inc, f"an arrival from datacenter {site.dc} while it is "
                        f"{site.state}" + ("" if self.arrivals else " in a fleet of rounds"))
            return
        self.steps[site.dc] = (int(msg["step"]), int(msg["period"]))
        self.speeds[site.dc] = float(msg.get("speed") or 0.0)
        self._event("arrival", dc=site.dc, inc=site.inc, n=msg["n"], step=msg["step"],
                    steps=msg.get("steps"), speed=msg.get("speed"), final=bool(msg.get("final")))
        if self.halt_signum and self.halt_at is None:
            self.halt_at = int(msg["step"])        # the first boundary after the halt
        first = self.first_at.setdefault(int(msg["step"]), now)
        if len(self.first_at) > 64:
            del self.first_at[min(self.first_at)]
        if site.dc not in self.skew:               # a founder: how much later it started; a
            self.skew[site.dc] = now - first if site.dc not in self.started else \
                self.started[site.dc] - min(self.started.values())   # joiner: where it came in
        msg = dict(msg, behind_s=max(0.0, now - first - self.skew[site.dc]))
        if msg.get("final"):
            self.finals[site.dc] = msg
        else:
            self.queue.append((site.dc, site.inc, msg))

    def answer(self, dc: int, msg: dict, arrivals: int) -> dict:
        """The coordinator's answer to ``dc``'s arrival ``msg`` once the server applied it
        (``arrivals`` in all so far): the members' speeds (by datacenter, 0 for one not heard
        yet), how long after the first member to reach this step it arrived less the lag it
        started with (``behind_s``),
        the halt step, and the joining sites this member hands its state to."""
        donate = []
        if not msg.get("final"):
            for j, donor in sorted(self.donor_of.items()):
                if donor is None and self.sites[j].state == "joining":
                    self.donor_of[j] = dc
                    donate.append(j)
        return {"type": "arrived", "n": msg["n"], "arrivals": arrivals,
                "speeds": [self.speeds.get(d, 0.0) for d in sorted(self.sites)],
                "behind_s": round(float(msg.get("behind_s", 0.0)), 6),
                "halt": [self.halt_at, self.halt_signum] if self.halt_signum else None,
                "donate": donate}

    def _on_donated(self, site: Site, msg: dict, now: float) -> None:
        for j in msg["to"]:
            joiner = self.sites[j]
            if self.donor_of.get(j) != site.dc or joiner.state != "joining":
                continue                           # it left meanwhile
            del self.donor_of[j]
            joiner.state = "active"
            self._mail(j, {"type": "admitted", "key": msg["key"], "step": msg["step"],
                           "donor": site.dc, "bytes": msg.get("bytes", 0)})
            self._event("admitted", dc=j, inc=joiner.inc, step=msg["step"], donor=site.dc,
                        since_hello_s=round(now - joiner.hello_at, 3) if joiner.hello_at else None)

    def _release(self) -> None:
        """The final arrivals, once every active site has sent its own (module docstring)."""
        if not self.finals or self.barrier:
            return
        active = [d for d, s in self.sites.items() if s.state == "active"]
        if any(s.state == "expected" for s in self.sites.values()) or \
                any(d not in self.finals for d in active):
            return
        self.barrier = [(d, self.sites[d].inc, self.finals.pop(d)) for d in sorted(active)]
        for d, s in self.sites.items():
            if s.state == "joining":               # nobody is left to hand it over
                s.state = "late"
                self._mail(d, {"type": "over"})

    def _on_done(self, site: Site, msg: dict, now: float) -> None:
        if self.phase == "reduce" and (msg["round"], msg["attempt"]) == (self.round, self.attempt):
            self.dones[site.dc] = msg

    def _on_healed(self, site: Site, msg: dict, now: float) -> None:
        self._event("heal", dc=site.dc, inc=site.inc, **{k: msg[k] for k in msg if k in (
            "bytes", "seconds", "wait_s", "transfer_s", "step", "round", "since_hello_s")})

    def _on_bye(self, site: Site, msg: dict, now: float) -> None:
        if msg.get("reason") == "stopped" and self.halt_signum:     # stopped as it was told
            site.state = "stopped"
            self._event("bye", dc=site.dc, inc=site.inc, reason="stopped", round=self.round)
            return
        if msg.get("reason", "finished") != "finished":     # its run raised: out at once
            self._out(site, f"its job failed ({msg['reason']})", now, kill=False)
            return
        site.state = "finished"
        self._event("bye", dc=site.dc, inc=site.inc, reason=msg.get("reason", "finished"),
                    round=self.round)

    def heartbeat(self, dc: int, inc: int, now: float) -> None:
        site = self.sites[dc]
        if inc == site.inc:
            site.seen = now

    def down(self, dc: int, inc: int, cause: str, now: float) -> None:
        """The fleet: incarnation ``inc`` of ``dc``'s job ended (``cause``)."""
        site = self.sites[dc]
        if inc == site.inc and site.state in LIVE:
            self._out(site, cause, now, kill=False)

    def halt(self, signum: int) -> None:
        """The fleet: stop every member at the boundary of the next round (its decision says
        ``halt``); the joining sites are told the run is over."""
        self.halt_signum = signum
        if self.steps:                             # the first boundary every member can reach
            self.halt_at = max(step + period for step, period in self.steps.values())
        for d, s in self.sites.items():
            if s.state == "joining":
                s.state = "late"
                self._mail(d, {"type": "over"})
        self._event("halt", signum=signum, round=self.round)

    def retire(self, dc: int, why: str) -> None:
        """The fleet: ``dc`` is left out for the rest of the run."""
        self.sites[dc].state = "retired"
        self._event("left_out", dc=dc, why=why, round=self.round)

    def _out(self, site: Site, cause: str, now: float, kill: bool) -> None:
        was = site.state
        site.state = "gone"
        self._fence(site.dc, site.inc, cause)
        self.readies.pop(site.dc, None)
        self.late.pop(site.dc, None)
        self.catching_up.discard(site.dc)
        self.finals.pop(site.dc, None)
        self.donor_of.pop(site.dc, None)
        for j, donor in self.donor_of.items():       # its joiners: the next arrival hands over
            if donor == site.dc:
                self.donor_of[j] = None
        self._event("failure", dc=site.dc, inc=site.inc, cause=cause, was=was, round=self.round,
                    silent_s=round(now - site.seen, 3), kill=kill)

    # the clock --------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Count silent sites out, then decide, commit or retry what can be."""
        self._silent(now)
        if self.arrivals:
            self._release()
        else:
            if self.phase == "reduce":
                self._settle(now)
            if self.phase == "collect":
                self._collect(now)
        left = [d for d, s in self.sites.items() if s.state != "retired"]
        if len(left) < self.min_dcs:
            raise NoQuorum(f"only datacenter(s) {left} are left in the run (the others were left "
                           f"out after failing too often) and a round needs {self.min_dcs}")
        if not self.over and not any(s.state in ("expected", "active") for s in self.sites.values()):
            if not any(s.state in ("finished", "stopped") for s in self.sites.values()):
                raise NoQuorum("no datacenter is left to take part in rounds or to hand its "
                               "state on")
            self._end()

    def _silent(self, now: float) -> None:
        active = [s for s in self.sites.values() if s.state == "active"]
        for s in list(self.sites.values()):
            limit = self.start_s if s.state == "expected" else self.limit_s
            if s.state not in LIVE or now - s.seen <= limit:
                continue
            if s.state == "active" and len(active) - 1 < self.min_dcs:
                continue                # no quorum without it: wait (a partition must not split)
            self._out(s, f"no heartbeat for {now - s.seen:.3g} s (limit {limit:.3g} s)", now,
                      kill=True)
            active = [a for a in active if a is not s]

    def _collect(self, now: float) -> None:
        active = sorted(d for d, s in self.sites.items() if s.state == "active")
        if self.sites and any(s.state == "expected" for s in self.sites.values()):
            return                                     # founders still starting
        waiting = [d for d in active if d not in self.readies]
        if waiting and self._grace_over(now, active, waiting):
            self._leave_late(waiting, now)
            active = [d for d in active if d not in waiting]
        elif not active or waiting:
            heard = [d for d in active if now - self.sites[d].seen <= self.limit_s]
            self._quorum(now, len(heard))         # silent ones kept only for want of a quorum
            return
        admit = any(r.get("admit") for r in self.readies.values())
        joining = sorted(d for d, s in self.sites.items() if s.state == "joining")
        joiners = joining if admit else []
        if len(active) + len(joining) < self.min_dcs and not self.halt_signum:
            self._quorum(now, len(active))
            return
        # short of a quorum only for the joiners' sake: this round goes ahead with the active
        # members and says admit_next, so the joiners are admitted at its boundary (else the
        # active ones would wait for a quorum that only the admission round restores)
        self.short_since = None
        tags = {self.readies[d]["tag"] for d in active}
        if len(tags) > 1:
            raise NoQuorum(f"round {self.round}: the datacenters are at different "
                           f"synchronisations: " + ", ".join(f"{d}: {self.readies[d]['tag']}"
                                                             for d in active))
        self._decide(active, joiners, tags.pop(), admit, now)

    def grace_s(self) -> float | None:
        """The grace window: ``grace`` × the median interval between the last rounds'
        decisions (None before two were seen)."""
        if len(self.decided_at) < 2:
            return None
        gaps = sorted(b - a for a, b in zip(self.decided_at, self.decided_at[1:]))
        return self.grace * gaps[len(gaps) // 2]

    def _grace_over(self, now: float, active: list[int], waiting: list[int]) -> bool:
        """Whether this round goes ahead without ``waiting`` (module docstring: quorum)."""
        if not self.quorum or self.halt_signum or not all(
                re.fullmatch(r"t\d+\.f\d+", r.get("tag", "")) for r in self.readies.values()) or \
                any(d in self.late or d in self.catching_up for d in waiting) or \
                any(r.get("admit") for r in self.readies.values()) or \
                any(s.state == "joining" for s in self.sites.values()):
            return False
        ready = sorted(self.arrived[d] for d in active if d in self.readies)
        grace = self.grace_s()
        return len(ready) >= self.quorum and grace is not None and \
            now - ready[self.quorum - 1] >= grace

    def _leave_late(self, waiting: list[int], now: float) -> None:
        tags = {self.readies[d]["tag"] for d in self.readies}
        tag = tags.pop() if len(tags) == 1 else None
        members = sorted(self.readies)
        for d in waiting:
            self.late[d] = {"round": self.round, "tag": tag, "members": members, "at": now}
        self._event("grace_over", round=self.round, late=waiting, grace_s=self.grace_s(),
                    members=members)

    def _quorum(self, now: float, n: int) -> None:
        if n >= self.min_dcs:
            self.short_since = None
            return
        if self.short_since is None:
            self.short_since = now
            self._event("no_quorum", round=self.round, active=n, min_dcs=self.min_dcs)
        elif now - self.short_since > self.quorum_s:
            raise NoQuorum(f"only {n} of the {self.min_dcs} datacenters a round needs for "
                           f"{self.quorum_s:g} s")

    def _decide(self, active: list[int], joiners: list[int], tag: str, admit: bool,
                now: float) -> None:
        members = sorted(active + joiners)
        if members != self.group_members or self.group is None:
            self.group, self.group_members = f"{self.round}.{self.attempt}", members
        waiting = any(s.state == "joining" for s in self.sites.values())
        self.decision = {"type": "decision", "round": self.round, "attempt": self.attempt,
                         "tag": tag, "members": members, "contributors": active,
                         "joiners": joiners, "donor": active[0], "group": self.group,
                         "admit_next": waiting and not admit, "halt": self.halt_signum,
                         "catching_up": {str(d): int(self.readies[d].get("steps", 0))
                                         for d in sorted(self.catching_up) if d in self.readies},
                         "late": sorted(self.late)}
        if self.attempt == 0:
            self.decided_at = [*self.decided_at[-8:], now]
        for d in members:
            self._mail(d, self.decision)
        self._event("decision", **{k: v for k, v in self.decision.items() if k != "type"})
        self.phase, self.dones = "reduce", {}

    def _settle(self, now: float) -> None:
        members = self.decision["members"]
        gone = [d for d in members if self.sites[d].state not in ("active", "joining")]
        if any(d not in self.dones and d not in gone for d in members):
            return
        if not gone and all(self.dones[d]["ok"] for d in members):
            self._commit(now)
        else:
            self._retry(gone)

    def _commit(self, now: float) -> None:
        d = self.decision
        for m in d["members"]:
            self._mail(m, {"type": "outcome", "round": d["round"], "commit": True})
        for j in d["joiners"]:
            site = self.sites[j]
            site.state = "active"
            self._event("admitted", dc=j, inc=site.inc, round=d["round"], tag=d["tag"],
                        since_hello_s=round(now - site.hello_at, 3) if site.hello_at else None)
        self._event("commit", round=d["round"], attempt=d["attempt"], tag=d["tag"],
                    members=d["members"])
        self.round, self.attempt, self.phase = self.round + 1, 0, "collect"
        self.readies, self.dones, self.arrived = {}, {}, {}
        self.catching_up -= {int(c) for c in d["catching_up"]}

    def _retry(self, gone: list[int]) -> None:
        d = self.decision
        failed = {m: self.dones[m].get("error") for m in d["members"]
                  if m in self.dones and not self.dones[m]["ok"]}
        for m in d["members"]:
            if m not in gone:
                self._mail(m, {"type": "outcome", "round": d["round"], "commit": False})
        self._event("retry", round=d["round"], attempt=d["attempt"], gone=gone, failed=failed)
        if self.attempt + 1 >= MAX_ATTEMPTS:
            raise NoQuorum(f"round {d['round']} ({d['tag']}) failed {MAX_ATTEMPTS} times; last "
                           f"errors: {failed}")
        self.attempt += 1
        self.group = None                            # a failed group is never reused
        self.readies = {m: r for m, r in self.readies.items() if self.sites[m].state == "active"}
        self.phase = "collect"

    def _end(self) -> None:
        self.over = True
        for d, s in self.sites.items():
            if s.state == "joining":
                self._mail(d, {"type": "over"})
        self._event("over", round=self.round)

    def snapshot(self) -> dict:
        """Who is what now (for the fleet's summary)."""
        return {str(d): {"state": s.state, "inc": s.inc} for d, s in self.sites.items()}


__all__ = ["MAX_ATTEMPTS", "Membership", "NoQuorum", "Site"]
