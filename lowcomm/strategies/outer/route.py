"""Where an outer loop's averages go, and the path a fragment's reduction takes to get there.

The destination is one small interface, :class:`Destination` (``average(flat, f, t)``), with two
implementations: :class:`Collective`, an MPI communicator's all-reduce (the hierarchical one over
the topology's levels, or a compressor's exchange), and :class:`Rounds`, a fleet's channel or a
rank channel (rounds that survive a lost datacenter). :class:`Route` is the path along a
per-level policy's units: averaged inside the unit first where its ranks differ, across the
units by the destination (from the unit's leader, or from every rank where the outer state is
sharded), then handed on inside the unit.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Protocol

import torch

from ...comm.round_tag import RoundTag
from ...comm.collectives import allreduce_
from ...comm.comm import Comm
from ...comm.idle import IdleWait
from ...comm.ledger import Ledger
from ...compress.base import Pending
from ...compress.exchange import allgather_payload
from ...errors import ConfigError
from .aggregate import Aggregator, check_rule
from .fragment import Fragment, Shards
from ..layout import agreed_dup, check_agreed

#: the reduction thread's sleeps between tests of its pending MPI call (Comm.idle): from 2 ms,
#: doubling to 32 ms, and every 2 ms once the computation waits for the result. A thread that
#: spun through a WAN round trip took the core from the inner steps it overlaps (2 datacenters,
#: 25 ms: an all-gather's 73 ms cost its thread 72 ms of CPU spinning); a test every 2 ms woke it
#: 36 times per all-gather, now 6
REDUCTION_IDLE_WAIT_S = 0.002
REDUCTION_IDLE_WAIT_MAX_S = 0.032


class Destination(Protocol):
    """Where a fragment's average goes across the units."""

    def average(self, flat: torch.Tensor, f: Fragment, t: int) -> torch.Tensor:
        """The average over the units of ``flat``, fragment ``f``'s contribution sent at inner
        step ``t``."""


class Collective:
    """An MPI communicator: a dense all-reduce with ``algorithm`` (over the topology's
    ``levels`` where it is hierarchical), or the compressor's exchange."""

    def __init__(self, comm: Comm, algorithm: str, levels, compressor):
        self.comm, self.algorithm, self.levels, self.compressor = comm, algorithm, levels, compressor

    def average(self, flat: torch.Tensor, f: Fragment, t: int) -> torch.Tensor:
        if self.compressor is None:
            return allreduce_(flat, self.comm, self.algorithm, op="avg", levels=self.levels)
        return self.compressor.reduce(flat, f"fragment{f.index}", self.comm, f.sent_segments())


    def gather(self, flat: torch.Tensor, f: Fragment, t: int) -> tuple[torch.Tensor, list[int]]:
        """Every rank's ``flat`` (a row each, an all-gather) and the ranks; with a compressor,
        every rank's payload is gathered (its bytes on the wire) and each decoded."""
        ids = list(range(self.comm.size))
        comp = self.compressor
        if comp is None:
            return self.comm.allgather(flat), ids
        payload, ctx = comp.encoder.compress(flat, f"fragment{f.index}", f.sent_segments(),
                                             self.comm.rank)
        got = allgather_payload(self.comm, payload)
        return torch.stack([comp.codec.decompress([g[k] for g in got], ctx).to(flat.dtype)
                            for k in ids]), ids


class Rounds:
    """A fleet's channel or a rank channel: a round it may retry, tagged by step and fragment."""

    def __init__(self, channel, algorithm: str, levels):
        self.channel, self.algorithm, self.levels = channel, algorithm, levels

    def average(self, flat: torch.Tensor, f: Fragment, t: int) -> torch.Tensor:
        return self.channel.average(flat, RoundTag.sync(t, f.index), self.algorithm, self.levels)


    def gather(self, flat: torch.Tensor, f: Fragment, t: int) -> tuple[torch.Tensor, list[int]]:
        return self.channel.gather(flat, RoundTag.sync(t, f.index))


def destination(peers, algorithm: str, levels, compressor) -> Destination:
    """The destination over ``peers`` (a Comm, or a channel that reduces in rounds)."""
    return Rounds(peers, algorithm, levels) if peers.rounds else \
        Collective(peers, algorithm, levels, compressor)


