"""Per-level policies: a different way of synchronising at each level of the topology.

A policy names, for each level of the run's :class:`~lowcomm.comm.topology.Topology`, how the units
of that level synchronise with each other inside their parent unit::

    topology = "dc:2,rank:2"
    policy.rank = "syncdp"                               # ranks of one datacenter: every step
    policy.dc   = "diloco:period=50,compressor=int8"     # datacenters: DiLoCo, int8 pseudo-gradients

    # the same in TOML
    topology = "dc:2,rank:2"
    [policy]
    rank = "syncdp"
    dc = "diloco:period=50,compressor=int8"

A spec is ``NAME[:key=value,...]``; NAME is ``syncdp`` or an outer loop (``localsgd``,
``diloco``, ``streaming-diloco``) and the keys are that strategy's ``strategy.*`` keys
(``period``, ``outer_lr``, ``fragments``, ``delay``, ...), with ``compressor`` meaning the
gradient compressor for ``syncdp`` and the pseudo-gradient's for an outer loop; everything a
spec does not say comes from the run's config. Levels without a policy are ``syncdp``.

Composition (Lin et al. 2020, arXiv 1808.07217, hierarchical local SGD; DiLoCo's "islands of
compute", Douillard et al. 2023, arXiv 2311.08105): per-step levels (``syncdp``) must be the
innermost ones; they become one :class:`~lowcomm.strategies.sync.syncdp.SyncDP` over the ranks they
span. Each outer-loop level above wraps the strategy below it (which takes its inner steps), and
synchronises its units through their first ranks: average inside the unit (only when its ranks
may differ, i.e. the level below is itself an outer loop), reduce across the units' leaders
(dense or compressed; each unit counts once), broadcast the result inside the unit. So a
datacenter sends one copy of its pseudo-gradient across, not one per rank. An outer loop
below another must be ``localsgd``, and the one above it cannot merge with ``add-local``
(:func:`check_plan` says why): DiLoCo's anchor, outer optimizer and in-flight bases are the
state of one level and would count the other level's synchronisations as progress.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .method import Context, InnerSplit, Method, ShardedReplicas
from .wrapped import claim, parts_of_one_method
from .outer.nesting import Nesting


@dataclass
class Level:
    """One level of a policy: its name in the topology, the method, the method's settings and
    the options its spec gave (``policy.<level> = "NAME:key=value,..."``)."""
    name: str
    method: Method
    settings: object
    options: dict


def split_levels(plan: list[Level], first: int) -> int:
    """How many of the innermost per-step levels split the model (0, 1, or 2: pipeline stages
    each split again by the level below, ``pp`` over ``tp``); the per-step levels above them
    are data parallelism (plain ``syncdp``, :mod:`lowcomm.parallel.replicas`). A ConfigError
    names a level where a split sits elsewhere, two splits do not compose, or a level above
    them is not plain syncdp."""
    split = [p for p in plan[first:] if p.method.splits]
    if not split:
        return 0
    if len(split) > 2 or (len(split) == 2 and
                          split[1].method.name not in split[0].method.splits_over):
        over = [p.method.name for p in split]
        raise ConfigError(f"policy.{split[0].name}", f"{' over '.join(over)}: two levels that "
                          "split the model in one job are built as pp over tp only (pipeline "
                          "stages on the upper level, each tensor-parallel over the level below "
                          "it)")
    if split[0] is not plan[-len(split)]:
        raise ConfigError(f"policy.{split[0].name}", f"{split[0].method.name} splits the model "
                          f"on the innermost per-step level{'s' if len(split) > 1 else ''} only; "
                          "data parallelism (syncdp) goes above it")
    inner, above = plan[-len(split)], plan[first:-len(split)]
    sharded = len(above) == 1 and sharding(plan, first) is not None
    if first > 0 and sharded and not (above[0].method.name == "fsdp" and inner.method.name == "tp"):
        raise ConfigError(f"policy.{plan[first - 1].name}", f"{plan[first - 1].method.name} "
                          f"above {' over '.join(p.method.name for p in plan[first:])}: an outer "
                          "loop over a split model's sharded replicas is built above fsdp over "
                          "tp only; put syncdp between, or the outer loop above a single tp or "
                          "pp level, pp over tp or fsdp over tp")
    if sharded:
        return len(split)
    for p in above:
        if p.method.name != "syncdp" or p.options:
            raise ConfigError(f"policy.{p.name}", f"above policy.{inner.name}="
                              f"{inner.method.name} a per-step level is plain syncdp (the "
                              f"replicas' gradients averaged) or, directly above tp or pp, "
                              f"fsdp, zero1 or zero2 (the replicas sharded), not {p.method.name}"
                              f"{':' + ','.join(p.options) if p.options else ''}")
    return len(split)


def sharding(plan: list[Level], first: int) -> Level | None:
    """The per-step level that shards the replicas of the split model below it (``fsdp`` above
    ``tp`` or ``pp``, the two per-step levels), or None."""
    if len(plan) - first != 2 or plan[first].method.splits:
        return None
    top, split = plan[first], plan[-1]
    return top if split.method.name in top.method.shards_around else None


def check_plan(plan: list[Level], gradient_compressor: str = "none") -> int:
    """The index of the first per-step (syncdp) level, ``len(plan)`` when there is none; checks
    that per-step levels are innermost and share their options. ``plan`` is outermost first."""
    first = len(plan)
    while first > 0 and not plan[first - 1].method.outer:
        first -= 1
    for i, lvl in enumerate(plan[:first]):
        if not lvl.method.outer:
            below = next(p for p in plan[i + 1:] if p.method.outer)
            raise ConfigError(f"policy.{lvl.name}", f"{lvl.method.name} (every step) above "
                              f"policy.{below.name}={below.method.name} (every period): a level "
                              "cannot synchronise more often than the levels inside it")
    for upper, lower in zip(plan[:first - 1], plan[1:first]):     # an outer loop over an outer loop
        if lower.method.name != "localsgd":
            raise ConfigError(f"policy.{lower.name}", f"{lower.method.name} under "
                              f"policy.{upper.name}={upper.method.name}: an outer loop below "
                              "another must be localsgd (plain averaging). DiLoCo keeps an anchor "
                              "and an outer optimizer that would take the upper level's "
                              "synchronisations for its own progress; use syncdp or localsgd "
                              "below")
        s = upper.settings
        if s.delay > 0 and s.merge in ("add-local", "eager"):   # (an outer loop's settings)
            raise ConfigError(f"policy.{upper.name}.merge", f"{s.merge} over an outer loop "
                              f"(policy.{lower.name}={lower.method.name}): the τ steps' local "
                              "progress it adds back would count the lower level's averaging "
                              "twice; use merge=mix, delay=0, or syncdp below")
    if split_levels(plan, first):
        return first
    steppers = {p.method.name for p in plan[first:]}
    if len(steppers) > 1:
        raise ConfigError(f"policy.{plan[first].name}", f"the per-step levels "
                          f"{', '.join(f'{p.name}={p.method.name}' for p in plan[first:])} run as "
                          "one strategy over their ranks and must name one method; put an outer "
                          "loop (localsgd, diloco) above the inner one")
    if first == len(plan) and gradient_compressor != "none":
        raise ConfigError("compressor.name", "compresses gradients, which only syncdp levels "
                          "exchange, and this policy has none; compress an outer loop's "
                          "pseudo-gradient with policy.<level>=\"diloco:compressor=...\"")
    if len({tuple(sorted(p.options.items())) for p in plan[first:]}) > 1:
        raise ConfigError(f"policy.{plan[first].name}", "the per-step (syncdp) levels "
                          f"{', '.join(p.name for p in plan[first:])} must share their options "
                          "(they run as one hierarchical SyncDP)")
    return first


def build_policy(plan: list[Level], model, optimizer, comm, ctx: Context):
    """The strategy of a per-level ``plan`` (outermost level first) on ``comm``. ``ctx.levels``:
    the topology's communicators over ``comm`` (:meth:`lowcomm.comm.topology.Topology.comms`), whose
    levels must be exactly the plan's."""
    levels = ctx.levels
    if levels is None:
        raise ConfigError("policy", "a per-level policy needs the topology's communicators: "
                          "build the Context with levels=Topology.from_env(comm, spec).comms(comm)")
    names = levels.names
    if tuple(p.name for p in plan) != tuple(names):
        raise ConfigError("policy", f"the plan's levels {[p.name for p in plan]} are not the "
                          f"topology's {list(names)}")
    first = check_plan(plan, ctx.compressor.name)
    with parts_of_one_method():          # the levels share the optimizer; the top one claims it
        strategy = _build_levels(plan, first, model, optimizer, comm, ctx)
    claim(strategy, optimizer)
    return strategy


