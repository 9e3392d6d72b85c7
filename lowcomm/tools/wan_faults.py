"""Faults on the emulated WAN's links (:mod:`lowcomm.tools.wan`): outages and random packet loss.

A fault is data: its ``kind`` (``"down"``: every packet on the link is dropped — or, with
``hold``, held and delivered once the link is back —; ``"loss"``: each packet is dropped with
probability ``rate``), the ``link`` it covers (``"0-1"``: both directions between datacenters 0
and 1; ``"0>1"``: only 0 → 1; ``"all"``: every link), and when it is in force: ``start`` and
``end`` in wall-clock seconds (``time.time()``, so the CLI and the forwarder — two processes —
agree; ``end`` may be infinite: until cleared).

Loss is drawn per direction from its own generator, seeded by ``(seed, a, b)``: the n-th packet
on a direction meets the same draw in every run with the same seed (which packets those are
depends on TCP's timing, so a run is reproducible as far as the packet stream is).

The forwarder is a running process; its control channel is the file ``faults.json`` in the
WAN's state directory, which writers replace atomically (under a lock) and the forwarder polls
(:class:`FaultTable`). Spec strings (``lowcomm wan up --fault``)::

    down:0-1:at=20s:for=10s        # link 0-1 down 20 s after the WAN is up, for 10 s
    down:all:for=5s:hold           # every link holds its packets for 5 s, from now
    loss:0>1:rate=1%:seed=7        # 1 % loss from dc 0 to dc 1 until cleared
    loss:all:rate=0.5%:at=10s:for=30s
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import random
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import LowcommError

KINDS = ("down", "loss")
_DURATION = re.compile(r"^(?P<v>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<u>ms|s|m|h)?$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class FaultError(LowcommError, ValueError):
    """A fault argument cannot be used; the message names the argument and the accepted form."""


def parse_duration(text: str, what: str) -> float:
    """``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a bare number of seconds -> seconds (>= 0)."""
    m = _DURATION.match(str(text).strip())
    if not m:
        raise FaultError(f"{what} {text!r}: use a duration such as 10s, 500ms or 2m")
    return float(m["v"]) * _UNITS[m["u"]]


def parse_rate(text: str, what: str) -> float:
    """``"1%"`` or a fraction ``"0.01"`` -> a probability in (0, 1)."""
    s = str(text).strip()
    try:
        p = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise FaultError(f"{what} {text!r}: use a percentage such as 1% or a fraction such as 0.01") from None
    if not s.endswith("%") and p >= 1:
        raise FaultError(f"{what} {text!r}: a bare number is a fraction of packets; write "
                         f"{s}% for {s} percent")
    if not 0 < p < 1 or math.isnan(p):
        raise FaultError(f"{what} {text!r}: the loss rate must lie strictly between 0 and 100 % "
                         "(a link losing every packet is --down)")
    return p


def parse_link(text: str, dcs: int, what: str = "link") -> str:
    """``"all"``, ``"A-B"`` (both directions) or ``"A>B"`` (one), A != B in 0..dcs-1."""
    s = str(text).strip()
    if s == "all":
        return s
    m = re.match(r"^([0-9]+)([->])([0-9]+)$", s)
    if not m:
        raise FaultError(f"{what} {text!r}: use all, A-B (both directions) or A>B (one direction)")
    a, b = int(m[1]), int(m[3])
    if a == b or not (0 <= a < dcs and 0 <= b < dcs):
        raise FaultError(f"{what} {text!r}: needs two different datacenters of 0..{dcs - 1}")
    return s


@dataclass(frozen=True)
class Fault:
    """One fault (module docstring). ``start``/``end``: wall-clock seconds, or, before
    :meth:`at`, seconds from an origin not yet fixed."""
    kind: str
    link: str
    start: float
    end: float
    rate: float = 0.0
    seed: int = 0
    hold: bool = False
    id: int = 0

    def at(self, origin: float) -> "Fault":
        """This fault with its times counted from ``origin`` (wall-clock seconds)."""
        return replace(self, start=origin + self.start, end=origin + self.end)

    def directions(self, dcs: int) -> list[tuple[int, int]]:
        if self.link == "all":
            return [(a, b) for a in range(dcs) for b in range(dcs) if a != b]
        a, sep, b = re.split(r"([->])", self.link)
        a, b = int(a), int(b)
        return [(a, b)] if sep == ">" else [(a, b), (b, a)]

    def active(self, now: float) -> bool:
        return self.start <= now < self.end

    def describe(self, now: float) -> str:
        what = (f"down ({'held' if self.hold else 'dropped'})" if self.kind == "down"
                else f"loss {self.rate * 100:g} % (seed {self.seed})")
        if now < self.start:
            when = f"starts in {self.start - now:.1f} s"
        elif now < self.end:
            when = "active" + ("" if math.isinf(self.end) else f", {self.end - now:.1f} s left")
        else:
            when = "over"
        length = "until cleared" if math.isinf(self.end) else f"for {self.end - self.start:g} s"
        return f"#{self.id} link {self.link}: {what} {length}; {when}"


def make(kind: str, link: str, *, at: float = 0.0, duration: float = math.inf,
         rate: float = 0.0, seed: int = 0, hold: bool = False) -> Fault:
    """A checked fault on ``link`` (as :func:`parse_link` returned it: checked against the
    WAN's datacenters) with times relative to an origin (``Fault.at`` fixes it)."""
    if kind not in KINDS:
        raise FaultError(f"fault kind {kind!r}: use one of {', '.join(KINDS)}")
    if at < 0 or math.isnan(at):
        raise FaultError(f"at={at:g}: a fault cannot start before now")
    if not duration > 0:
        raise FaultError(f"for={duration:g}: a fault lasts more than 0 s")
    if kind == "down":
        if math.isinf(duration):
            raise FaultError("a down fault needs its length (for=10s / --down 10s)")
        if rate or seed:
            raise FaultError("rate and seed belong to a loss fault, not to down")
    else:
        if hold:
            raise FaultError("hold belongs to a down fault, not to loss")
        if not 0 < rate < 1:
            raise FaultError(f"a loss fault needs rate in (0, 100 %), got {rate!r}")
        if not isinstance(seed, int) or seed < 0:
            raise FaultError(f"seed {seed!r}: use a whole number >= 0")
    return Fault(kind, link, at, at + duration, rate, seed, hold)


def parse_spec(text: str, dcs: int) -> Fault:
    """``KIND:LINK[:at=DUR][:for=DUR][:rate=R][:seed=N][:hold]`` (module docstring), relative."""
    parts = str(text).strip().split(":")
    if len(parts) < 2:
        raise FaultError(f"--fault {text!r}: use KIND:LINK[:key=value...], e.g. down:0-1:at=20s:for=10s "
                         "or loss:all:rate=1%:seed=7")
    kind, link, kw, seen = parts[0], parts[1], {}, set()
    for item in parts[2:]:
        key, eq, value = item.partition("=")
        if key == "hold" and not eq:
            kw["hold"] = True
            continue
        if not eq or key not in ("at", "for", "rate", "seed"):
            raise FaultError(f"--fault {text!r}: unknown item {item!r}; keys: at=DUR, for=DUR, "
                             "rate=R (loss), seed=N (loss), hold (down)")
        if key in seen:
            raise FaultError(f"--fault {text!r}: {key} given twice")
        seen.add(key)
        if key == "at":
            kw["at"] = parse_duration(value, f"--fault {text!r}: at")
        elif key == "for":
            kw["duration"] = parse_duration(value, f"--fault {text!r}: for")
        elif key == "rate":
            kw["rate"] = parse_rate(value, f"--fault {text!r}: rate")
        else:
            if not value.isdigit():
                raise FaultError(f"--fault {text!r}: seed {value!r} must be a whole number >= 0")
            kw["seed"] = int(value)
    try:
        return make(kind, parse_link(link, dcs), **kw)
    except FaultError as e:
        raise FaultError(f"--fault {text!r}: {e}") from None


# ---------------------------------------------------------------------------------------------
# the control file
# ---------------------------------------------------------------------------------------------
def path(state_dir: Path) -> Path:
    return Path(state_dir) / "faults.json"


def load(state_dir: Path) -> list[Fault]:
    """The faults written so far (none if there is no file)."""
    f = path(state_dir)
    if not f.is_file():
        return []
    rows = json.loads(f.read_text())["faults"]
    return [Fault(**{**x, "end": math.inf if x["end"] >= 1e300 else x["end"]}) for x in rows]


def add(state_dir: Path, faults: list[Fault], clear: bool = False) -> list[Fault]:
    """Append ``faults`` (absolute times) to the control file, numbering them; ``clear`` first
    ends every fault written before (its end becomes now). Atomic for the forwarder (it reads
    either the old file or the new one) and locked against another writer."""
    state_dir = Path(state_dir)
    with open(state_dir / "faults.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = load(state_dir)
        now = time.time()
        if clear:
            old = [replace(x, end=min(x.end, now), start=min(x.start, now)) for x in old]
        nxt = max((x.id for x in old), default=0) + 1
        new = [replace(x, id=nxt + i) for i, x in enumerate(faults)]
        tmp = path(state_dir).with_suffix(".tmp")
        tmp.write_text(json.dumps({"faults": [_row(x) for x in old + new]}, indent=1))
        os.replace(tmp, path(state_dir))
    return new


def _row(f: Fault) -> dict:
    d = asdict(f)
    if math.isinf(d["end"]):
        d["end"] = 1e300          # JSON has no infinity
    return d


# ---------------------------------------------------------------------------------------------
# the forwarder's side
# ---------------------------------------------------------------------------------------------
class FaultTable:
    """What the forwarder does with a packet on direction a -> b: re-reads the control file
    when it changed (:meth:`poll`), then :meth:`verdict` per packet. Counts, per fault, the
    packets it dropped or held (:attr:`counts`, written to the forwarder's stats)."""

    def __init__(self, state_dir: Path, dcs: int, log=None):
        self.state_dir, self.dcs, self._log = Path(state_dir), dcs, log
        self.faults: list[Fault] = []
        self.counts: dict[int, int] = {}
        self._mtime = None
        self._dirs: list[tuple[Fault, set]] = []
        self._rng: dict[tuple[int, int, int], random.Random] = {}

    def poll(self) -> None:
        try:
            m = path(self.state_dir).stat().st_mtime_ns
        except FileNotFoundError:
            m = None
        if m == self._mtime:
            return
        self._mtime = m
        try:
            faults = load(self.state_dir)
        except (OSError, ValueError, TypeError, KeyError) as e:   # keep the faults in force
            if self._log:
                self._log(f"cannot read {path(self.state_dir)}: {e}; keeping the faults in force")
            return
        self.faults = faults
        self._dirs = [(x, set(x.directions(self.dcs))) for x in faults]
        for x in faults:
            self.counts.setdefault(x.id, 0)

    def verdict(self, a: int, b: int, now: float) -> tuple[str, float]:
        """``("pass", 0)``, ``("drop", 0)`` or ``("hold", until)`` for a packet a -> b at
        wall-clock ``now``."""
        hold_until = 0.0
        for x, dirs in self._dirs:
            if (a, b) not in dirs or not x.active(now):
                continue
            if x.kind == "down":
                self.counts[x.id] += 1
                if not x.hold:
                    return "drop", 0.0
                hold_until = max(hold_until, x.end)
            else:
                rng = self._rng.get((x.id, a, b))
                if rng is None:
                    rng = self._rng[(x.id, a, b)] = random.Random(f"{x.seed}:{a}>{b}")
                if rng.random() < x.rate:
                    self.counts[x.id] += 1
                    return "drop", 0.0
        return ("hold", hold_until) if hold_until else ("pass", 0.0)
