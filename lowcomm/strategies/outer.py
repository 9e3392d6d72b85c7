"""The skeleton Local SGD, DiLoCo and streaming DiLoCo share: local steps, then (every ``period``
steps, per fragment, possibly in the background) an average over the ranks that is applied to the
parameters. Subclasses say only what is sent (:meth:`OuterLoop._outgoing`) and how the average
is applied (:meth:`OuterLoop._apply`).
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import torch

from ..comm.collectives import allgather_, allreduce_, broadcast_, chunk_bounds, get_algorithm
from ..comm.comm import Comm
from ..comm.idle import IdleWait
from ..comm.roles import Peers, Whole
from ..comm.round_tag import RoundTag
from ..compress.base import Pending, Segment
from ..compress.compressor import Compressor
from ..errors import ArgumentError, CommError, ConfigError
from ..comm.ledger import Ledger
from .base import (Context, Strategy, agreed_dup, balance, check_agreed, check_compressor_name,
                   parts_of_one_method)
from .buffers import Buffers, batchnorms, recompute_statistics
from .syncdp import SyncDPSettings

log = logging.getLogger("lowcomm.strategies.outer")
#: the reduction thread's sleeps between tests of its pending MPI call (Comm.idle): from 2 ms,
#: doubling to 32 ms, and every 2 ms once the computation waits for the result. A thread that
#: spun through a WAN round trip took the core from the inner steps it overlaps (2 datacenters,
#: 25 ms: an all-gather's 73 ms cost its thread 72 ms of CPU spinning); a test every 2 ms woke it
#: 36 times per all-gather, now 6
REDUCTION_IDLE_WAIT_S = 0.002
REDUCTION_IDLE_WAIT_MAX_S = 0.032


@dataclass
class Fragment:
    """A set of parameter tensors synchronised together, packed into one flat CPU tensor.

    ``members`` are ``(name, parameter, start, stop)`` in model order; ``offset`` is the step
    (modulo the period) at which the fragment is synchronised."""
    index: int
    members: list[tuple[str, torch.nn.Parameter, int, int]]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        return self.members[-1][3]

    @cached_property
    def segments(self) -> list[Segment]:
        """The members' places in the fragment (built once: the members never change)."""
        return [Segment(n, p.shape, a, b) for n, p, a, b in self.members]

    @torch.no_grad()
    def pack(self) -> torch.Tensor:
        """A fresh flat CPU copy of the fragment's parameters (in ``dtype``)."""
        return torch.cat([p.detach().reshape(-1).to("cpu", self.dtype) for _, p, _, _ in self.members])

    @torch.no_grad()
    def pack_range(self, lo: int, hi: int) -> torch.Tensor:
        """A fresh flat CPU copy of elements ``[lo, hi)`` of :meth:`pack`'s vector (only the
        members that overlap it are read)."""
        parts = [p.detach().reshape(-1)[max(a, lo) - a:min(b, hi) - a].to("cpu", self.dtype)
                 for _, p, a, b in self.members if max(a, lo) < min(b, hi)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    @torch.no_grad()
    def add_(self, flat: torch.Tensor) -> None:
        """Parameters ← parameters + ``flat``."""
        for _, p, a, b in self.members:
            p.add_(flat[a:b].view(p.shape).to(p.device, p.dtype))

    @torch.no_grad()
    def unpack_(self, flat: torch.Tensor, alpha: float = 0.0) -> None:
        """Parameters ← ``flat`` (``alpha == 0``) or ``alpha·parameters + (1 − alpha)·flat``."""
        for _, p, a, b in self.members:
            src = flat[a:b].view(p.shape)
            if alpha == 0:
                p.copy_(src)
            else:
                p.mul_(alpha).add_(src.to(p.device, p.dtype), alpha=1.0 - alpha)


def partition(named: list[tuple[str, torch.nn.Parameter]], fragments: int, period: int,
              early: int = 0) -> list[Fragment]:
    """Split parameter tensors into ``fragments`` sets of near-equal size.

    Largest tensor first into the fragment holding the fewest elements so far (ties: the lower
    index), so each fragment's message is close to 1/P of the model; inside a fragment tensors
    keep model order. Fragment p is synchronised at local steps s with
    ``s % period == ((p + 1) * period // P − early) % period``: the P fragments are spread
    evenly over the period and the last one (all of them when P = 1) at its end, as in DiLoCo
    (``early``: sent that many steps before those slots, torchft's convention)."""
    if int(fragments) != fragments or fragments < 1:
        raise ArgumentError("fragments", f"must be an integer >= 1, got {fragments}")
    if fragments > len(named):
        raise ArgumentError("fragments", f"{fragments} fragments (strategy.fragments in a config) "
                            f"but the model has only {len(named)} trainable parameter tensors (a "
                            f"fragment holds whole tensors); use at most {len(named)}")
    owner = balance([p.numel() for _, p in named], fragments)
    out = []
    for f in range(fragments):
        members, n, dtype = [], 0, torch.float32
        for i, (name, p) in enumerate(named):
            if owner[i] == f:
                members.append((name, p, n, n + p.numel()))
                n += p.numel()
                dtype = torch.promote_types(dtype, p.dtype)
        out.append(Fragment(f, members, dtype, ((f + 1) * period // fragments - early) % period))
    return out


def average_parameters(named: list[tuple[str, torch.nn.Parameter]], comm: Comm) -> None:
    """Every parameter of ``named`` becomes its average over ``comm``,
    θ ← (1/K) Σ_k θ_k: one dense all-reduce (of the parameters packed in their promoted dtype)."""
    for f in partition(named, 1, 1):
        f.unpack_(allreduce_(f.pack(), comm, "mpi", op="avg"))


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


@dataclass
class Nesting:
    """Where an outer loop sits in a per-level policy (:mod:`lowcomm.strategies.policy`).

    The loop synchronises *units* (e.g. datacenters) whose ranks keep step with each other by
    ``inner``, the strategy one level down (e.g. SyncDP inside each datacenter), which takes
    the inner steps. A synchronisation averages inside the unit first when its ranks may differ
    (``average_inside``), then across units among ``leaders`` (the first rank of every unit,
    the only ranks that send across), then the unit's leader broadcasts the average inside.

    A fleet of datacenters (:mod:`lowcomm.run.fleet`) passes its channel as ``leaders`` (it
    reduces in rounds that survive the loss of a datacenter: ``rounds = True``) and, as
    ``whole``, the span of all its ranks that the last partial period and the buffers are
    averaged over."""
    inner: Strategy | None      # takes the inner steps (None: the plain optimizer)
    inside: Comm | None         # the ranks of my unit (None: a unit is one rank)
    leaders: Peers | None       # the first rank of each unit (on those ranks only)
    average_inside: bool = False
    whole: Whole | None = None  # every rank of every unit (None: the loop's comm)
    peers: Peers | None = None  # my counterpart in every unit (sharded outer state, below)


@dataclass
class _InFlight:
    fragment: int
    start: int             # local step at which it was sent
    apply_at: int          # local step after which the average is applied
    future: Future         # -> (averaged flat tensor, ledger rows of its traffic)
    base: torch.Tensor | None = None   # what the local progress is added onto (add-local, eager)


def _hand_on(inside: Comm | None, avg: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The average across units on every rank of the unit ``inside``: its leader (rank 0, which
    holds ``avg``) broadcasts it, in ``flat``'s dtype, into the others' ``flat`` (nothing to
    send in a unit of one rank, or with no unit)."""
    if inside is None:
        return avg
    out = avg.to(flat.dtype).contiguous() if inside.rank == 0 else flat
    if inside.size > 1:
        inside.bcast_(out, root=0)
    return out


class _Posted:
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
                    avg = _hand_on(self.inside, avg, self.flat)
            self._out = (avg, self.ledger.rows())
        return self._out


class OuterLoop(Strategy):
    """Local steps of the wrapped optimizer; every ``period`` steps each fragment's outgoing
    tensor is averaged over the ranks and applied. Not used directly: see
    :class:`~lowcomm.strategies.localsgd.LocalSGD`, :class:`~lowcomm.strategies.diloco.DiLoCo`
    and :class:`~lowcomm.strategies.diloco.StreamingDiLoCo`.

    Schedule, with W = ``warmup_steps``, H = ``period``, τ = ``delay``, after each inner step
    t (counted from 1; steps all ranks skip together are not counted, a step one rank skips
    under AMP is) and s = t − W:

      1. t ≤ W: the step was a dense :class:`~lowcomm.strategies.syncdp.SyncDP` step
         (post-local SGD's warm-up); after step W the SyncDP hooks are removed;
      2. every fragment in flight whose ``apply_at == s`` is waited for and applied;
      3. every fragment with ``s % H == offset`` is sent: its outgoing tensor is taken now and
         averaged (dense all-reduce with ``algorithm``, or ``compressor.reduce``). With τ = 0
         this happens at once and the result is applied before ``step()`` returns; with τ > 0 it
         runs on a background thread (on a duplicate communicator) while the next τ inner steps
         go on, and is applied after step s + τ;
      4. when s % H == 0, the floating-point buffers (BatchNorm's running statistics) are
         averaged over the ranks and integer ones taken from rank 0 (one small blocking
         all-reduce; nothing for a model without persistent buffers); with
         ``bn_recompute = N`` and ``bn_recompute_at = "sync"``, each rank first recomputes
         BatchNorm's statistics on N training batches under the synchronised weights
         (:func:`~lowcomm.strategies.buffers.recompute_statistics`), and those are averaged.

    At the end (:meth:`finish`), with ``bn_recompute = N`` the statistics are recomputed on N
    batches per rank under the delivered weights and averaged, instead of averaging the
    statistics the ranks ran with: averaged statistics need not fit the weights an outer step
    made (DiLoCo on a BatchNorm CNN: 0.875/0.923 test accuracy against SyncDP's 0.98 before).
    The batches: ``bn_batches``, an iterable (a list, a DataLoader: iterated afresh each time)
    or a function of the inner step t returning one (the loop passes the task's batches of
    this rank's last steps); ``bn_forward(model, batch)`` runs the model on one (default:
    ``model(batch[0])`` for a pair; the loop passes the task's loss).

    Every rank issues the same reductions in the same order, so no per-call agreement is needed.

    Sharded outer state: when the level below shards the model inside each unit (``inner.sharded``:
    zero1, zero2), rank i of a unit of k ranks keeps the outer state (DiLoCo's θ and momentum)
    of range i of each fragment only (k near-equal ranges: 1/k of it), sends only that range's
    outgoing tensor, averaged with rank i of every other unit (``peers``: the cross-unit traffic
    spread over every rank instead of one leader), and the unit all-gathers the k synchronised
    ranges before merging. Equal to the unsharded loop up to the order of the sums (for two units
    bit for bit).

    The reductions run on a duplicate communicator with a ledger of its own; a reduction's
    rows are charged to the strategy's ledger when its average is applied, so the byte counts
    logged at a step do not depend on the thread's timing (and a resumed run logs the same).
    :meth:`summary` reports the bytes of each synchronisation (all ranks together) as
    ``sync_bytes_peak`` / ``sync_bytes_mean``, as ``wait_s_by_rank`` the seconds each rank's
    steps waited for reductions in flight (the communication τ steps did not hide), and how the
    reductions ran (``reductions``: "posted", "thread" or "blocking").
    """

    name = "outer"
    unfreezes = True
    Settings = None            # OuterSettings, set below where it is defined

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings=None, compressor: Compressor | None = None,
                 warmup_options: dict | None = None, nest: Nesting | None = None, levels=None,
                 bn_batches=None, bn_forward=None, **options):
        super().__init__(model, optimizer, comm)
        s = settings if settings is not None else self.settings_from(options, algorithm="mpi")
        get_algorithm(s.algorithm, levels)
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ArgumentError("compressor", f"must be a lowcomm Compressor, got "
                                f"{type(compressor).__name__}")
        self.settings = s
        self.period, self.warmup_steps, self.algorithm = s.period, s.warmup_steps, s.algorithm
        self.delay, self.alpha = s.delay, float(s.alpha)
        self.merge, self.compressor = s.merge, compressor
        algorithm, fragments = s.algorithm, s.fragments
        named = self.members()           # frozen ones too: unfrozen later, they are averaged
        if not named:
            raise ValueError("the model has no trainable parameters")
        self._local = self._local_shards(nest, s)    # FSDP below: each rank's chunk of each
        if self._local is not None:         # (a pipeline below: its stages' parameters only)
            named = [(n, self._local[n]) for n, _ in named if n in self._local]
        early = self.delay if s.slot == "merge" else 0   # torchft's slots
        self.fragments = partition(named, fragments, self.period, early)
        self.buffers = Buffers(model)
        self._bn = self._statistics_source(model, s, bn_batches, bn_forward)
        self.t = 0                                   # inner steps taken
        self._dirty: set[int] = set()                # fragments stepped locally since their sync
        self.syncs: list[list[int]] = []             # [local step, fragment, bytes sent here]
        self._in_flight: list[_InFlight] = []
        self.wait_s = 0.0        # seconds the steps waited for reductions in flight (not hidden)
        self._dense = self._start_equal(model, optimizer, nest, levels, warmup_options)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}   # FSDP: the whole ones
        sig = repr([(f.offset, str(f.dtype), [(n, shapes[n]) for n, _, _, _ in f.members])
                    for f in self.fragments])
        self._red = self._reductions(nest, sig)      # own message space and ledger
        # hierarchical: the topology's communicators in the reductions' own space and ledger
        self._levels = levels.dup(self._red.ledger) if levels is not None and \
            algorithm in ("hierarchical", "auto") else None
        for below in (self._dense, nest.inner if nest is not None else None):
            if below is not None:                    # this method's guard names the right object
                below.release_guard()
        self.nest, self._inside, self._leaders = nest, None, None
        self._whole = nest.whole if nest is not None and nest.whole is not None else self.comm
        self._ranges = self._shard_ranges(nest)      # sharded: this rank's [lo, hi) per fragment
        if nest is not None:                         # same ledger: a sync's rows, all levels
            self._inside = nest.inside.dup(self._red.ledger) if nest.inside else None
            across = nest.peers if self._ranges is not None or self._local is not None else nest.leaders
            self._leaders = across.dup(self._red.ledger) if across else None
            for c in (self._inside, self._leaders):
                if c is not None:
                    c.validate = False
        self._fleet = self._across_a_fleet(nest)
        self._start_reductions()

    def _reductions(self, nest: Nesting | None, sig: str) -> Comm:
        """A duplicate of the method's communicator with a ledger of its own, after checking
        once that the ranks hold the fragments' layout ``sig``: every rank, or under a pipeline
        (whose stages differ inside a unit) rank i of every unit, which holds the same stage."""
        if nest is None or nest.inner is None or not nest.inner.splits_model:
            return agreed_dup(self.comm, "outer.layout", sig, len(self.fragments), Ledger())
        check_agreed(nest.peers, "outer.layout", sig, len(self.fragments))
        red = self.comm.dup(Ledger())
        red.validate = False
        return red

    def _across_a_fleet(self, nest: Nesting | None) -> bool:
        """Whether a fleet's channel is across (its rounds are one sequence per member, also
        on the leader's span of the whole fleet); refuses a delay it cannot overlap."""
        fleet = nest is not None and nest.peers is not None and nest.peers.rounds or \
            self._whole.channel is not None
        if self.delay and fleet and (self._ranges is not None or self._local is not None):
            raise ConfigError(f"policy.{self.name}", "delay > 0 over a datacenter sharded inside "
                              f"({nest.inner.name}): its ranks' rounds are handed on in step; use "
                              "delay = 0, or syncdp inside")
        return fleet

    def _start_reductions(self) -> None:
        """With τ > 0, the reduction thread (its waits sleep: the computation keeps the core),
        or the posted reductions where they apply (:meth:`_can_post`)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-outer") if self.delay else None
        self._idle = None
        if self._pool is not None:
            self._idle = IdleWait(REDUCTION_IDLE_WAIT_S, REDUCTION_IDLE_WAIT_MAX_S)
            for c in (self._red, self._inside, self._leaders):
                if c is not None:
                    c.idle = self._idle
        self._posting = self._pool is not None and self._can_post()

    @staticmethod
    def _statistics_source(model, s, batches, forward):
        """(batches, forward) for recomputing BatchNorm's statistics, or None
        (``bn_recompute = 0``); checked here, not at the run's end."""
        if s.bn_recompute == 0:
            return None
        if not batchnorms(model):
            raise ArgumentError("bn_recompute", f"{s.bn_recompute} batches to recompute BatchNorm's "
                                "running statistics on, but the model has no BatchNorm layer "
                                "that keeps them; use 0")
        if batches is None:
            raise ArgumentError("bn_batches", f"bn_recompute = {s.bn_recompute} needs training "
                                "batches: pass bn_batches (a list, a DataLoader or a function of "
                                "the step; lowcomm.train passes the task's)")
        if forward is not None and not callable(forward):
            raise ArgumentError("bn_forward", f"must be a function (model, batch), got "
                                f"{type(forward).__name__}")
        return batches, forward

    @torch.no_grad()
    def _settle_buffers(self) -> None:
        """The buffers every rank ends a period (or the run) with: BatchNorm's statistics
        recomputed on this rank's batches first where asked, then averaged over the ranks."""
        if self._bn is not None:
            batches, forward = self._bn
            recompute_statistics(self.model, batches(self.t) if callable(batches) else batches,
                                 self.settings.bn_recompute, forward)
        self.buffers.average(self._whole)

    # what subclasses define ---------------------------------------------------------------------
    def _outgoing(self, f: Fragment, local: torch.Tensor) -> torch.Tensor:
        """The flat CPU tensor this rank contributes for fragment ``f``, whose parameters here
        are ``local`` (``f.pack()``, fresh: it may be returned)."""
        raise NotImplementedError

    def _apply(self, f: Fragment, avg: torch.Tensor) -> torch.Tensor:
        """Take the rank average ``avg`` of the outgoing tensors of fragment ``f``; return the
        fragment's new synchronised value (flat), which :meth:`_land` merges into the model."""
        raise NotImplementedError

    def _warmup_done(self) -> None:
        """Called once after the last dense step (parameters are equal on all ranks)."""

    def _shard_ranges(self, nest: Nesting | None) -> list[tuple[int, int]] | None:
        """This rank's range of each fragment where the level below shards the model inside
        the unit (see the class docstring), else None."""
        if nest is None or nest.inside is None or nest.inner is None or not nest.inner.sharded:
            return None
        if nest.peers is None or nest.peers.rounds and not nest.peers.per_rank:
            raise ConfigError("policy", f"{self.name} over {nest.inner.name}: the level above "
                              "reduces through one leader per unit, so the outer state cannot be "
                              "sharded across its ranks; use syncdp inside the units")
        k, i = nest.inside.size, nest.inside.rank
        return [tuple(chunk_bounds(f.numel, k)[i:i + 2]) for f in self.fragments]

    def _start_equal(self, model, optimizer, nest: Nesting | None, levels, warmup_options):
        """Every rank starts from rank 0's model: the dense warm-up's SyncDP (returned; it
        broadcasts rank 0's state itself), or a broadcast (FSDP below: rank i of every unit
        takes unit 0's rank i's chunks)."""
        if self.warmup_steps > 0:
            from .syncdp import SyncDP
            with parts_of_one_method():
                return SyncDP(model, optimizer, self.comm, algorithm=self.algorithm, levels=levels,
                              **(warmup_options or {}))
        if self._local is not None:
            if not nest.peers.rounds:                   # a fleet's members start equal
                broadcast_(nest.peers, list(self._local.values()), root=0)
            broadcast_(nest.peers, [b for b in model.buffers() if not b.is_meta], root=0)
        else:
            broadcast_(self.comm, list(model.state_dict().values()), root=0)
        return None

    def _local_shards(self, nest: Nesting | None, s) -> dict[str, torch.Tensor] | None:
        """Where the level below shards every parameter (FSDP: ``inner.local_shards()``), this
        rank's chunk of each (views, by name): the loop then keeps the outer state of its chunks
        only and averages them with rank i of every other unit (``peers``), nothing gathered
        inside the unit; else None."""
        inner = nest.inner if nest is not None else None
        if inner is None or inner.local_shards() is None:
            return None
        key = f"policy.{self.name}"
        if nest.peers is None:
            raise ConfigError("policy", f"{self.name} over {inner.name} needs a level to average "
                              "across")
        if s.warmup_steps:
            raise ConfigError(key, f"{self.name} over {inner.name} takes no dense warm-up (its "
                              "SyncDP would step the split model): use warmup_steps = 0")
        if any(b.is_meta for b in inner.model.buffers()):
            raise ConfigError(key, f"{self.name} over {inner.name} of a model with buffers "
                              "(BatchNorm's statistics) in its stages: averaging them across the "
                              "ranks is not built yet")
        return inner.local_shards()

    def _pack(self, f: Fragment) -> torch.Tensor:
        """Fragment ``f``'s parameters as this rank synchronises them: all of them, or (sharded
        outer state) this rank's range."""
        return f.pack() if self._ranges is None else f.pack_range(*self._ranges[f.index])

    def _gather_range(self, f: Fragment, part: torch.Tensor) -> torch.Tensor:
        """Sharded: the unit's ranges of fragment ``f`` (this rank's ``part``) put together."""
        lo, hi = self._ranges[f.index]
        bounds = chunk_bounds(f.numel, self._inside.size)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        full = torch.empty(f.numel, dtype=part.dtype)
        full[lo:hi] = part
        with self._inside.charged_to(self.comm.ledger):
            return allgather_(full, self._inside, counts, "mpi")

    # the skeleton ------------------------------------------------------------------------------
    @property
    def _inner(self) -> Strategy | None:
        """The level below in a per-level policy (None outside one)."""
        return self.nest.inner if self.nest is not None else None

    @property
    def _driver(self) -> Strategy | None:
        """The strategy that takes the inner steps: the warm-up's SyncDP, the level below, or
        None (the plain optimizer)."""
        return self._dense if self._dense is not None else self._inner

    def _step(self, closure=None):
        driver = self._driver
        loss = driver.step(closure) if driver is not None else self.optimizer.step(closure)
        self._advance()
        return loss

    @property
    def lockstep(self) -> bool:
        """Only the warm-up's SyncDP (or a SyncDP level below) exchanges gradients every step."""
        driver = self._driver
        return driver is not None and driver.lockstep

    def _vote(self, mine: bool) -> bool:
        return self._driver._vote(mine)

    def local_nonfinite(self) -> str | None:
        driver = self._driver
        return driver.local_nonfinite() if driver is not None else None

    def _skip_step(self) -> None:
        """A step without this rank's update (non-finite gradients under AMP); the schedule
        goes on with the other ranks."""
        driver = self._driver
        if driver is not None:
            driver.skip()
        else:
            self.zero_grad()
        self._advance()

    def _advance(self) -> None:
        """After inner step t: the warm-up's end, the reductions that land and those that start,
        and, at the end of each period, the buffers' average."""
        self.t += 1
        s = self.t - self.warmup_steps
        if s == 0:
            self._end_warmup()
        elif s > 0:
            self._dirty = {f.index for f in self.fragments}
            for item in self._in_flight:             # posted ones move on in MPI calls only
                item.future.done()
            for item in [i for i in self._in_flight if i.apply_at == s]:
                self._in_flight.remove(item)
                self._land(item)
            for f in self.fragments:
                if s % self.period == f.offset:
                    self._start(f, s)
            if s % self.period == 0:
                if self._bn is not None and self.settings.bn_recompute_at == "sync":
                    self._in_turn(self._settle_buffers)
                else:
                    self._in_turn(self.buffers.average, self._whole)

    def _in_turn(self, fn, *args) -> None:
        """``fn(*args)`` now, after the reductions in flight where they share a fleet's
        channel (its rounds are one sequence per member: the reduction thread runs it next,
        and the steps wait for the round in flight, counted in :attr:`wait_s`); nothing for
        a model without buffers."""
        if not self.buffers and self._bn is None:
            return
        if self._pool is not None and self._fleet:
            t0 = time.perf_counter()
            with self._idle.hurry():
                self._pool.submit(fn, *args).result()
            self.wait_s += time.perf_counter() - t0
        else:
            fn(*args)

    def _end_warmup(self) -> None:
        if self._dense is not None:
            self._dense.close()
            self._dense = None
        self._warmup_done()

    def _start(self, f: Fragment, s: int) -> None:
        local = self._pack(f)
        out = self._outgoing(f, local)
        if self._pool is None:
            self._land(_InFlight(f.index, s, s, _done(self._reduce(f, out, self.t))))
        else:
            base = self._base(f, local, out)
            future = self._post(f, out) if self._posting else \
                self._pool.submit(self._reduce, f, out, self.t)
            self._in_flight.append(_InFlight(f.index, s, s + self.delay, future, base))

    def _base(self, f: Fragment, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """What :meth:`_land` adds the local progress of the τ steps onto (``merge =
        "add-local"``: the fragment when sent), or None (``mix``)."""
        if self.merge != "add-local":
            return None
        return local.clone() if out is local else local

    def _can_post(self) -> bool:
        """Whether every fragment's reduction is posted from the training thread instead of
        running on the reduction thread: where it is one message round that the steps' own MPI
        calls move on — a compressor's all-gather between two units (MPI moves a non-blocking
        collective's rounds on only inside calls, once a step here; a dense all-reduce, an
        exchange of more rounds or more units keeps the thread, which tests it between sleeps).
        Posted, nothing wakes during the steps: a thread testing its WAN all-gather (and taking
        the interpreter's lock to do so) slowed the steps it overlapped by up to a tenth
        (2 datacenters × 1 rank, a core each)."""
        nest, inside = self.nest, self._inside
        if nest is not None and nest.average_inside or self.compressor is None or \
                self._ranges is not None or self._local is not None:
            return False
        across = self._red if inside is None else self._leaders
        if across is None:                           # not a leader: only the unit's broadcast
            return True
        return not across.rounds and across.size == 2 and \
            all(self.compressor.posts(f.numel, f.dtype, across) for f in self.fragments)

    def _post(self, f: Fragment, flat: torch.Tensor) -> _Posted:
        """:meth:`_reduce` posted (see :meth:`_can_post`), charged to a ledger of its own."""
        ledger, inside, pending = Ledger(), self._inside, None
        if inside is None or inside.rank == 0:
            across = self._red if inside is None else self._leaders
            with across.charged_to(ledger):
                pending = self.compressor.start(flat, f"fragment{f.index}", across, f.segments)
        return _Posted(pending, flat, inside, ledger, self._idle)

    def _reduce(self, f: Fragment, flat: torch.Tensor, t: int) -> tuple[torch.Tensor, list[dict]]:
        """Average ``flat``, sent at inner step ``t``, over the ranks; runs on the reduction
        thread when delay > 0 (the only writer of the reduction ledger, one reduction at a
        time)."""
        self._red.ledger.reset()
        inside = self._inside
        if inside is not None and self.nest.average_inside:
            flat = allreduce_(flat, inside, self.algorithm, op="avg")
        avg = flat                                   # a rank that only receives the unit's average
        if self._ranges is not None or self._local is not None:   # sharded: mine, with my peers
            inside = None
        if inside is None or inside.rank == 0:
            across = self._leaders if self._ranges is not None or self._local is not None or \
                inside is not None else self._red
            if across.rounds:                        # a fleet's channel: rounds it may retry
                avg = across.average(flat, RoundTag.sync(t, f.index), self.algorithm, self._levels)
            elif self.compressor is None:
                avg = allreduce_(flat, across, self.algorithm, op="avg", levels=self._levels)
            else:
                avg = self.compressor.reduce(flat, f"fragment{f.index}", across, self._segments(f))
        return _hand_on(inside, avg, flat), self._red.ledger.rows()

    def _segments(self, f: Fragment) -> list[Segment]:
        """The parameters in what this rank sends of ``f`` (sharded: the pieces of its range)."""
        if self._ranges is None:
            return f.segments
        lo, hi = self._ranges[f.index]
        return [Segment(s.name, (min(s.stop, hi) - max(s.start, lo),), max(s.start, lo) - lo,
                        min(s.stop, hi) - lo) for s in f.segments if max(s.start, lo) < min(s.stop, hi)]

    def _charge(self, item: _InFlight, rows: list[dict]) -> None:
        for row in rows:
            self.comm.ledger.record(row["op"], row["level"], row["bytes_sent"], row["bytes_recv"],
                                    row["seconds"], calls=row["calls"])
        self.syncs.append([item.start, item.fragment, sum(row["bytes_sent"] for row in rows)])

    def _land(self, item: _InFlight) -> None:
        """Apply a finished reduction and merge the result into the model: ``mix`` sets the
        fragment to α·local + (1 − α)·synchronised; ``add-local`` and ``eager`` to synchronised +
        (local − ``item.base``), the local progress of the τ steps the reduction was in flight
        (``base``: the fragment when sent, or the eager outer step it restarted from)."""
        avg, rows = self._result(item)
        self._charge(item, rows)
        f = self.fragments[item.fragment]
        synced = self._apply(f, avg)
        if item.base is not None:             # local + (synced − base), parameter by parameter
            delta = synced - item.base
            f.add_(delta if self._ranges is None else self._gather_range(f, delta))
        else:
            f.unpack_(synced if self._ranges is None else self._gather_range(f, synced), self.alpha)
            if self.alpha == 0:                      # every rank now holds the same fragment
                self._dirty.discard(item.fragment)
        if self._inner is not None:
            self._inner.parameters_changed()

    def _result(self, item: _InFlight) -> tuple[torch.Tensor, list[dict]]:
        """The reduction's result, waited for (the reduction thread then tests every 2 ms);
        the wait is added to :attr:`wait_s`."""
        if item.future.done() or self._idle is None:
            return item.future.result()
        t0 = time.perf_counter()
        with self._idle.hurry():
            out = item.future.result()
        self.wait_s += time.perf_counter() - t0
        return out

    def _drain(self) -> None:
        """Wait for every reduction in flight (their results stay queued for their step)."""
        for item in self._in_flight:
            item.future = _done(self._result(item))

    def drain(self) -> None:
        """Wait for every reduction in flight; each is still applied at its step (a fleet's
        admission round waits so: a member's rounds are one sequence)."""
        self._drain()

    def landed(self, step: int) -> int:
        """The inner step τ = ``delay`` steps before this loop's own count."""
        return self.t - self.delay

    @property
    def shards_model(self) -> bool:
        """Whether the level below shards the parameters (FSDP) or splits the model (a pipeline)."""
        return self._local is not None

    @property
    def collective_forward(self) -> bool:
        """The level below's (FSDP gathers in its forward, a pipeline's stages pass activations)."""
        return self._inner is not None and self._inner.collective_forward

    def forward_backward(self, loss_fn, batch, before_backward=None):
        """The level below's forward and backward passes (a pipeline's schedule)."""
        if self._inner is None:
            return super().forward_backward(loss_fn, batch, before_backward)
        return self._inner.forward_backward(loss_fn, batch, before_backward)

    def evaluate(self, loss_fn, batch) -> float:
        return super().evaluate(loss_fn, batch) if self._inner is None else \
            self._inner.evaluate(loss_fn, batch)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False):
        """Clip by the level below's global norm (a pipeline's over every stage)."""
        if self._driver is None:
            return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return self._driver.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def clips_itself(self) -> bool:
        return self._driver is not None and self._driver.clips_itself()

    def batch_place(self) -> tuple[int, int]:
        """Where the level below places its ranks' batches inside each unit (a pipeline's
        stages share one), the units one after another; else the rank's own."""
        inner = self._inner
        if inner is None or self.nest.peers is None or self.nest.inside is None:
            return super().batch_place()
        i, n = inner.batch_place()
        if n == self.nest.inside.size:
            return super().batch_place()
        return self.nest.peers.rank * n + i, self.nest.peers.size * n

    def model_state_dict(self) -> dict:
        """The model as the level below keeps it (FSDP: this rank's shards)."""
        return self.nest.inner.model_state_dict() if self.shards_model else super().model_state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Load a :meth:`model_state_dict` (through the level below where it shards the model)."""
        if self.shards_model:
            self.nest.inner.load_model_state_dict(state)
        else:
            super().load_model_state_dict(state)
    # the optimizer interface ------------------------------------------------------------------
    def skip(self) -> None:
        driver = self._driver
        if driver is not None:
            driver.skip()
        else:
            self.zero_grad()

    def _state_dict(self) -> dict:
        """Inner optimizer, step counter, reductions in flight (completed first: their averages
        are saved and applied at their step after a resume), compressors, and what subclasses
        add (outer parameters and optimizer)."""
        self._drain()
        state = {"optimizer": self.optimizer.state_dict(), "t": self.t,
                 "syncs": [list(x) for x in self.syncs],
                 "in_flight": [(i.fragment, i.start, i.apply_at, i.future.result()[0].clone(),
                                i.future.result()[1], i.base) for i in self._in_flight]}
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        if self._dense is not None and self._dense.compressor is not None:
            state["warmup_compressor"] = self._dense.compressor.state_dict()
        if self._inner is not None:
            state["inner"] = self._inner.state_dict()
        return state

    def _load_state_dict(self, state: dict) -> None:
        if self._in_flight:
            raise RuntimeError("load_state_dict() while reductions are in flight")
        self.optimizer.load_state_dict(state["optimizer"])
        self.t = int(state["t"])
        self.syncs = [list(x) for x in state["syncs"]]
        self._in_flight = [_InFlight(f, s, at, _done((avg.clone(), list(rows))), *base)
                           for f, s, at, avg, rows, *base in state["in_flight"]]
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        if self._dense is not None:
            if self.t >= self.warmup_steps:      # resumed after the warm-up
                self._dense.close()
                self._dense = None
            elif self._dense.compressor is not None:
                self._dense.compressor.load_state_dict(state["warmup_compressor"])
        if self._inner is not None:
            self._inner.load_state_dict(state["inner"])

    def reshard(self, old: list[dict]) -> dict:
        """Per-rank state is averaged over the old ranks (:mod:`~lowcomm.strategies.reshard`):
        the models θ_k and buffers, the inner optimizer's state (momentum, Adam moments; step
        counts are rank 0's) and whatever subclasses add (:meth:`_reshard_extra`). The step
        counter, the synchronisation log and the reductions in flight are rank 0's: an
        in-flight fragment holds the rank average already (the all-reduce completed when the
        checkpoint was written), so it lands at its step on every new rank as it would have
        (with ``merge = "add-local"`` its base, the fragment when sent, is averaged like the model).
        Compressor state (the pseudo-gradient's error feedback, the warm-up's) is reset.
        Inside a per-level policy the topology fixes the rank count: not resizable."""
        from ..errors import LowcommError
        from .reshard import average, average_dicts, average_optimizer, reset_compressor
        if self._inner is not None:
            raise LowcommError(f"{self.name} is a level of a per-level policy, whose topology "
                               "fixes the number of ranks: resume it on the same number of ranks")
        ts = [s["strategy"]["t"] for s in old]
        if len(set(ts)) != 1:
            raise LowcommError(f"{self.name}: the old ranks' checkpoints are at different inner "
                               f"steps {ts}; cannot merge them")
        first = old[0]["strategy"]
        state = dict(first, optimizer=average_optimizer([s["strategy"]["optimizer"] for s in old]))
        if "compressor" in first:
            state["compressor"] = reset_compressor([s["strategy"]["compressor"] for s in old],
                                                   self.compressor.state_dict(), self.name)
        if "warmup_compressor" in first:
            fresh = self._dense.compressor.state_dict() if self._dense is not None and \
                self._dense.compressor is not None else {}
            state["warmup_compressor"] = reset_compressor(
                [s["strategy"]["warmup_compressor"] for s in old], fresh, self.name + " warm-up")
        state["in_flight"] = [(*item[:5], average([s["strategy"]["in_flight"][i][5] for s in old]))
                              if len(item) > 5 and item[5] is not None else item
                              for i, item in enumerate(first["in_flight"])]   # add-local's bases
        state.update(self._reshard_extra([s["strategy"] for s in old]))
        return {"model": average_dicts([s["model"] for s in old]), "strategy": state}

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The level below's, and the outer state (:meth:`_outer_state`) as optimizer state."""
        out = {k: list(v) for k, v in (self._inner.memory_tensors() if self._inner else {}).items()}
        out.setdefault("state", []).extend(self._outer_state())
        return out

    def _outer_state(self) -> list[torch.Tensor]:
        """The tensors of the outer step's state (none here; DiLoCo's θ and momentum)."""
        return []

    def _reshard_extra(self, old: list[dict]) -> dict:
        """Merged values of the state keys a subclass adds (none here)."""
        return {}

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return self._inner.metrics(ctl) if self._inner is not None else {}
        mine = torch.tensor([float(b) for _, _, b in self.syncs], dtype=torch.float64)
        every = ctl.allgather_object((len(mine), self.wait_s))
        counts = [n for n, _ in every]
        if len(set(counts)) != 1:
            raise CommError("outer.summary", ctl.rank, f"ranks made different numbers of "
                            f"synchronisations: {counts}")
        if ctl.size > 1 and len(mine):
            ctl.allreduce_(mine)
        out = {"period": self.period, "warmup_steps": self.warmup_steps,
               "fragments": len(self.fragments), "delay": self.delay, "syncs": len(mine),
               "sync_bytes_peak": int(mine.max()) if len(mine) else 0,
               "sync_bytes_mean": float(mine.mean()) if len(mine) else 0.0,
               "reductions": "posted" if self._posting else "thread" if self.delay else "blocking",
               "wait_s_by_rank": [round(w, 4) for _, w in every],
               "fragment_numel": [f.numel for f in self.fragments],
               "sharded": self._ranges is not None or self._local is not None}
        if self._inner is not None:
            out["inner"] = {"strategy": self._inner.name, **self._inner.metrics(ctl, final=True)}
        return out

    def _finish(self) -> None:
        """Deliver one model on every rank. When local steps followed a fragment's last
        synchronisation (a partial last period, streaming fragments still in flight at the
        end, α > 0), the ranks' parameters of those fragments are averaged,
        θ ← (1/K) Σ_k θ_k: one dense all-reduce, charged to the run. Otherwise (the run ended on
        a synchronisation) nothing is sent: the ranks are equal already. Floating-point buffers
        are averaged and integer ones taken from rank 0 (a model without persistent buffers sends
        nothing); with ``bn_recompute`` BatchNorm's statistics are first recomputed under the
        delivered weights."""
        over = self._leaders if self._local is not None else self._whole   # FSDP: my chunks' peers
        if self._fleet:                              # the channel's rounds are one sequence
            self._drain()
        for f in self.fragments:
            if f.index not in self._dirty:
                continue
            if over.rounds:                          # a fleet's channel (FSDP below)
                f.unpack_(over.average(f.pack(), RoundTag.finish(f.index), "ring", self._levels))
                continue
            with over.charged_to(self.comm.ledger) if over is not self._whole else nullcontext():
                f.unpack_(allreduce_(f.pack(), over, "mpi", op="avg"))
        self._dirty.clear()
        self._settle_buffers()
        if self._local is not None:                  # FSDP below: the plain, whole model
            self._inner._finish()
        elif self._inner is not None:
            self._inner.parameters_changed()

    def _close(self) -> None:
        """Finish reductions still in flight (their traffic is charged, their updates, due after
        the last step, are not applied), stop the thread, remove the warm-up hooks."""
        self._drain()
        for item in self._in_flight:
            self._charge(item, item.future.result()[1])
        self._in_flight = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._dense is not None:
            self._dense.close()
            self._dense = None
        if self._inner is not None:
            self._inner.close()


@dataclass
class OuterSettings(SyncDPSettings):
    """``[strategy]`` keys every outer loop takes: H, the dense warm-up W and its SyncDP keys
    (``algorithm`` is also the synchronisation's all-reduce). ``compressor`` here names the
    pseudo-gradient's compressor; the warm-up's gradients use the run's ``[compressor]``."""
    period: int = 1                # H: inner steps between synchronisations
    warmup_steps: int = 0          # W: dense SyncDP steps first (post-local SGD)
    compressor: str = "none"       # the pseudo-gradient's compressor (DiLoCo family)
    bn_recompute: int = 0          # training batches per rank to recompute BatchNorm's statistics on
    bn_recompute_at: str = "end"   # "end": after the last step; "sync": also after every outer step
    # what every outer loop reads, keys of the streaming ones only (not keys here)
    fragments, delay, alpha, merge, slot = 1, 0, 0.0, "mix", "send"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.at_least(prefix, "period", 1)
        self.at_least(prefix, "warmup_steps", 0)
        self.at_least(prefix, "bn_recompute", 0)
        self.one_of(prefix, "bn_recompute_at", BN_RECOMPUTE_AT)
        if self.bn_recompute_at != "end" and self.bn_recompute == 0:
            raise ConfigError.at(prefix, "bn_recompute_at", f"{self.bn_recompute_at!r} says when to "
                                 "recompute BatchNorm's statistics, but bn_recompute = 0 batches; "
                                 "set bn_recompute")
        check_compressor_name(self, prefix)
        if self.warmup_steps and "policy." in prefix:
            raise ConfigError.at(prefix, "warmup_steps", "a warm-up of dense steps is not supported "
                                 "inside a per-level policy (the level below already "
                                 "synchronises every step or on its own period); use 0")
        if self.backend != "mpi":
            raise ConfigError.at(prefix, "backend", "outer loops send lowcomm's own messages; use "
                              "backend = \"mpi\"")
        if self.algorithm == "hierarchical" and "policy." in prefix:
            raise ConfigError.at(prefix, "algorithm", "an outer loop reduces among unit leaders; "
                              "use mpi, ring, rabenseifner or tree")

    def kwargs(self, ctx: Context) -> dict:
        """The constructor's arguments: these settings (validated) and the run's objects."""
        warmup = SyncDPSettings(**{k: getattr(self, k) for k in SyncDPSettings.fields()
                                   if k != "compressor"}).kwargs(ctx)
        del warmup["algorithm"]                      # the outer loop's own
        return dict(settings=self, warmup_options=warmup, nest=ctx.nest, levels=ctx.levels,
                    bn_batches=ctx.batches, bn_forward=ctx.forward)


MERGES = ("mix", "add-local", "eager")
BN_RECOMPUTE_AT = ("end", "sync")


def check_merge(merge: str, alpha: float, prefix: str = "") -> None:
    """A streaming fragment's merge rule (:class:`~lowcomm.strategies.diloco.StreamingDiLoCo`)."""
    if merge not in MERGES:
        raise ConfigError.at(prefix, "merge", f"unknown value {merge!r}; known: {', '.join(MERGES)}")
    if merge != "mix" and alpha != 0:
        raise ConfigError.at(prefix, "alpha", f"merge = \"{merge}\" keeps all the local progress "
                          f"on top of the synchronised fragment; α mixes instead: use alpha = 0 "
                          f"with it, got {alpha}")


def check_run(s: OuterSettings, cfg, prefix: str) -> None:
    """Combinations with the run's keys (the run's ``[compressor]`` only acts in the warm-up)."""
    if cfg.compressor.name != "none" and s.warmup_steps == 0 and prefix == "strategy.":
        raise ConfigError("compressor.name", "compresses gradients, which an outer loop exchanges "
                          "only during strategy.warmup_steps (0 here); the pseudo-gradient's "
                          "compressor is strategy.compressor")


OuterLoop.Settings = OuterSettings