def hand_on(inside: Comm | None, avg: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The average across units on every rank of the unit ``inside``: its leader (rank 0, which
    holds ``avg``) broadcasts it, in ``flat``'s dtype, into the others' ``flat`` (nothing to
    send in a unit of one rank, or with no unit)."""
    if inside is None:
        return avg
    out = avg.to(flat.dtype).contiguous() if inside.rank == 0 else flat
    if inside.size > 1:
        inside.bcast_(out, root=0)
    return out


class Posted:
    """A fragment's reduction posted from the training thread: the exchange across units runs
    as non-blocking MPI calls (``pending``; None on a rank that only receives the unit's
    average), which every step's :meth:`done` moves on; :meth:`result` completes them, hands
    the average on inside the unit and returns it with its ledger's rows, as the reduction
    thread's Future does."""

    def __init__(self, pending: Pending | None, flat: torch.Tensor, inside: Comm | None,
                 ledger: Ledger, idle: IdleWait):
        self.pending, self.flat, self.inside, self.ledger, self.idle = pending, flat, inside, ledger, idle
        self._out = None

    def done(self) -> bool:
        return self._out is not None or self.pending is None or self.pending.test()

    def result(self) -> tuple[torch.Tensor, list[dict]]:
        if self._out is None:
            with self.idle.hurry():
                avg = self.pending.wait() if self.pending is not None else self.flat
                with self.inside.charged_to(self.ledger) if self.inside is not None else nullcontext():
                    avg = hand_on(self.inside, avg, self.flat)
            self._out = (avg, self.ledger.rows())
        return self._out


def local_shards(nest, warmup_steps: int, name: str) -> dict[str, torch.Tensor] | None:
    """Where the level below shards every parameter (FSDP: ``inner.outer_shards()``; a
    pipeline: its stages' parameters; tp: its pieces), this rank's chunk of each (views, by
    name; a tensor several ranks of the unit hold, only where this rank owns it): the loop
    then keeps the outer state of its chunks only and averages them with rank i of every other
    unit (``peers``), nothing gathered inside the unit; else None."""
    inner = nest.inner if nest is not None else None
    if inner is None or inner.outer_shards() is None:
        return None
    key = f"policy.{name}"
    if nest.peers is None:
        raise ConfigError("policy", f"{name} over {inner.name} needs a level to average across")
    if warmup_steps:
        raise ConfigError(key, f"{name} over {inner.name} takes no dense warm-up (its "
                          "SyncDP would step the split model): use warmup_steps = 0")
    if any(b.is_meta for b in inner.model.buffers()):
        raise ConfigError(key, f"{name} over {inner.name} of a model with buffers "
                          "(BatchNorm's statistics) in its stages: averaging them across the "
                          "ranks is not built yet")
    return inner.outer_shards()


class Route:
    """The path of an outer loop's reductions, built on every rank together (collective): its
    own message space and ledger (``red``), the unit's ranks (``inside``), the ranks it
    averages across (``leaders``: the units' leaders, or rank i of every unit where the outer
    state is sharded), every rank of every unit (``whole``), the topology's levels for a
    hierarchical all-reduce (``levels``), and where the average goes (``across``), aggregated
    by a rule (``aggregator``: :meth:`aggregate_with`)."""

    aggregator: Aggregator | None = None

    def __init__(self, comm: Comm, nest, fragments: list[Fragment], levels, algorithm: str,
                 compressor, local: dict | None):
        self.nest, self.algorithm, self.compressor, self.local = nest, algorithm, compressor, local
        self.red = self._reductions(comm, nest, fragments)
        self.levels = levels.dup(self.red.ledger) if levels is not None and \
            algorithm in ("hierarchical", "auto") else None
        self.whole = nest.whole if nest is not None and nest.whole is not None else comm
        self.sharded = self._shardable(nest)
        self.inside = self.leaders = None
        if nest is not None:                         # same ledger: a sync's rows, all levels
            self.inside = nest.inside.dup(self.red.ledger) if nest.inside else None
            across = nest.peers if self.sharded or local is not None else nest.leaders
            self.leaders = across.dup(self.red.ledger) if across else None
            for c in (self.inside, self.leaders):
                if c is not None:
                    c.validate = False
        if self.sharded:                             # each fragment kept by range
            shards = Shards(self.inside, comm.ledger)
            for f in fragments:
                f.shards = shards
        self.fleet = nest is not None and nest.peers is not None and nest.peers.rounds or \
            self.whole.channel is not None
        self.average_inside = nest is not None and nest.average_inside
        mine = self.leaders if self.sharded or local is not None or self.inside is not None \
            else self.red
        self.across = destination(mine, algorithm, self.levels, compressor) if mine else None

    def _reductions(self, comm: Comm, nest, fragments: list[Fragment]) -> Comm:
        """A duplicate of ``comm`` with a ledger of its own, after checking once that the ranks
        hold the fragments' layout: every rank, or under a pipeline (whose stages differ inside
        a unit) rank i of every unit, which holds the same stage."""
        shapes = {n: tuple(p.shape) for f in fragments for n, p, _, _ in f.members}
        if self.local is not None:                   # FSDP below: the whole parameters' shapes
            shapes = {n: tuple(p.shape) for n, p in nest.inner.model.named_parameters()}
        sig = repr([(f.offset, str(f.dtype), [(n, shapes[n]) for n, _, _, _ in f.members])
                    for f in fragments])
        if nest is None or nest.inner is None or not nest.inner.splits_model:
            return agreed_dup(comm, "outer.layout", sig, len(fragments), Ledger())
        if not nest.peers.rounds:     # (a fleet's datacenters run one config: the same pieces)
            check_agreed(nest.peers, "outer.layout", sig, len(fragments))
        red = comm.dup(Ledger())
        red.validate = False
        return red

    @staticmethod
    def _shardable(nest) -> bool:
        """Whether the level below shards the model inside the unit (zero1, zero2): then each
        fragment is kept by range (:class:`~lowcomm.strategies.outer.fragment.Shards`)."""
        if nest is None or nest.inside is None or nest.inner is None or not nest.inner.sharded:
            return False
        if nest.peers is None or nest.peers.rounds and not nest.peers.per_rank:
            raise ConfigError("policy", f"an outer loop over {nest.inner.name}: the level above "
                              "reduces through one leader per unit, so the outer state cannot be "
                              "sharded across its ranks; use syncdp inside the units")
        return True

    def reduce(self, f: Fragment, flat: torch.Tensor, t: int) -> tuple[torch.Tensor, list[dict]]:
        """Average ``flat``, sent at inner step ``t``, over the ranks along the route; returns it
        with the rows of its traffic (on the reduction thread when the loop has a delay: the only
        writer of the reduction ledger, one reduction at a time)."""
        self.red.ledger.reset()
        inside = self.inside
        if inside is not None and self.average_inside:
            flat = allreduce_(flat, inside, self.algorithm, op="avg")
        avg = flat                                   # a rank that only receives the unit's average
        if self.sharded or self.local is not None:   # sharded: mine, with my peers
            inside = None
        if inside is None or inside.rank == 0:
            avg = self._across(flat, f, t)
        return hand_on(inside, avg, flat), self.red.ledger.rows()

    def aggregate_with(self, aggregator: Aggregator) -> None:
        """Aggregate the units' contributions by ``aggregator``'s rule
        (:mod:`~lowcomm.strategies.outer.aggregate`); a rule that gathers needs one dense
        contribution per unit, through its leader, in a known number of at least 3 for the median."""
        self.aggregator = aggregator
        if not aggregator.gathers:
            return
        key = "aggregate"
        if self.compressor is not None and not self.compressor.gathers_rows:
            raise ConfigError(key, f"{aggregator.rule!r} decodes every member's payload on its "
                              f"own; {self.compressor.name}'s ({self.compressor.collective}) "
                              "cannot be: use aggregate = \"mean\" with it")
        if self.sharded or self.local is not None or self.average_inside:
            raise ConfigError(key, f"{aggregator.rule!r} gathers one pseudo-gradient per unit "
                              "through its leader; here the units' ranks reduce their own "
                              "ranges (or differ): use syncdp inside, or aggregate = \"mean\"")
        if isinstance(self.across, Collective):
            check_rule(aggregator.rule, self.across.comm.size, aggregator.trim)

    def _across(self, flat: torch.Tensor, f: Fragment, t: int) -> torch.Tensor:
        """The units' aggregate of ``flat`` (NaN where no contribution may be applied)."""
        agg = self.aggregator
        if agg is None or not agg.gathers:
            return self.across.average(flat, f, t)
        rows, ids = self.across.gather(flat, f, t)
        out = agg(rows, ids)
        return torch.full_like(flat, float("nan")) if out is None else out

    def can_post(self, fragments: list[Fragment]) -> bool:
        """Whether every fragment's reduction is posted from the training thread instead of
        running on the reduction thread: where it is one message round that the steps' own MPI
        calls move on — a compressor's all-gather between two units (MPI moves a non-blocking
        collective's rounds on only inside calls, once a step here; a dense all-reduce, an
        exchange of more rounds or more units keeps the thread, which tests it between sleeps).
        Posted, nothing wakes during the steps: a thread testing its WAN all-gather (and taking
        the interpreter's lock to do so) slowed the steps it overlapped by up to a tenth
        (2 datacenters × 1 rank, a core each)."""
        if self.average_inside or self.compressor is None or self.sharded or self.local is not None:
            return False
        across = self.red if self.inside is None else self.leaders
        if across is None:                           # not a leader: only the unit's broadcast
            return True
        return not across.rounds and across.size == 2 and \
            all(self.compressor.posts(f.numel, f.dtype, across) for f in fragments)

    def post(self, f: Fragment, flat: torch.Tensor, idle: IdleWait) -> Posted:
        """:meth:`reduce` posted (see :meth:`can_post`), charged to a ledger of its own."""
        ledger, inside, pending = Ledger(), self.inside, None
        if inside is None or inside.rank == 0:
            across = self.red if inside is None else self.leaders
            with across.charged_to(ledger):
                pending = self.compressor.start(flat, f"fragment{f.index}", across, f.segments)
        return Posted(pending, flat, inside, ledger, idle)

    def finish(self, f: Fragment, ledger) -> None:
        """The fragment's parameters averaged over every rank, θ ← (1/K) Σ_k θ_k (one dense
        all-reduce, charged to ``ledger``), at the end of a run that stepped it since its last
        synchronisation; under FSDP over this rank's chunks' peers."""
        over = self.leaders if self.local is not None else self.whole
        if over.rounds:                              # a fleet's channel (FSDP below)
            f.unpack_(over.average(f.pack(), RoundTag.finish(f.index), "ring", self.levels))
            return
        with over.charged_to(ledger) if over is not self.whole else nullcontext():
            f.unpack_(allreduce_(f.pack(), over, "mpi", op="avg"))


class Thread:
    """The reduction thread of a loop with a delay (its waits sleep: the computation keeps the
    core) over the route's communicators, or nothing (``delay`` 0: reductions block)."""

    def __init__(self, delay: int, route: Route, name: str):
        if delay and route.fleet and (route.sharded or route.local is not None):
            raise ConfigError(f"policy.{name}", "delay > 0 over a datacenter sharded inside "
                              f"({route.nest.inner.name}): its ranks' rounds are handed on in "
                              "step; use delay = 0, or syncdp inside")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-outer") if delay else None
        self.idle = None
        if self.pool is not None:
            self.idle = IdleWait(REDUCTION_IDLE_WAIT_S, REDUCTION_IDLE_WAIT_MAX_S)
            for c in (route.red, route.inside, route.leaders):
                if c is not None:
                    c.idle = self.idle

    def wait(self, future) -> tuple[object, float]:
        """``future``'s result and the seconds waited for it (the thread then tests every 2 ms)."""
        if future.done() or self.idle is None:
            return future.result(), 0.0
        t0 = time.perf_counter()
        with self.idle.hurry():
            out = future.result()
        return out, time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


__all__ = ["Collective", "Destination", "Posted", "Rounds", "Route", "Thread", "destination",
           "hand_on", "local_shards"]
