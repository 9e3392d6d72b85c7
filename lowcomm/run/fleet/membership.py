"""The fleet coordinator's decisions, as a state machine: messages and the clock go in, mailbox
messages and log events come out (:mod:`lowcomm.run.fleet.coordinator` moves them through the
store; :mod:`lowcomm.run.fleet.channel` is the members' side).

Each datacenter is a *site* in one :class:`State`; what a message does to it is one row of
:data:`RULES` below (state × message → the next state, the reply, the act), which is what
:meth:`Membership.handle` dispatches on. The members' messages: ``hello`` (a founder's, or a
relaunched job's ``join``, of a new incarnation), ``ready``, ``done``, ``arrive``, ``donated``,
``healed``, ``bye`` (finished, ``stop`` as told, or ``fail``). The fleet's (the supervisor's
commands and the clock): ``down`` (its job ended), ``silent`` (no heartbeat nor message for
``limit_s``, ``start_s`` for a founder's first hello), ``retire`` (left out after failing too
often), ``admit`` (the policy took a joiner in), ``close`` (nobody is left to admit a joiner:
the fleet halts, or asynchronous DiLoCo's final arrivals were released) and ``end``.

* **Fencing.** A member's message that no row takes — one from an incarnation other than the
  site's, or one its state does not allow — is answered with ``fence`` (once per incarnation),
  and the fleet tears that job down and relaunches it. A fleet's message no row takes changes
  nothing.
* **Heartbeats.** Every message a row takes and every heartbeat of the site's incarnation
  refreshes when it was last seen; a silent active site is counted out only if the others keep
  a quorum of ``min_dcs`` — so a partition never splits the run: the side without a quorum
  waits, and ``quorum_s`` without one ends the coordinator (the fleet then restarts from
  checkpoints). Fewer than ``min_dcs`` sites not retired can never make a quorum again: the
  coordinator gives up at once.
* **Stop.** Told to halt (the fleet got SIGINT/SIGTERM), the policy stops every member at one
  boundary; a member that then says ``bye`` (stopped) is no failure.
* **End.** When no site is expected or active any more and one has finished or stopped,
  joining sites are told ``over``; when none has, nobody is left to hand the state on: the
  coordinator gives up (the fleet restarts from checkpoints).

What the sites take part in is the policy's (the ``policy`` act): the rounds of a synchronous
fleet (:class:`~lowcomm.run.fleet.rounds.Rounds`: ``ready``, ``done``) or the arrivals of
asynchronous DiLoCo (:class:`~lowcomm.run.fleet.arrivals.Arrivals`: ``arrive``, ``donated``);
a message of the other policy's is fenced.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from ...errors import LowcommError


class State(StrEnum):
    """What a datacenter is to the coordinator."""
    EXPECTED = "expected"    # a founder not heard of yet
    ACTIVE = "active"        # takes part in rounds (or arrivals)
    JOINING = "joining"      # a relaunched job waiting to be admitted
    GONE = "gone"            # failed: its incarnation is fenced
    FINISHED = "finished"    # ran to the end
    STOPPED = "stopped"      # stopped at the fleet's halt, as told
    RETIRED = "retired"      # left out of the run after failing too often
    OVER = "over"            # told the run is over before it was admitted


class Msg(StrEnum):
    """A message as the rules see it (module docstring): the member's, then the fleet's."""
    HELLO = "hello"
    JOIN = "join"
    READY = "ready"
    DONE = "done"
    ARRIVE = "arrive"
    DONATED = "donated"
    HEALED = "healed"
    BYE = "bye"
    STOP = "stop"
    FAIL = "fail"
    OTHER = "other"          # another incarnation's, a repeated hello, an unknown type
    DOWN = "down"
    SILENT = "silent"
    RETIRE = "retire"
    ADMIT = "admit"
    CLOSE = "close"
    END = "end"


#: the fleet's messages (the others are a member's): one no row takes changes nothing
FLEET = {Msg.DOWN, Msg.SILENT, Msg.RETIRE, Msg.ADMIT, Msg.CLOSE, Msg.END}

#: the states of a site that may still take part: watched for silence, heartbeats read
LIVE = (State.EXPECTED, State.ACTIVE, State.JOINING)
#: a job the fleet counts on runs: a new incarnation's hello counts the old one out first
RUNNING = (State.ACTIVE, State.JOINING)
#: no incarnation runs that the fleet counts on: a new one's hello is welcome
IDLE = (State.EXPECTED, State.GONE, State.FINISHED, State.STOPPED, State.OVER)


class Rule(NamedTuple):
    """One row of :data:`RULES`: in any of ``states``, on any of ``messages``, while ``when``
    holds (None: always; the first row that matches wins), ``act`` (a method of
    :class:`Membership`, ``_`` + its name) is carried out, the site goes to ``to`` (None: it
    stays), ``reply`` is sent to its incarnation (``fence``, with the act's reason, or
    ``over``) and, with ``again``, the message is taken once more in the new state."""
    states: tuple[State, ...]
    messages: tuple[Msg, ...]
    when: str | None
    to: State | None
    reply: str | None
    act: str | None
    again: bool = False


def _row(states, messages, when, to, reply, act, again=False) -> Rule:
    """A row as the table writes it: a state or message alone, or a tuple of them."""
    return Rule(states if isinstance(states, tuple) else (states,),
                messages if isinstance(messages, tuple) else (messages,), when, to, reply, act,
                again)


AGAIN = True
ALL = tuple(State)
#: the policy's messages from an active site (``done`` comes from a joiner too)
POLICY_ACTIVE = (Msg.READY, Msg.ARRIVE, Msg.DONATED)

#: The sites' rules: state × message → (next state, reply), and the act that carries it out.
#: Guards (``when``): ``ended`` (the run is over), ``closed`` (over, or halting: nobody will
#: admit a joiner), ``halting`` (the fleet was told to stop). The policy's acts send its own
#: replies (``decision``, ``outcome``, ``late``: rounds.py; ``arrived``, ``admitted``:
#: arrivals.py) and may fence a message it refuses.
RULES: tuple[Rule, ...] = tuple(_row(*row) for row in (
    # states        messages               when       -> state        reply    act
    (IDLE,          Msg.HELLO,             "ended",   State.OVER,     "over",  "adopt"),
    (IDLE,          Msg.HELLO,             None,      State.ACTIVE,   None,    "hello"),
    (IDLE,          Msg.JOIN,              "closed",  State.OVER,     "over",  "adopt"),
    (IDLE,          Msg.JOIN,              None,      State.JOINING,  None,    "hello"),
    (RUNNING,       (Msg.HELLO, Msg.JOIN), None,      State.GONE,     "fence", "relaunched", AGAIN),
    (State.ACTIVE,  POLICY_ACTIVE,         None,      None,           None,    "policy"),
    (RUNNING,       Msg.DONE,              None,      None,           None,    "policy"),
    (State.ACTIVE,  Msg.HEALED,            None,      None,           None,    "healed"),
    (RUNNING,       Msg.BYE,               None,      State.FINISHED, None,    "bye"),
    (RUNNING,       Msg.STOP,              "halting", State.STOPPED,  None,    "bye"),
    (RUNNING,       (Msg.STOP, Msg.FAIL),  None,      State.GONE,     "fence", "failed"),
    (LIVE,          Msg.DOWN,              None,      State.GONE,     "fence", "down"),
    (LIVE,          Msg.SILENT,            None,      State.GONE,     "fence", "silent"),
    (State.JOINING, Msg.ADMIT,             None,      State.ACTIVE,   None,    None),
    (State.JOINING, Msg.CLOSE,             None,      State.OVER,     "over",  None),
    (State.JOINING, Msg.END,               None,      None,           "over",  None),
    (ALL,           Msg.RETIRE,            None,      State.RETIRED,  None,    "retired"),
))

#: why a member's message that no row takes is fenced, by the site's state
REFUSED = {State.RETIRED: "left out of the run after failing too often"}


class NoQuorum(LowcommError):
    """The coordinator cannot decide: fewer than ``min_dcs`` datacenters for too long, or a
    round that fails every time. The fleet falls back to its checkpoints."""


@dataclass
class Site:
    """One datacenter as the coordinator sees it."""
    dc: int
    seen: float                       # the clock of its last heartbeat or message
    inc: int = 0                      # incarnation of its job (0: the first launch)
    state: State = State.EXPECTED
    hello_at: float | None = None     # when a joining incarnation said hello
    fenced: set = field(default_factory=set)


@dataclass(frozen=True)
class Timeouts:
    """The coordinator's patience: ``limit_s`` of silence before a site is out, ``start_s``
    for a founder's first hello, ``quorum_s`` without a quorum before giving up."""
    limit_s: float
    start_s: float = 300.0
    quorum_s: float = 600.0


