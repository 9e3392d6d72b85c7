"""The name of one round of a fleet, the same on every member: what the members say they are
ready for, what the coordinator decides and commits, what the fleet's report reads back.

Four kinds, each with its text (:meth:`RoundTag.__str__`, read back by :meth:`RoundTag.parse`):

==========  ===============  ==========================================================
kind        text             the round
==========  ===============  ==========================================================
``sync``    ``t40.f0``       fragment 0's outer synchronisation sent at inner step 40
``admit``   ``t40.admit``    the admission round at the boundary of inner step 40
``finish``  ``finish.f0``    fragment 0's average of the last, partial period
``span``    ``span3``        the third average over every rank of the fleet
==========  ===============  ==========================================================

Only a ``sync`` round may go ahead without a late member (a fleet's quorum); a round that names
a fragment (``sync``, ``finish``) carries a member's work, so a member left out of it lost
that work (the report's steps lost).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class TagKind(StrEnum):
    """What a round is for (module docstring)."""
    SYNC = "sync"
    ADMIT = "admit"
    FINISH = "finish"
    SPAN = "span"


#: each kind's text: the fields it names, as a pattern
_PATTERNS = {TagKind.SYNC: re.compile(r"t(?P<step>\d+)\.f(?P<fragment>\d+)"),
             TagKind.ADMIT: re.compile(r"t(?P<step>\d+)\.admit"),
             TagKind.FINISH: re.compile(r"finish\.f(?P<fragment>\d+)"),
             TagKind.SPAN: re.compile(r"span(?P<count>\d+)")}

#: the fields each kind names (the others are None)
_FIELDS = {TagKind.SYNC: ("step", "fragment"), TagKind.ADMIT: ("step",),
           TagKind.FINISH: ("fragment",), TagKind.SPAN: ("count",)}


@dataclass(frozen=True)
class RoundTag:
    """One round's name (module docstring): its ``kind``, the inner ``step`` it was sent at
    (``sync``, ``admit``), the ``fragment`` it averages (``sync``, ``finish``) and a span's
    ``count``. Build one with :meth:`sync`, :meth:`admit`, :meth:`finish` or :meth:`span`."""

    kind: TagKind
    step: int | None = None
    fragment: int | None = None
    count: int | None = None

    def __post_init__(self):
        if not isinstance(self.kind, TagKind):
            raise ValueError(f"RoundTag: kind must be one of {[k.value for k in TagKind]}, "
                             f"got {self.kind!r}")
        for name, value in (("step", self.step), ("fragment", self.fragment), ("count", self.count)):
            named = name in _FIELDS[self.kind]
            if named and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"RoundTag: a {self.kind} round's {name} must be an integer "
                                 f">= 0, got {value!r}")
            if not named and value is not None:
                raise ValueError(f"RoundTag: a {self.kind} round names no {name}, got {value!r}")

    @classmethod
    def sync(cls, step: int, fragment: int) -> RoundTag:
        """Fragment ``fragment``'s outer synchronisation sent at inner step ``step``."""
        return cls(TagKind.SYNC, step=step, fragment=fragment)

    @classmethod
    def admit(cls, step: int) -> RoundTag:
        """The admission round at the boundary of inner step ``step``."""
        return cls(TagKind.ADMIT, step=step)

    @classmethod
    def finish(cls, fragment: int) -> RoundTag:
        """Fragment ``fragment``'s average of the last, partial period."""
        return cls(TagKind.FINISH, fragment=fragment)

    @classmethod
    def span(cls, count: int) -> RoundTag:
        """The ``count``-th average over every rank of the fleet (counted from 1)."""
        return cls(TagKind.SPAN, count=count)

    @classmethod
    def parse(cls, text: str) -> RoundTag:
        """The tag ``text`` spells (``t40.f0``, ``t40.admit``, ``finish.f0``, ``span3``); a
        ValueError naming the text and the forms for anything else."""
        for kind, pattern in _PATTERNS.items():
            m = pattern.fullmatch(text) if isinstance(text, str) else None
            if m is not None:
                return cls(kind, **{k: int(v) for k, v in m.groupdict().items()})
        raise ValueError(f"not a round tag: {text!r} (expected t<step>.f<fragment>, "
                         f"t<step>.admit, finish.f<fragment> or span<count>)")

    def __str__(self) -> str:
        if self.kind is TagKind.SYNC:
            return f"t{self.step}.f{self.fragment}"
        if self.kind is TagKind.ADMIT:
            return f"t{self.step}.admit"
        if self.kind is TagKind.FINISH:
            return f"finish.f{self.fragment}"
        return f"span{self.count}"


__all__ = ["RoundTag", "TagKind"]
