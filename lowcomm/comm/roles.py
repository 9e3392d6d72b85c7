"""The roles several objects play for an outer loop, named as protocols (DESIGN.md, "One contract,
declared"): each implementation declares every attribute below, with its default, and the
methods read them directly.

* :class:`Peers` — the ranks an average goes across: an MPI :class:`~lowcomm.comm.comm.Comm` (or a
  :class:`~lowcomm.comm.gloo.GlooComm`), or a fleet's
  :class:`~lowcomm.run.fleet.channel.Channel` / :class:`~lowcomm.run.fleet.ranks.RankChannel`;
* :class:`Whole` — every rank of every unit, what an outer loop averages the last partial period
  and the buffers over: the loop's Comm, or a fleet's :class:`~lowcomm.run.fleet.ranks.Span`;
* :class:`LevelSet` — a topology's communicators as one rank sees them: the topology's
  :class:`~lowcomm.comm.topology.Levels` (one MPI job) or a fleet's
  :class:`~lowcomm.run.fleet.member.FleetLevels`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .ledger import Ledger
    from .topology import LinkModel, Topology


class Peers(Protocol):
    """The ranks an average goes across (module docstring)."""

    rank: int
    #: the α–β model of the links it crosses (None: unknown)
    link: LinkModel | None
    #: it reduces in rounds that may be retried (``average()``), not in a Comm's collectives
    rounds: bool
    #: each rank of a unit reduces its own part with its counterparts (not one leader per unit)
    per_rank: bool
    #: a fleet's number of datacenters, this member being datacenter ``dc`` (None: ranks)
    dcs: int | None

    def dup(self, ledger: Ledger | None = None) -> Peers:
        """The same peers, traffic charged to ``ledger``."""


class Whole(Protocol):
    """Every rank of every unit (module docstring)."""

    rank: int
    size: int
    #: it reduces in rounds that may be retried (``average()``), not in a Comm's collectives
    rounds: bool
    #: the fleet's channel it goes through, on a datacenter's leader (None: elsewhere)
    channel: Any
    #: a round may go ahead without a late member (a fleet's quorum)
    late_rounds: bool
    #: no rounds: asynchronous arrivals at the fleet coordinator's server
    arrivals: bool

    def allreduce_(self, t, op: str = "sum"):
        """Reduce ``t`` in place over every rank."""


class LevelSet(Protocol):
    """A topology's communicators as one rank sees them (module docstring). Its implementations
    subclass it for :attr:`names` and :attr:`size`, the whole topology's."""

    topology: Topology
    world: Any
    hierarchy: Any
    #: every rank of every unit where it is not ``world`` (a fleet's span); None: ``world``
    whole: Whole | None

    @property
    def names(self) -> tuple[str, ...]:
        """The topology's levels, outermost first."""
        return self.topology.names

    @property
    def size(self) -> int:
        """Ranks in all."""
        return self.topology.size

    def group(self, level: str):
        """Every rank in my unit of ``level``."""

    def peers(self, level: str) -> Peers:
        """My counterparts at ``level``: the ranks an average of that level goes across."""

    def rank_peers(self, level: str) -> Peers:
        """Rank i of every unit at ``level``: where a level below shards the outer state."""

    def dup(self, ledger: Ledger | None = None) -> LevelSet:
        """The same levels in a message space of their own, charged to ``ledger``."""


__all__ = ["LevelSet", "Peers", "Whole"]
