"""The round policy of a synchronous fleet: which sites take part in each round, when it is
decided, committed or retried (the sites themselves, their states, fencing, heartbeats and
quorum, are :mod:`~lowcomm.run.fleet.membership`'s).

* **Rounds.** A round is decided when every active site is ready for it (the same tag on all:
  the same synchronisation of the same step, :class:`~lowcomm.comm.round_tag.RoundTag`) or
  found dead. Its members reduce; the round is committed only when every member reports its
  reduction complete; a member that failed or died makes the round go again without it
  (``attempt`` + 1, a new group); :data:`MAX_ATTEMPTS` failures end the coordinator.
* **Quorum with a grace window** (``quorum`` > 0): once ``quorum`` active sites are ready for
  a synchronisation (a ``sync`` tag), the round waits ``grace`` × the median interval between
  the last rounds' decisions (observed, so it follows the fleet's pace: never a fixed timeout)
  for the others, then goes ahead without them. A site left out so is *late*, not dead: its
  ready for that round is answered with ``late`` (it keeps its local progress and its
  pseudo-gradient), and the next round waits for it and names it in ``catching_up`` with the
  steps it carries, so its contribution is merged there, weighted by its steps, and the
  ``donor`` hands it the outer state that round made. A site late already, an admission round
  and the first round (no interval seen yet) wait for every site.
* **Admission.** A decision while a site is joining says ``admit_next``; at their next round
  boundary the members hold an admission round, whose members include the joining sites and
  whose ``donor`` (the lowest active member) sends them the live state; its commit admits them.
  Admission needs ``min_dcs`` sites counting the joiners; so does the round before it: a round
  that lacks a quorum only until the joiners are admitted goes ahead (2 datacenters, one
  relaunched: the other's round, then the admission round restores the quorum).
* **Stop.** Told to halt, every decision says ``halt``: each member stops at that round's
  boundary and writes its checkpoint (all at the same step) and says ``bye`` (stopped). That
  round goes ahead without a quorum (its members only checkpoint and stop; a resume starts from
  the newest step ``min_dcs`` of them hold).
"""
from __future__ import annotations

from enum import StrEnum

from ...comm.round_tag import RoundTag, TagKind
from .membership import Membership, Msg, NoQuorum, Site, State

#: attempts of one round before the coordinator gives up (a fault that every retry meets)
MAX_ATTEMPTS = 8


class Phase(StrEnum):
    """Where the current round is."""
    COLLECT = "collect"      # waiting for the sites' ready
    REDUCE = "reduce"        # decided: waiting for every member's done