def _build_levels(plan, first, model, optimizer, comm, ctx: Context):
    """The strategies of a per-level policy, innermost first; returns the outermost. The
    topology's communicators are ``ctx.levels`` (checked against the plan by the caller)."""
    levels, names = ctx.levels, ctx.levels.names
    strategy = None
    if first < len(plan):                    # the per-step levels: one strategy over their span
        lvl = plan[first]
        s = lvl.settings
        scope = comm if first == 0 else levels.group(names[first - 1])
        takes_algorithm = "algorithm" in s.fields()       # the level's method has the key
        if first == 0 and len(names) > 1 and "algorithm" not in lvl.options and takes_algorithm:
            s = dataclasses.replace(s, algorithm="hierarchical")
        elif first > 0 and takes_algorithm and s.algorithm == "hierarchical":
            raise ConfigError(f"policy.{lvl.name}.algorithm", "hierarchical spans the whole job; "
                              "inside a unit use mpi, ring, rabenseifner or tree")
        if split_levels(plan, first):            # the model split, data parallelism around it
            strategy = _build_split(plan, first, scope, levels, model, optimizer, ctx)
        else:
            strategy = lvl.method.build(s, model, optimizer, scope, ctx)
    outer_ctx = dataclasses.replace(ctx, compressor=dataclasses.replace(ctx.compressor, name="none"))
    for i in range(first - 1, -1, -1):       # outer loops, innermost first
        lvl = plan[i]
        scope = comm if i == 0 else levels.group(names[i - 1])
        innermost = i == len(names) - 1
        inside = None if innermost else levels.group(lvl.name)
        peers = levels.peers(lvl.name)
        leaders = peers if inside is not None and inside.rank == 0 else None
        if strategy is not None and (strategy.sharded or strategy.local_shards() is not None):
            peers = levels.rank_peers(lvl.name)   # ZeRO or FSDP below: rank i of every unit
        nest = Nesting(strategy, inside, leaders,
                       average_inside=strategy is not None and i + 1 < first,
                       whole=levels.whole if i == 0 else None, peers=peers)
        strategy = lvl.method.build(lvl.settings, model, optimizer, scope,
                                    dataclasses.replace(outer_ctx, nest=nest))
    return strategy


def _build_split(plan, first, scope, levels, model, optimizer, ctx: Context):
    """The method of the innermost levels that split the model, over ``scope`` (the
    per-step levels' ranks): the upper split level's method on the ranks of one split model
    (``span``), or with two split levels on those holding the same piece of the level below
    (:class:`~lowcomm.strategies.method.InnerSplit`: that level's ranks and settings); per-step
    levels above are its replicas'."""
    names, count = levels.names, split_levels(plan, first)
    top = len(plan) - count
    span = scope if top == first else levels.group(names[top - 1])
    if top > first:
        ctx = dataclasses.replace(ctx, replicas=scope.split(span.rank, level=names[first]))
        shards = sharding(plan, first)
        if shards is not None:
            ctx = dataclasses.replace(ctx, sharding=ShardedReplicas(shards.settings, scope,
                                                                     shards.method.name))
    comm = span
    if count == 2:
        unit = levels.group(names[-2])
        comm = span.split(unit.rank, level=names[-2])
        ctx = dataclasses.replace(ctx, inner=InnerSplit(plan[-1].settings, unit, span))
    return plan[top].method.build(plan[top].settings, model, optimizer, comm, ctx)


__all__ = ["Level", "build_policy", "check_plan"]
