"""The skeleton Local SGD, DiLoCo and streaming DiLoCo share: local steps, then (every ``period``
steps, per fragment, possibly in the background) an average over the ranks that is applied to the
parameters. Subclasses say only what is sent (:meth:`OuterLoop._outgoing`) and how the average
is applied (:meth:`OuterLoop._apply`); the fragments (:mod:`~lowcomm.strategies.outer.fragment`) own
their reductions in flight and their merge, and where the average goes is the route's
(:mod:`~lowcomm.strategies.outer.route`). :class:`OuterLoop` keeps the schedule.

Schedule, with W = ``warmup_steps``, H = ``period``, τ = ``delay``, after each inner step
t (counted from 1; steps all ranks skip together are not counted, a step one rank skips
under AMP is) and s = t − W:

  1. t ≤ W: the step was a dense :class:`~lowcomm.strategies.sync.syncdp.SyncDP` step
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

At the end (:meth:`OuterLoop.finish`), with ``bn_recompute = N`` the statistics are recomputed on N
batches per rank under the delivered weights and averaged, instead of averaging the
statistics the ranks ran with: averaged statistics need not fit the weights an outer step
made (DiLoCo on a BatchNorm CNN: 0.875/0.923 test accuracy against SyncDP's 0.98 before).
The batches: ``context.batches`` (:class:`~lowcomm.strategies.method.Context`), an iterable
(a list, a DataLoader: iterated afresh each time) or a function of the inner step t returning
one (the loop passes the task's batches of this rank's last steps); ``context.forward(model,
batch)`` runs the model on one (default:
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
The summary (:meth:`OuterLoop.metrics`) reports the bytes of each synchronisation (all ranks together) as
``sync_bytes_peak`` / ``sync_bytes_mean``, as ``wait_s_by_rank`` the seconds each rank's
steps waited for reductions in flight (the communication τ steps did not hide), and how the
reductions ran (``reductions``: "posted", "thread" or "blocking").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...comm.collectives import get_algorithm
from ...comm.comm import Comm
from ...compress.compressor import Compressor
from ...errors import ArgumentError, ConfigError
from ..base import LocalSteps
from ..buffers import Buffers, Recompute
from .aggregate import RULES, Aggregator
from .fragment import Fragment, InFlight, done, partition
from ..method import Context, check_compressor_name
from .nesting import OverALevel
from .route import Route, Thread, local_shards
from .syncs import SyncLog
from ..sync.syncdp import SyncDPSettings

log = logging.getLogger("lowcomm.strategies.outer.loop")


class OuterLoop(OverALevel, LocalSteps):
    """Local steps; every ``period`` steps each fragment's outgoing tensor is averaged over the
    ranks and applied (the schedule: the module's docstring). A subclass (LocalSGD, DiLoCo,
    ...) defines :meth:`_outgoing` and :meth:`_apply`, and where it keeps outer state
    :meth:`_warmup_done`, :meth:`_outer_state`, :meth:`_reshard_extra` and its state dict."""

    name = "outer"
    option_defaults = {"algorithm": "mpi"}    # a Python caller's all-reduce
    unfreezes = True           # Settings: OuterSettings, set below where it is defined

    moved = {"levels": "context=lowcomm.Context(levels=...)",
             "nest": "context=lowcomm.Context(nest=...)",
             "bn_batches": "context=lowcomm.Context(batches=...)",
             "bn_forward": "context=lowcomm.Context(forward=...)",
             "warmup_options": "the warm-up's SyncDP keys as the method's own (bucket_mb=, "
                               "overlap=, ...) and its compressor and NaN policy as "
                               "context=lowcomm.Context(compressor=..., nonfinite=...)"}

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, compressor: Compressor | None = None,
                 context: Context | None = None, **options):
        super().__init__(model, optimizer, comm, **options)
        s, context = self.settings, context or Context()
        nest, levels = context.nest, context.levels
        get_algorithm(s.algorithm, levels)
        if compressor is not None and not isinstance(compressor, Compressor):
            raise ArgumentError("compressor", f"must be a lowcomm Compressor, got "
                                f"{type(compressor).__name__}")
        self.period, self.warmup_steps, self.algorithm = s.period, s.warmup_steps, s.algorithm
        self.delay, self.alpha, self.merge, self.compressor = s.delay, float(s.alpha), s.merge, compressor
        self.nest, named = nest, self.members()      # frozen ones too: unfrozen later, averaged
        if not named:
            raise ValueError("the model has no trainable parameters")
        local = local_shards(nest, s.warmup_steps, self.name)   # FSDP below: my chunks (a
        # pipeline below: its stages' parameters); the fragments are the whole model's, of them
        self.fragments = partition(named, s.fragments, self.period,
                                   self.delay if s.slot == "merge" else 0, local)   # torchft's slots
        self.buffers = Buffers(model)
        self._bn = Recompute(model, s.bn_recompute, context.batches, context.forward) \
            if s.bn_recompute else None
        self.t, self.wait_s = 0, 0.0                 # inner steps taken; seconds waited
        self.syncs = SyncLog()                       # [local step, fragment, bytes sent here]
        self._dense = self._start_equal(context, local)
        self.route = Route(self.comm, nest, self.fragments, levels, s.algorithm, compressor, local)
        self.route.aggregate_with(s.aggregator())
        for below in (self._dense, self._inner):
            if below is not None:                    # this method's guard names the right object
                below.guard.release()
        self._thread = Thread(self.delay, self.route, self.name)
        self._posting = self._thread.pool is not None and self.route.can_post(self.fragments)

    # what subclasses define ---------------------------------------------------------------------
    def _outgoing(self, f: Fragment, local: torch.Tensor) -> torch.Tensor:
        """The flat CPU tensor this rank contributes for fragment ``f``, whose parameters here
        are ``local`` (``f.local()``, fresh: it may be returned)."""
        raise NotImplementedError

    def _apply(self, f: Fragment, avg: torch.Tensor) -> torch.Tensor:
        """Take the rank average ``avg`` of the outgoing tensors of fragment ``f``; return the
        fragment's new synchronised value (flat), which :meth:`_land` merges into the model."""
        raise NotImplementedError

    @classmethod
    def from_settings(cls, s, model, optimizer, comm: Comm, ctx: Context) -> "OuterLoop":
        """The registry's ``build`` (:class:`~lowcomm.strategies.method.Method`) of a method
        whose settings give all its arguments: ``cls(model, optimizer, comm, **s.kwargs(ctx))``."""
        return cls(model, optimizer, comm, **s.kwargs(ctx))

    def _unapplied(self, f: Fragment) -> torch.Tensor:
        """The fragment's synchronised value when its average is not finite and so not applied
        (here: the rank's own parameters)."""
        return f.local()

    def _warmup_done(self) -> None:
        """Called once after the last dense step (parameters are equal on all ranks)."""

    def _base(self, f: Fragment, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """What the local progress of the τ steps is added onto when the average lands
        (``merge = "add-local"``: the fragment when sent), or None (``mix``)."""
        if self.merge != "add-local":
            return None
        return local.clone() if out is local else local

    def _outer_state(self) -> list[torch.Tensor]:
        """The tensors of the outer step's state (DiLoCo's θ and momentum; none here)."""
        return []

    def _reshard_extra(self, old: list[dict]) -> dict:
        """Merged values of the state keys a subclass adds (none here)."""
        return {}

    # the schedule -------------------------------------------------------------------------------
    def _advance(self) -> None:
        """After inner step t: the warm-up's end, the reductions that land and those that start,
        and, at the end of each period, the buffers' average."""
        self.t += 1
        s = self.t - self.warmup_steps
        if s == 0:
            if self._dense is not None:
                self._dense.close()
                self._dense = None
            self._warmup_done()
        elif s > 0:
            for f in self.fragments:
                f.dirty = True
                if f.flight is not None:             # posted ones move on in MPI calls only
                    f.flight.future.done()
            for f in self.fragments:
                if f.flight is not None and f.flight.apply_at == s:
                    self._land(f.land())
            for f in self.fragments:
                if s % self.period == f.offset:
                    self._start(f, s)
            if s % self.period == 0:
                self._in_turn(self._settle_buffers)

    def _settle_buffers(self) -> None:
        """The buffers every rank ends a period (or the run) with: BatchNorm's statistics
        recomputed on this rank's batches first where asked, then averaged over the ranks."""
        if self._bn is not None and (self.settings.bn_recompute_at == "sync" or self.closed):
            self._bn(self.t)
        self.buffers.average(self.route.whole)

    def _in_turn(self, fn) -> None:
        """``fn()`` now, or after the rounds in flight where they share a fleet's channel (one
        sequence per member: the thread runs it next, the wait counted in :attr:`wait_s`)."""
        if not self.buffers and self._bn is None:
            return
        if self._thread.pool is not None and self.route.fleet:
            self.wait_s += self._thread.wait(self._thread.pool.submit(fn))[1]
        else:
            fn()

    def _start(self, f: Fragment, s: int) -> None:
        if not f.members:                            # none of it here (another stage's)
            return
        local = f.local()
        out = self._outgoing(f, local)
        if self._thread.pool is None:
            self._land(InFlight(f.index, s, s, done(self._reduce(f, out, self.t))))
            return
        base = self._base(f, local, out)
        future = self.route.post(f, out, self._thread.idle) if self._posting else \
            self._thread.pool.submit(self._reduce, f, out, self.t)
        f.fly(InFlight(f.index, s, s + self.delay, future, base))

    def _reduce(self, f: Fragment, flat: torch.Tensor, t: int) -> tuple[torch.Tensor, list[dict]]:
        """Average ``flat``, sent at inner step ``t``, along the route."""
        return self.route.reduce(f, flat, t)

    def _land(self, item: InFlight) -> None:
        """Apply a finished reduction: the subclass's :meth:`_apply`, merged by the fragment."""
        avg, rows = self._result(item)
        self._charge(item, rows)
        f = self.fragments[item.fragment]
        if bool(torch.isfinite(avg).all()):
            synced = self._apply(f, avg)
        else:                                        # never applied, whatever the rule
            log.warning("%s: the average of fragment %d sent at step %d is not finite; not "
                        "applied", self.name, item.fragment, item.start)
            synced = self._unapplied(f)
        f.merge_(synced, item.base, self.alpha)
        if self._inner is not None:
            self._inner.parameters_changed()

    def _charge(self, item: InFlight, rows: list[dict]) -> None:
        self.syncs.charge(item.start, item.fragment, rows, self.comm.ledger)

    def _result(self, item: InFlight) -> tuple[torch.Tensor, list[dict]]:
        """The reduction's result, waited for (the wait is added to :attr:`wait_s`)."""
        out, waited = self._thread.wait(item.future)
        self.wait_s += waited
        return out

    @property
    def _in_flight(self) -> list[InFlight]:
        """The fragments' reductions in flight, in the order they were sent."""
        return sorted((f.flight for f in self.fragments if f.flight is not None),
                      key=lambda i: (i.start, i.fragment))

    def drain(self) -> None:
        """Wait for every reduction in flight; each is still applied at its step (a fleet's
        admission round waits so: a member's rounds are one sequence)."""
        for item in self._in_flight:
            item.future = done(self._result(item))

    def landed(self, step: int) -> int:
        """The inner step τ = ``delay`` steps before this loop's own count."""
        return self.t - self.delay

    @property
    def shards_model(self) -> bool:
        """Whether the level below shards the parameters (FSDP) or splits the model (a pipeline)."""
        return self.route.local is not None

    # state --------------------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        """Inner optimizer, step counter, reductions in flight (completed first, applied at their
        step after a resume), compressors, and what subclasses add (outer state)."""
        self.drain()
        state = {"optimizer": self.optimizer.state_dict(), "t": self.t,
                 "syncs": [list(x) for x in self.syncs],
                 "in_flight": [item.saved() for item in self._in_flight]}
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        if self.route.aggregator.gathers:             # the member score (aggregate.py)
            state["aggregate"] = self.route.aggregator.strikes.state_dict()
        return dict(state, **self._below_state())

    def _load_state_dict(self, state: dict) -> None:
        if self._in_flight:
            raise RuntimeError("load_state_dict() while reductions are in flight")
        self.optimizer.load_state_dict(state["optimizer"])
        self.t = int(state["t"])
        self.syncs = SyncLog(list(x) for x in state["syncs"])
        for saved in state["in_flight"]:
            item = InFlight.restored(saved)
            self.fragments[item.fragment].fly(item)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        if "aggregate" in state and self.route.aggregator.gathers:
            self.route.aggregator.strikes.load_state_dict(state["aggregate"])
        self._load_below_state(state)

    def reshard(self, old: list[dict]) -> dict:
        """Per-rank state averaged over the old ranks, the rest rank 0's
        (:func:`~lowcomm.strategies.reshard.outer_loop`)."""
        from ..reshard import outer_loop
        return outer_loop(self, old)

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return self._inner.metrics(ctl) if self._inner is not None else {}
        out = {"period": self.period, "warmup_steps": self.warmup_steps,
               "fragments": len(self.fragments), "delay": self.delay,
               **self.syncs.summary(ctl, self.wait_s),
               "reductions": "posted" if self._posting else "thread" if self.delay else "blocking",
               "fragment_numel": [f.numel for f in self.fragments],
               "sharded": self.route.sharded or self.route.local is not None}
        agg = self.route.aggregator
        if agg is not None and agg.gathers:
            out["aggregate"] = {"rule": agg.rule, "strikes": agg.strikes.state_dict(),
                                "last": vars(agg.last) if agg.last is not None else None}
        if self._inner is not None:
            out["inner"] = {"strategy": self._inner.name, **self._inner.metrics(ctl, final=True)}
        return out

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """One model on every rank: the fragments stepped since their last synchronisation
        averaged (:meth:`lowcomm.strategies.outer.route.Route.finish`), then the buffers."""
        if self.route.fleet:                         # the channel's rounds are one sequence
            self.drain()
        for f in self.fragments:
            if f.dirty and f.members:
                self.route.finish(f, self.comm.ledger)
            f.dirty = False
        self._settle_buffers()
        if self.route.local is not None:             # FSDP below: the plain, whole model
            self._inner.parameters_changed()         # (copies an owner keeps: from it)
            self._inner._finish()
        elif self._inner is not None:
            self._inner.parameters_changed()

    def _close(self) -> None:
        """Finish reductions still in flight (their traffic is charged, their updates, due after
        the last step, are not applied), stop the thread, remove the warm-up hooks."""
        self.drain()
        for item in self._in_flight:
            self._charge(self.fragments[item.fragment].land(), item.future.result()[1])
        self._thread.close()
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
    # how the members' pseudo-gradients become one (strategies/outer/aggregate.py): "mean" (an
    # all-reduce) | "clip" (each clipped to c x the median norm) | "trim" | "median" (per coordinate)
    aggregate: str = "mean"
    clip: float = 2.0              # c ≥ 1: clip's line, c x the median norm; past it a member strikes
    trim: int = 1                  # b: values dropped at each end of every coordinate ("trim")
    strikes: int = 3               # strikes in a row that fence a member until it is sane again (0: never)
    # why a method cannot take a rule other than "mean" ("": it can; not a key)
    aggregate_refusal = ""
    # The schedule every outer loop reads, declared here with the values that keep it plain:
    # keys only of the methods whose settings redeclare them as fields (streaming-diloco's
    # five, diloco-async's delay), constants of the others.
    fragments = 1                  # P parameter fragments, synchronised at staggered steps
    delay = 0                      # τ inner steps a reduction is in flight (0: it blocks)
    alpha = 0.0                    # share of the local parameters kept when merging ("mix")
    merge = "mix"                  # "mix" | "add-local" | "eager": how an average is merged
    slot = "send"                  # what falls on a fragment's slot: its "send" or its "merge"

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
        self._check_aggregate(prefix)
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

    def _check_aggregate(self, prefix: str) -> None:
        self.one_of(prefix, "aggregate", RULES)
        self.within(prefix, "clip", 1, float("inf"))
        self.at_least(prefix, "trim", 1)
        self.at_least(prefix, "strikes", 0)
        if self.aggregate == "mean":
            return
        if self.aggregate_refusal:
            raise ConfigError.at(prefix, "aggregate", f"{self.aggregate!r}: {self.aggregate_refusal}")
        if self.compressor == "powersgd":
            raise ConfigError.at(prefix, "aggregate", f"{self.aggregate!r} decodes every member's "
                                 "payload on its own; PowerSGD's factors come from a power "
                                 "iteration over all of them: use aggregate = \"mean\" with it")

    def aggregator(self) -> Aggregator:
        """The rule these settings name, with its score."""
        return Aggregator(self.aggregate, self.clip, self.trim, self.strikes)

    def kwargs(self, ctx: Context) -> dict:
        """The constructor's arguments: these settings (validated) and the run's objects."""
        return dict(settings=self, context=ctx)

    def warmup_options(self, ctx: Context) -> dict:
        """The dense warm-up's SyncDP keyword arguments but ``algorithm`` (the outer loop's
        own): these settings' SyncDP keys, the run's gradient compressor and NaN policy."""
        mine = vars(self)                            # the warm-up's SyncDP keys are fields here
        warmup = SyncDPSettings(**{k: mine[k] for k in SyncDPSettings.fields()
                                   if k != "compressor"}).kwargs(ctx)
        del warmup["algorithm"]
        return warmup


MERGES = ("mix", "add-local", "eager")
BN_RECOMPUTE_AT = ("end", "sync")


def check_merge(merge: str, alpha: float, prefix: str = "") -> None:
    """A streaming fragment's merge rule (:class:`~lowcomm.strategies.outer.diloco.StreamingDiLoCo`)."""
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