class Policy(Protocol):
    """What the sites take part in: rounds (rounds.py) or arrivals (arrivals.py)."""

    #: what it is ("rounds", "arrivals"), as a refusal names it
    name: str
    #: the members' messages it takes; a site's other policy messages are fenced
    messages: frozenset[Msg]
    #: the round the fleet is at (named in the sites' events; 0 for arrivals)
    round: int

    def attach(self, sites: Membership) -> None:
        """Serve ``sites`` (checks the policy's settings against them)."""

    def hello(self, site: Site, joining: bool, now: float) -> None:
        """A new incarnation of ``site`` said hello."""

    def out(self, dc: int) -> None:
        """``dc`` is out: forget what it had under way."""

    def halt(self) -> None:
        """The fleet was told to stop."""

    def tick(self, now: float) -> None:
        """Decide, commit, retry or release what can be."""

    def take(self, kind: Msg, site: Site, msg: dict, now: float) -> None:
        """A member's message of a kind in :attr:`messages`."""


class Membership:
    """The coordinator's sites (module docstring): ``dcs`` founders, a quorum of ``min_dcs``,
    the clock's ``timeouts``, and the ``policy`` they take part in: a
    :class:`~lowcomm.run.fleet.rounds.Rounds` or an
    :class:`~lowcomm.run.fleet.arrivals.Arrivals`."""

    def __init__(self, dcs: int, min_dcs: int, now: float, timeouts: Timeouts, policy: Policy):
        if not 1 <= min_dcs <= dcs:
            raise ValueError(f"min_dcs must be in [1, {dcs}], got {min_dcs}")
        self.sites = {i: Site(i, now) for i in range(dcs)}
        self.min_dcs, self.timeouts, self.policy = min_dcs, timeouts, policy
        self.short_since: float | None = None      # since when without a quorum
        self.outbox: list[tuple[int, int, dict]] = []
        self.events: list[dict] = []
        self.over = False
        self.halt_signum = 0                       # the fleet was stopped: the policy halts it
        policy.attach(self)

    # output ---------------------------------------------------------------------------------
    def mail(self, dc: int, msg: dict, inc: int | None = None) -> None:
        """Put ``msg`` in the mailbox of ``dc``'s incarnation ``inc`` (None: its current one)."""
        self.outbox.append((dc, self.sites[dc].inc if inc is None else inc, msg))

    def event(self, kind: str, **fields) -> None:
        """Log an event (the fleet's ``membership.jsonl``)."""
        self.events.append({"event": kind, "t": time.time(), **fields})

    def fence(self, dc: int, inc: int, why: str) -> None:
        """Answer incarnation ``inc`` of ``dc`` with ``fence`` (once)."""
        site = self.sites[dc]
        if inc not in site.fenced:
            site.fenced.add(inc)
            self.mail(dc, {"type": "fence", "why": why}, inc)

    def __getitem__(self, dc: int) -> Site:
        return self.sites[dc]

    def dcs(self, *states: State) -> list[int]:
        """The datacenters in one of ``states``, in order."""
        return [d for d, s in self.sites.items() if s.state in states]

    # the rules ------------------------------------------------------------------------------
    def message(self, msg: dict, now: float) -> None:
        """A member's message, taken by the row of :data:`RULES` it matches."""
        site = self.sites[msg["dc"]]
        self.handle(site, classify(msg, site), msg, now)

    def handle(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        """Take ``kind`` (``msg``'s fields) at ``site`` by its rule (module docstring)."""
        rule = self.rule(site.state, kind)
        if rule is None:
            if kind not in FLEET:
                self.fence(site.dc, msg["inc"], self._refused(site, kind, msg))
            return
        if kind not in FLEET and msg["inc"] == site.inc:
            site.seen = now                        # (a new incarnation's: when it is adopted)
        why = ACTS[rule.act](self, site, kind, msg, now) if rule.act else None
        if rule.to is not None:
            site.state = rule.to
        if rule.reply == "fence":
            self.fence(site.dc, site.inc, why)
        elif rule.reply is not None:
            self.mail(site.dc, {"type": rule.reply})
        if rule.again:
            self.handle(site, kind, msg, now)

    def rule(self, state: State, kind: Msg) -> Rule | None:
        """The first row of :data:`RULES` for ``state`` and ``kind`` whose guard holds."""
        for r in RULES:
            if state in r.states and kind in r.messages and self._holds(r.when):
                return r
        return None

    def _holds(self, when: str | None) -> bool:
        guards = {None: True, "ended": self.over, "halting": bool(self.halt_signum),
                  "closed": self.over or bool(self.halt_signum)}
        return guards[when]

    def _refused(self, site: Site, kind: Msg, msg: dict) -> str:
        if site.state in REFUSED:
            return REFUSED[site.state]
        if msg["inc"] != site.inc or msg["type"] == "hello":
            return f"incarnation {msg['inc']} of datacenter {site.dc} is no longer a member"
        if kind is Msg.OTHER:
            return f"a message of unknown type {msg['type']!r}"
        return f"a {msg['type']} message from datacenter {site.dc} while it is {site.state}"

    # the acts (``why``: the reason a fence reply carries) ---------------------------------------
    def _adopt(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        site.inc, site.seen = msg["inc"], now

    def _hello(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        self._adopt(site, kind, msg, now)
        joining = kind is Msg.JOIN
        site.hello_at = now if joining else None
        self.policy.hello(site, joining, now)
        self.event("hello", dc=site.dc, inc=site.inc, joining=joining, round=self.policy.round)

    def _relaunched(self, site: Site, kind: Msg, msg: dict, now: float) -> str:
        return self._out(site, f"relaunched as incarnation {msg['inc']}", now, kill=False)

    def _failed(self, site: Site, kind: Msg, msg: dict, now: float) -> str:
        return self._out(site, f"its job failed ({msg['reason']})", now, kill=False)

    def _down(self, site: Site, kind: Msg, msg: dict, now: float) -> str:
        return self._out(site, msg["cause"], now, kill=False)

    def _silent(self, site: Site, kind: Msg, msg: dict, now: float) -> str:
        return self._out(site, msg["cause"], now, kill=True)

    def _out(self, site: Site, cause: str, now: float, kill: bool) -> str:
        self.policy.out(site.dc)
        self.event("failure", dc=site.dc, inc=site.inc, cause=cause, was=site.state,
                   round=self.policy.round, silent_s=round(now - site.seen, 3), kill=kill)
        return cause

    def _bye(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        reason = "stopped" if kind is Msg.STOP else msg.get("reason", "finished")
        self.event("bye", dc=site.dc, inc=site.inc, reason=reason, round=self.policy.round)

    def _retired(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        self.event("left_out", dc=site.dc, why=msg["why"], round=self.policy.round)

    def _healed(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        self.event("heal", dc=site.dc, inc=site.inc, **{k: msg[k] for k in msg if k in (
            "bytes", "seconds", "wait_s", "transfer_s", "step", "round", "since_hello_s")})

    def _policy(self, site: Site, kind: Msg, msg: dict, now: float) -> None:
        if kind not in self.policy.messages:
            self.fence(site.dc, site.inc, f"a {msg['type']} message from datacenter {site.dc} "
                       f"in a fleet of {self.policy.name}")
            return
        self.policy.take(kind, site, msg, now)

    # the fleet's commands -------------------------------------------------------------------
    def heartbeat(self, dc: int, inc: int, now: float) -> None:
        """Incarnation ``inc`` of ``dc`` heartbeat."""
        site = self.sites[dc]
        if inc == site.inc:
            site.seen = now

    def down(self, dc: int, inc: int, cause: str, now: float) -> None:
        """The fleet: incarnation ``inc`` of ``dc``'s job ended (``cause``)."""
        site = self.sites[dc]
        if inc == site.inc:
            self.handle(site, Msg.DOWN, {"cause": cause}, now)

    def halt(self, signum: int) -> None:
        """The fleet: stop every member at one boundary (the policy's); the joining sites are
        told the run is over."""
        self.halt_signum = signum
        self.policy.halt()
        self.close_joining()
        self.event("halt", signum=signum, round=self.policy.round)

    def close_joining(self) -> None:
        """Nobody is left to admit a joining site: each is told the run is over."""
        for s in list(self.sites.values()):
            self.handle(s, Msg.CLOSE, {}, 0.0)

    def retire(self, dc: int, why: str) -> None:
        """The fleet: ``dc`` is left out for the rest of the run."""
        self.handle(self.sites[dc], Msg.RETIRE, {"why": why}, 0.0)

    # the clock ------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Count silent sites out, let the policy decide what it can, then see that a quorum
        can still be made and whether the run is over."""
        self._watch(now)
        self.policy.tick(now)
        left = [d for d, s in self.sites.items() if s.state is not State.RETIRED]
        if len(left) < self.min_dcs:
            raise NoQuorum(f"only datacenter(s) {left} are left in the run (the others were left "
                           f"out after failing too often) and a round needs {self.min_dcs}")
        if not self.over and not self.dcs(State.EXPECTED, State.ACTIVE):
            if not self.dcs(State.FINISHED, State.STOPPED):
                raise NoQuorum("no datacenter is left to take part in rounds or to hand its "
                               "state on")
            self.over = True
            for s in self.sites.values():
                self.handle(s, Msg.END, {}, now)
            self.event("over", round=self.policy.round)

    def _watch(self, now: float) -> None:
        """Count out the sites silent past their limit (an active one only if the others keep
        a quorum: a partition must not split the run)."""
        active = len(self.dcs(State.ACTIVE))
        for s in list(self.sites.values()):
            limit = self.timeouts.start_s if s.state is State.EXPECTED else self.timeouts.limit_s
            if s.state not in LIVE or now - s.seen <= limit:
                continue
            if s.state is State.ACTIVE:
                if active - 1 < self.min_dcs:
                    continue
                active -= 1
            self.handle(s, Msg.SILENT, {"cause": f"no heartbeat for {now - s.seen:.3g} s "
                                                 f"(limit {limit:.3g} s)"}, now)

    def check_quorum(self, now: float, n: int) -> None:
        """``n`` sites could take part: note since when there is no quorum, and give up after
        ``quorum_s`` without one."""
        if n >= self.min_dcs:
            self.short_since = None
            return
        if self.short_since is None:
            self.short_since = now
            self.event("no_quorum", round=self.policy.round, active=n, min_dcs=self.min_dcs)
        elif now - self.short_since > self.timeouts.quorum_s:
            raise NoQuorum(f"only {n} of the {self.min_dcs} datacenters a round needs for "
                           f"{self.timeouts.quorum_s:g} s")

    def quorum_met(self) -> None:
        """A round goes ahead: whatever quorum was missing is no longer waited for."""
        self.short_since = None

    def snapshot(self) -> dict:
        """Who is what now (for the fleet's summary)."""
        return {str(d): {"state": str(s.state), "inc": s.inc} for d, s in self.sites.items()}


#: the acts the rules name (:attr:`Rule.act`), each a method of :class:`Membership`
ACTS = {"adopt": Membership._adopt, "hello": Membership._hello,
        "relaunched": Membership._relaunched, "failed": Membership._failed,
        "down": Membership._down, "silent": Membership._silent, "bye": Membership._bye,
        "retired": Membership._retired, "healed": Membership._healed,
        "policy": Membership._policy}
assert {r.act for r in RULES if r.act} <= set(ACTS), "a rule names an act Membership lacks"


def classify(msg: dict, site: Site) -> Msg:
    """What a member's ``msg`` is to ``site``'s rules: a hello of a new incarnation (``hello``
    or ``join``), one of the current incarnation's messages, or ``other``."""
    kind, inc = msg["type"], msg["inc"]
    if kind == "hello":
        new = inc > site.inc or site.state is State.EXPECTED
        return (Msg.JOIN if msg.get("joining") else Msg.HELLO) if new else Msg.OTHER
    if inc != site.inc:
        return Msg.OTHER
    if kind == "bye":
        reason = msg.get("reason", "finished")
        return Msg.BYE if reason == "finished" else Msg.STOP if reason == "stopped" else Msg.FAIL
    if kind in ("ready", "done", "arrive", "donated", "healed"):
        return Msg(kind)
    return Msg.OTHER


__all__ = ["FLEET", "IDLE", "LIVE", "Membership", "Msg", "NoQuorum", "Policy", "RULES",
           "RUNNING", "Rule", "Site", "State", "Timeouts", "classify"]
