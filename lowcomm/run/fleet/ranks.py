"""Every rank's side of a fleet's rounds, where one leader per datacenter is not enough:
:class:`RankChannel` (rank i of every datacenter, for an outer loop whose state is sharded over
each datacenter's ranks) and :class:`Span` (every rank of the fleet as one communicator). The
rounds themselves are the leader's :class:`~lowcomm.run.fleet.channel.Channel`'s."""
from __future__ import annotations

import torch

from ...comm.ledger import Ledger
from ...comm.round_tag import RoundTag
from ...errors import CommError
from .channel import Channel, _Groups
from .store import Seat


class RankChannel:
    """Rank i of every member datacenter, for an outer loop whose state is sharded over each
    datacenter's ranks (``zero1``/``zero2`` inside; :class:`~lowcomm.strategies.outer.loop.OuterLoop`):
    every rank reduces its own range with its counterparts, so the cross-datacenter traffic is
    spread over all ranks instead of one leader.

    The round is the leader's (:class:`Channel`: the same ready, decision, done and commit with
    the coordinator, who sees one member per datacenter); the leader hands each decision to the
    datacenter's ranks (``inside``, MPI), each rank all-reduces over its own group of the
    decision's members (prefix ``rank{i}/``), the leader reports the round done only where every
    rank's reduction completed, and hands the outcome on: a round redone without a lost member is
    redone on every rank, and no rank applies a partial sum. Every datacenter has the same number
    of ranks (the fleet splits them evenly). ``store``: this rank's client of the coordinator's
    store (the leader's channel's own on the leader)."""

    rounds = True        # (a :class:`~lowcomm.comm.roles.Peers`)
    per_rank = True
    dcs = None           # (its datacenter is ``dc``; the leader's Channel counts them)

    def __init__(self, inside, channel: Channel | None, store, seat: Seat,
                 ledger: Ledger | None = None, shared: dict | None = None):
        self.inside, self.channel, self.store, self.seat = inside, channel, store, seat
        self.dc, self.limits, self.link, self.rank = seat.dc, seat.limits, seat.link, seat.rank
        self.ledger = ledger if ledger is not None else Ledger()
        self.plane = _Groups(store, seat, f"rank{inside.rank}/")
        # what every rank reads from the decisions it is handed, shared with its duplicates
        self.shared = shared if shared is not None else {"admit_due": False}

    @property
    def admit_due(self) -> bool:
        """Whether a datacenter waits to be admitted at this round boundary (every rank of
        every member knows it from the last committed decision)."""
        return self.shared["admit_due"]

    def admitted(self) -> None:
        self.shared["admit_due"] = False

    def dup(self, ledger: Ledger | None = None) -> "RankChannel":
        """Over a duplicate of ``inside`` (collective over the datacenter's ranks; the rounds'
        hand-offs there are not the method's traffic), its data plane charged to ``ledger``."""
        return RankChannel(self.inside.dup(Ledger()), self.channel, self.store, self.seat,
                           ledger, self.shared)

    def average(self, flat: torch.Tensor, tag: RoundTag, algorithm: str = "ring",
                levels=None) -> torch.Tensor:
        """The average of this rank's ``flat`` over rank i of the members of round ``tag``
        (class docstring): a fresh tensor, equal on those ranks."""
        out = []                                     # this rank's result of the last attempt

        def attempt(d: dict):
            """Every rank's part of an attempt of decision ``d``."""
            x, err = self.plane.reduce(d, flat, algorithm, levels, self.ledger)
            out[:] = [x]
            errors = [f"rank {i} of datacenter {self.dc}: {e}"
                      for i, e in enumerate(self.inside.allgather_object(err)) if e]
            return None, errors[0] if errors else None
        if self.channel is not None:                 # the leader: the round with the coordinator
            d, _ = self.channel.round_of("fleet.average",
                                         lambda d: attempt(self.inside.bcast_object(d)),
                                         ready={"tag": tag, "numel": flat.numel()})
            self.inside.bcast_object(("committed", d))
        else:                                        # the others: each attempt, until committed
            while True:
                msg = self.inside.bcast_object(None)
                if isinstance(msg, tuple) and msg[0] == "committed":
                    d = msg[1]
                    break
                attempt(msg)
        self.shared["admit_due"] = self.admit_due or bool(d.get("admit_next"))
        return out[0]


class Span:
    """Every rank of the fleet as one communicator, for what an outer loop averages over all
    ranks at once (the last partial period, floating buffers): the average inside the
    datacenter (MPI), then across through ``channel`` (on the datacenter's leader), handed on
    inside. ``size`` counts the ranks of the whole fleet. A :class:`~lowcomm.comm.roles.Whole`."""

    rounds = False       # averages with allreduce_, the channel's rounds inside it

    def __init__(self, inside, channel: Channel | None, size: int, rank: int,
                 late_rounds: bool = False, arrivals: bool = False):
        self.inside, self.channel, self.size, self.rank = inside, channel, size, rank
        self.ledger, self.level, self.validate = inside.ledger, "dc", False
        self.late_rounds = late_rounds      # a round may go ahead without a late datacenter
        self.arrivals = arrivals            # no rounds: arrivals at the coordinator's server
        self._count = 0

    def allreduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op != "avg":
            raise CommError("fleet.span", self.rank, f"across a fleet only averages, not {op!r}")
        self._count += 1
        flat = t.detach().reshape(-1).to("cpu", torch.float64 if t.dtype == torch.float64
                                         else torch.float32).contiguous()
        if self.inside.size > 1:
            self.inside.allreduce_(flat, "avg")
        if self.channel is not None:
            flat = self.channel.average(flat, RoundTag.span(self._count), "ring")
        if self.inside.size > 1:
            self.inside.bcast_(flat, root=0)
        t.copy_(flat.view(t.shape).to(t.dtype))
        return t

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Inside the datacenter only (integer buffers: every datacenter counts the same)."""
        return self.inside.bcast_(t, root) if self.inside.size > 1 else t


__all__ = ["RankChannel", "Span"]
