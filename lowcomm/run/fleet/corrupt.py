"""A bad member as a fault to inject: a datacenter that sends a corrupted pseudo-gradient from a
round on (``lowcomm fault corrupt OUT --dc D --kind K``), to show what robust aggregation
(:mod:`~lowcomm.strategies.outer.aggregate`) keeps out.

The fault reaches a running fleet through its run folder: the command writes
``OUT/corrupt/dc<D>.json`` (``{"kind", "from_round"}``); the leader's channel of datacenter D
(every incarnation) reads it before each synchronisation round it sends and, from the
``from_round``-th round of a fragment on (counted from 1 by this incarnation), replaces what
it sends, x, by:

* ``nan``: x with every value NaN;
* ``scale=s``: s·x;
* ``signflip``: −x;
* ``noise=σ``: x + σ·ε, ε standard normal (a fixed seed per datacenter and round);
* ``stale=n``: what it sent n rounds of that fragment earlier (the oldest it kept while it has
  none so old: its history starts when the fault file appears);
* ``zero``: 0.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from ...comm.round_tag import RoundTag
from ...errors import LowcommError

log = logging.getLogger("lowcomm.fleet")

#: the kinds of corruption, and whether each takes a value (``kind=value``)
KINDS = {"nan": False, "scale": True, "signflip": False, "noise": True, "stale": True, "zero": False}


class CorruptError(LowcommError, ValueError):
    """A corruption cannot be applied; the message names the argument."""


def parse_kind(kind: str) -> tuple[str, float]:
    """``(name, value)`` of a ``--kind`` (module docstring); an unknown or ill-formed one raises
    :class:`CorruptError` naming ``--kind``."""
    name, eq, value = kind.partition("=")
    if name not in KINDS:
        raise CorruptError(f"--kind {kind!r}: unknown kind; known: nan, scale=S, signflip, "
                           "noise=SIGMA, stale=N, zero")
    if KINDS[name] != bool(eq):
        raise CorruptError(f"--kind {kind!r}: {name} " + (f"takes a value ({name}=...)" if KINDS[name]
                                                          else "takes no value"))
    if not eq:
        return name, 0.0
    try:
        v = float(value)
    except ValueError:
        raise CorruptError(f"--kind {kind!r}: {value!r} is not a number") from None
    if not math.isfinite(v) or (name == "stale" and (v < 1 or v != int(v))) or \
            (name == "noise" and v <= 0):
        raise CorruptError(f"--kind {kind!r}: " + ("stale takes a whole number of rounds >= 1"
                                                   if name == "stale" else
                                                   f"{name} takes a finite value" +
                                                   (" > 0" if name == "noise" else "")))
    return name, v


def fault_file(out: Path, dc: int) -> Path:
    return Path(out) / "corrupt" / f"dc{dc}.json"


def write_fault(out: Path, dc: int, kind: str, from_round: int) -> dict:
    """Write the fault for datacenter ``dc`` of the fleet in ``out`` (checked first)."""
    parse_kind(kind)
    if from_round < 1:
        raise CorruptError(f"--from-round {from_round}: rounds are counted from 1")
    entry = {"dc": dc, "kind": kind, "from_round": from_round}
    path = fault_file(out, dc)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(path)
    return entry


class Corruptor:
    """Datacenter ``dc``'s side of the fault (module docstring), reading ``OUT/corrupt``."""

    def __init__(self, out: Path | None, dc: int):
        self.path = fault_file(out, dc) if out is not None else None
        self.dc = dc
        self.sent: dict[int, list[torch.Tensor]] = {}    # per fragment, the rows sent, newest last
        self.rounds: dict[int, int] = {}                  # per fragment, the rounds sent
        self.applied = 0                                  # rounds corrupted

    def fault(self) -> tuple[str, float, int] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            f = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None                                   # being replaced: read next round
        return (*parse_kind(f["kind"]), int(f["from_round"]))

    def __call__(self, flat: torch.Tensor, tag: RoundTag) -> torch.Tensor:
        """What this member sends in round ``tag`` instead of ``flat``."""
        if self.path is None or tag.fragment is None or tag.step is None:
            return flat
        n = self.rounds[tag.fragment] = self.rounds.get(tag.fragment, 0) + 1
        f = self.fault()
        if f is None:                                 # no copy kept without a fault
            return flat
        sent = self.sent.setdefault(tag.fragment, [])
        sent.append(flat.clone())
        del sent[:-(int(f[1]) + 1 if f[0] == "stale" else 1)]
        if n < f[2]:
            return flat
        name, v, _ = f
        if not self.applied:
            log.warning("datacenter %d sends a corrupted pseudo-gradient (%s) from round %d of "
                        "fragment %d on (lowcomm fault corrupt)", self.dc,
                        name + (f"={v:g}" if KINDS[name] else ""), n, tag.fragment)
        self.applied += 1
        if name == "nan":
            return torch.full_like(flat, float("nan"))
        if name == "scale":
            return flat * v
        if name == "signflip":
            return -flat
        if name == "noise":
            g = torch.Generator().manual_seed(1000 * self.dc + n)
            return flat + v * torch.randn(flat.shape, generator=g, dtype=flat.dtype)
        if name == "stale":
            return sent[0].clone()
        return torch.zeros_like(flat)


__all__ = ["CorruptError", "Corruptor", "KINDS", "parse_kind", "write_fault"]