class Rounds:
    """The rounds of a synchronous fleet (module docstring); ``quorum`` (0: every active site)
    and ``grace`` (× the median interval between decisions) for rounds that go ahead without
    a late site."""

    name = "rounds"
    #: the members' messages it takes (another's are fenced)
    messages = frozenset({Msg.READY, Msg.DONE})

    def __init__(self, quorum: int = 0, grace: float = 0.0):
        self.quorum, self.grace = quorum, grace
        self.sites: Membership | None = None
        self.round, self.attempt, self.phase = 0, 0, Phase.COLLECT
        self.readies: dict[int, dict] = {}         # this round's ready, by site
        self.decision: dict | None = None
        self.dones: dict[int, dict] = {}
        self.group, self.group_members = None, None
        self.decided_at: list[float] = []          # when the last rounds were decided
        self.arrived: dict[int, float] = {}        # when each site said ready for this round
        self.late: dict[int, dict] = {}            # site -> the round it was left out of
        self.catching_up: set[int] = set()         # sites whose steps go back to a round before

    def attach(self, sites: Membership) -> None:
        n, low = len(sites.sites), sites.min_dcs
        if self.quorum and not (low <= self.quorum <= n and self.grace > 0):
            raise ValueError(f"quorum must be in [min_dcs={low}, {n}] with grace > 0, got "
                             f"quorum={self.quorum}, grace={self.grace}")
        self.sites = sites

    # the sites' hooks -----------------------------------------------------------------------
    def hello(self, site: Site, joining: bool, now: float) -> None:
        """Nothing: a joiner waits for the next round boundary (``admit_next``)."""

    def out(self, dc: int) -> None:
        self.readies.pop(dc, None)
        self.late.pop(dc, None)
        self.catching_up.discard(dc)

    def halt(self) -> None:
        """Nothing: the next decision says ``halt``."""

    # the members' messages ------------------------------------------------------------------
    def take(self, kind: Msg, site: Site, msg: dict, now: float) -> None:
        (self.ready if kind is Msg.READY else self.done)(site, msg, now)

    def ready(self, site: Site, msg: dict, now: float) -> None:
        """An active site is ready for round ``msg["round"]`` with ``msg["tag"]``."""
        late = self.late.get(site.dc)
        if late is not None and msg["round"] == late["round"]:
            self._late(site, msg, late, now)
            return
        if msg["round"] != self.round:
            self.sites.fence(site.dc, site.inc, f"ready for round {msg['round']} while the "
                             f"fleet is at round {self.round}")
            return
        try:
            RoundTag.parse(msg.get("tag"))
        except ValueError as e:
            self.sites.fence(site.dc, site.inc, f"ready for round {msg['round']}: {e}")
            return
        self.readies[site.dc] = msg
        self.arrived.setdefault(site.dc, now)
        if msg.get("carried"):                     # late before (a restart forgot it): catches up
            self.catching_up.add(site.dc)

    def _late(self, site: Site, msg: dict, late: dict, now: float) -> None:
        """``site``'s ready for the round that went ahead without it: told so (it carries its
        steps on to the next round), or fenced if it is ready for another synchronisation."""
        if msg.get("tag") != late["tag"]:
            self.sites.fence(site.dc, site.inc, f"ready for round {msg['round']} with "
                             f"{msg.get('tag')} after it committed {late['tag']}")
            return
        del self.late[site.dc]                     # answered: it carries its steps on
        self.catching_up.add(site.dc)
        self.sites.mail(site.dc, {"type": "late", "round": late["round"], "tag": late["tag"],
                                  "members": late["members"]})
        self.sites.event("late", dc=site.dc, inc=site.inc, round=late["round"], tag=late["tag"],
                         late_s=round(now - late["at"], 3))

    def done(self, site: Site, msg: dict, now: float) -> None:
        """A member's reduction of this attempt completed (``ok``) or failed."""
        if self.phase is Phase.REDUCE and (msg["round"], msg["attempt"]) == (self.round,
                                                                          self.attempt):
            self.dones[site.dc] = msg

    # the clock ------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Commit or retry the decided round once every member is done or out; decide the next
        once every active site is ready (or the grace window is over)."""
        if self.phase is Phase.REDUCE:
            self._settle(now)
        if self.phase is Phase.COLLECT:
            self._collect(now)

    def _collect(self, now: float) -> None:
        sites = self.sites
        active = sites.dcs(State.ACTIVE)
        if sites.dcs(State.EXPECTED):
            return                                     # founders still starting
        waiting = [d for d in active if d not in self.readies]
        if waiting and self._grace_over(now, active, waiting):
            self._leave_late(waiting, now)
            active = [d for d in active if d not in waiting]
        elif not active or waiting:
            heard = [d for d in active if now - sites[d].seen <= sites.timeouts.limit_s]
            sites.check_quorum(now, len(heard))     # silent ones kept only for want of a quorum
            return
        admit = any(r.get("admit") for r in self.readies.values())
        joining = sites.dcs(State.JOINING)
        if len(active) + len(joining) < sites.min_dcs and not sites.halt_signum:
            sites.check_quorum(now, len(active))
            return
        # short of a quorum only for the joiners' sake: this round goes ahead with the active
        # members and says admit_next, so the joiners are admitted at its boundary (else the
        # active ones would wait for a quorum that only the admission round restores)
        sites.quorum_met()
        tags = {self.readies[d]["tag"] for d in active}
        if len(tags) > 1:
            raise NoQuorum(f"round {self.round}: the datacenters are at different "
                           f"synchronisations: " + ", ".join(f"{d}: {self.readies[d]['tag']}"
                                                             for d in active))
        self._decide(active, joining if admit else [], tags.pop(), admit, now)

    def grace_s(self) -> float | None:
        """The grace window: ``grace`` × the median interval between the last rounds'
        decisions (None before two were seen)."""
        if len(self.decided_at) < 2:
            return None
        gaps = sorted(b - a for a, b in zip(self.decided_at, self.decided_at[1:]))
        return self.grace * gaps[len(gaps) // 2]

    def _grace_over(self, now: float, active: list[int], waiting: list[int]) -> bool:
        """Whether this round goes ahead without ``waiting`` (module docstring: quorum)."""
        if not self.quorum or self.sites.halt_signum or not all(
                RoundTag.parse(r["tag"]).kind is TagKind.SYNC for r in self.readies.values()) \
                or any(d in self.late or d in self.catching_up for d in waiting) or \
                any(r.get("admit") for r in self.readies.values()) or \
                self.sites.dcs(State.JOINING):
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
        self.sites.event("grace_over", round=self.round, late=waiting, grace_s=self.grace_s(),
                         members=members)

    def _decide(self, active: list[int], joiners: list[int], tag: str, admit: bool,
                now: float) -> None:
        members = sorted(active + joiners)
        if members != self.group_members or self.group is None:
            self.group, self.group_members = f"{self.round}.{self.attempt}", members
        waiting = bool(self.sites.dcs(State.JOINING))
        self.decision = {"type": "decision", "round": self.round, "attempt": self.attempt,
                         "tag": tag, "members": members, "contributors": active,
                         "joiners": joiners, "donor": active[0], "group": self.group,
                         "admit_next": waiting and not admit, "halt": self.sites.halt_signum,
                         "catching_up": {str(d): int(self.readies[d].get("steps", 0))
                                         for d in sorted(self.catching_up) if d in self.readies},
                         "late": sorted(self.late)}
        if self.attempt == 0:
            self.decided_at = [*self.decided_at[-8:], now]
        for d in members:
            self.sites.mail(d, self.decision)
        self.sites.event("decision", **{k: v for k, v in self.decision.items() if k != "type"})
        self.phase, self.dones = Phase.REDUCE, {}

    def _settle(self, now: float) -> None:
        members = self.decision["members"]
        gone = [d for d in members if self.sites[d].state not in (State.ACTIVE, State.JOINING)]
        if any(d not in self.dones and d not in gone for d in members):
            return
        if not gone and all(self.dones[d]["ok"] for d in members):
            self._commit(now)
        else:
            self._retry(gone)

    def _commit(self, now: float) -> None:
        d, sites = self.decision, self.sites
        for m in d["members"]:
            sites.mail(m, {"type": "outcome", "round": d["round"], "commit": True})
        for j in d["joiners"]:
            site = sites[j]
            sites.handle(site, Msg.ADMIT, {}, now)
            sites.event("admitted", dc=j, inc=site.inc, round=d["round"], tag=d["tag"],
                        since_hello_s=round(now - site.hello_at, 3) if site.hello_at else None)
        sites.event("commit", round=d["round"], attempt=d["attempt"], tag=d["tag"],
                    members=d["members"])
        self.round, self.attempt, self.phase = self.round + 1, 0, Phase.COLLECT
        self.readies, self.dones, self.arrived = {}, {}, {}
        self.catching_up -= {int(c) for c in d["catching_up"]}

    def _retry(self, gone: list[int]) -> None:
        d = self.decision
        failed = {m: self.dones[m].get("error") for m in d["members"]
                  if m in self.dones and not self.dones[m]["ok"]}
        for m in d["members"]:
            if m not in gone:
                self.sites.mail(m, {"type": "outcome", "round": d["round"], "commit": False})
        self.sites.event("retry", round=d["round"], attempt=d["attempt"], gone=gone,
                         failed=failed)
        if self.attempt + 1 >= MAX_ATTEMPTS:
            raise NoQuorum(f"round {d['round']} ({d['tag']}) failed {MAX_ATTEMPTS} times; last "
                           f"errors: {failed}")
        self.attempt += 1
        self.group = None                            # a failed group is never reused
        self.readies = {m: r for m, r in self.readies.items()
                        if self.sites[m].state is State.ACTIVE}
        self.phase = Phase.COLLECT


__all__ = ["MAX_ATTEMPTS", "Phase", "Rounds"]
