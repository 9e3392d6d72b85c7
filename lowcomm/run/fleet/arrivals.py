"""The arrival policy of a fleet that runs asynchronous DiLoCo
(:mod:`~lowcomm.run.fleet.server`): there are no rounds, and nobody waits for anybody (the sites
themselves, their states, fencing, heartbeats and quorum, are
:mod:`~lowcomm.run.fleet.membership`'s).

* **Arrivals.** Each member's ``arrive`` is queued for the coordinator's arrival server
  (:attr:`Arrivals.queue`) and answered at once (:meth:`Arrivals.answer`) with the members'
  latest speeds and how long after the first member to reach the same step it came, less the
  lag it started with (a founder's hello after the first founder's; a joiner's first arrival).
* **The end.** A member's last arrival (``final``) is held until every active member has sent
  its own (or is out): then all are released together (:attr:`Arrivals.barrier`), applied, and
  every member takes the same θ (one model at the end); a site still joining is told ``over``.
* **Admission.** A joining site is given a donor, the next active member to arrive, which hands
  it its live state at that boundary (``donated``; the site is then ``admitted`` and active).
  A donor that is out before it handed over is replaced by the next arrival.
* **Stop.** Told to halt, the members stop at the first period boundary every one of them can
  still reach, S = the latest arrival's step + its period (each answer from then on says
  ``halt`` with S).
"""
from __future__ import annotations

from .membership import Membership, Msg, Site, State


class Arrivals:
    """The arrivals of asynchronous DiLoCo (module docstring)."""

    name = "arrivals"
    #: the members' messages it takes (another's are fenced)
    messages = frozenset({Msg.ARRIVE, Msg.DONATED})
    #: no rounds: the sites' events name round 0
    round = 0

    def __init__(self):
        self.sites: Membership | None = None
        self.queue: list[tuple[int, int, dict]] = []   # arrivals for the server, in order
        self.finals: dict[int, dict] = {}          # final arrivals held for the end
        self.barrier: list[tuple[int, int, dict]] = []  # the final ones, released together
        self.steps: dict[int, tuple[int, int]] = {}   # each site's latest arrival: step, period
        self.speeds: dict[int, float] = {}
        self.donor_of: dict[int, int | None] = {}  # joining site -> the member handing it over
        self.halt_at: int | None = None
        self.first_at: dict[int, float] = {}       # step -> when its first arrival came
        self.started: dict[int, float] = {}        # founder -> when it said hello
        self.skew: dict[int, float] = {}           # site -> its start's lag behind the first

    def attach(self, sites: Membership) -> None:
        self.sites = sites

    # the sites' hooks -----------------------------------------------------------------------
    def hello(self, site: Site, joining: bool, now: float) -> None:
        """A joiner waits for the next member to arrive (its donor); a founder's start is
        noted (how much later than the first it started)."""
        if joining:
            self.donor_of[site.dc] = None
            self.started.pop(site.dc, None)
        else:
            self.started[site.dc] = now
        self.skew.pop(site.dc, None)

    def out(self, dc: int) -> None:
        self.finals.pop(dc, None)
        self.donor_of.pop(dc, None)
        for j, donor in self.donor_of.items():     # its joiners: the next arrival hands over
            if donor == dc:
                self.donor_of[j] = None

    def halt(self) -> None:
        """Every member stops at the first boundary each can still reach."""
        if self.steps:
            self.halt_at = max(step + period for step, period in self.steps.values())

    # the members' messages ------------------------------------------------------------------
    def take(self, kind: Msg, site: Site, msg: dict, now: float) -> None:
        (self.arrive if kind is Msg.ARRIVE else self.donated)(site, msg, now)

    def arrive(self, site: Site, msg: dict, now: float) -> None:
        """An active member's arrival: queued for the server (a final one held)."""
        self.steps[site.dc] = (int(msg["step"]), int(msg["period"]))
        self.speeds[site.dc] = float(msg.get("speed") or 0.0)
        self.sites.event("arrival", dc=site.dc, inc=site.inc, n=msg["n"], step=msg["step"],
                         steps=msg.get("steps"), speed=msg.get("speed"),
                         final=bool(msg.get("final")))
        if self.sites.halt_signum and self.halt_at is None:
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
        started with (``behind_s``), the halt step, and the joining sites this member hands
        its state to."""
        donate = []
        if not msg.get("final"):
            for j, donor in sorted(self.donor_of.items()):
                if donor is None and self.sites[j].state is State.JOINING:
                    self.donor_of[j] = dc
                    donate.append(j)
        halt = self.sites.halt_signum
        return {"type": "arrived", "n": msg["n"], "arrivals": arrivals,
                "speeds": [self.speeds.get(d, 0.0) for d in sorted(self.sites.sites)],
                "behind_s": round(float(msg.get("behind_s", 0.0)), 6),
                "halt": [self.halt_at, halt] if halt else None, "donate": donate}

    def donated(self, site: Site, msg: dict, now: float) -> None:
        """``site`` handed its state to the joiners ``msg["to"]``: each is admitted."""
        for j in msg["to"]:
            joiner = self.sites[j]
            if self.donor_of.get(j) != site.dc or joiner.state is not State.JOINING:
                continue                           # it left meanwhile
            del self.donor_of[j]
            self.sites.handle(joiner, Msg.ADMIT, {}, now)
            self.sites.mail(j, {"type": "admitted", "key": msg["key"], "step": msg["step"],
                                "donor": site.dc, "bytes": msg.get("bytes", 0)})
            self.sites.event("admitted", dc=j, inc=joiner.inc, step=msg["step"], donor=site.dc,
                             since_hello_s=round(now - joiner.hello_at, 3) if joiner.hello_at
                             else None)

    # the clock ------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Release the final arrivals once every active site has sent its own."""
        if not self.finals or self.barrier:
            return
        active = self.sites.dcs(State.ACTIVE)
        if self.sites.dcs(State.EXPECTED) or any(d not in self.finals for d in active):
            return
        self.barrier = [(d, self.sites[d].inc, self.finals.pop(d)) for d in sorted(active)]
        self.sites.close_joining()                 # nobody is left to hand it over


__all__ = ["Arrivals"]
