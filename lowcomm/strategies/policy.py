"""Per-level policies: a different way of synchronising at each level of the topology.

A policy names, for each level of the run's :class:`~lowcomm.topology.Topology`, how the units
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
innermost ones; they become one :class:`~lowcomm.strategies.syncdp.SyncDP` over the ranks they
span. Each outer-loop level above wraps the strategy below it (which takes its inner steps), and
synchronises its units through their first ranks: average inside the unit (only when its ranks
may differ, i.e. the level below is itself an outer loop), reduce across the units' leaders
(dense or compressed; each unit counts once), broadcast the result inside the unit. So a
datacenter sends one copy of its pseudo-gradient across, not one per rank.
"""
from __future__ import annotations

import dataclasses

from ..config import POLICY_KEYS, Config, parse_policy, validate
from ..errors import ConfigError
from .outer import Nesting

def level_config(cfg: Config, level: str, name: str, opts: dict) -> Config:
    """The run's config with ``level``'s policy applied: strategy name and its options; errors
    name ``policy.<level>.<key>``."""
    s = dict(opts)
    compressor = s.pop("compressor", None)
    strategy = dataclasses.replace(cfg.strategy, name=name, **s)
    out = dataclasses.replace(cfg, strategy=strategy, policy={})
    if compressor is not None:
        if name == "syncdp":
            out.compressor = dataclasses.replace(cfg.compressor, name=compressor)
        else:
            out.strategy.compressor = compressor
    if name != "syncdp" and out.compressor.name != "none":
        out.compressor = dataclasses.replace(cfg.compressor, name="none")   # no warm-up here
    try:
        return validate(out)
    except ConfigError as e:
        if e.key in ("compressor.name", "strategy.compressor"):
            key = f"policy.{level}.compressor"
        elif e.key.startswith("strategy.") and e.key.removeprefix("strategy.") in opts:
            key = f"policy.{level}.{e.key.removeprefix('strategy.')}"
        else:
            key = f"{e.key} (with policy.{level})"
        raise ConfigError(key, e.reason) from None


def levels_plan(cfg: Config, names: tuple[str, ...]) -> tuple[list[tuple[str, str, dict]], int]:
    """``[(level, name, options)]`` outermost first, and the index of the first per-step level
    (``len(names)`` when there is none). Checks that per-step levels are innermost."""
    unknown = sorted(set(cfg.policy) - set(names))
    if unknown:
        raise ConfigError(f"policy.{unknown[0]}", f"no such level in topology "
                          f"{cfg.topology or '(from the environment)'}; levels: {', '.join(names)}")
    plan = [(lvl, *parse_policy(lvl, cfg.policy.get(lvl, "syncdp"))) for lvl in names]
    first = len(plan)
    while first > 0 and plan[first - 1][1] == "syncdp":
        first -= 1
    for lvl, name, _ in plan[:first]:
        if name == "syncdp":
            below = next(p for p in plan[plan.index((lvl, name, _)) + 1:] if p[1] != "syncdp")
            raise ConfigError(f"policy.{lvl}", f"syncdp (every step) above policy.{below[0]}="
                              f"{below[1]} (every period): a level cannot synchronise more often "
                              f"than the levels inside it")
    if first == len(plan) and cfg.compressor.name != "none":
        raise ConfigError("compressor.name", "compresses gradients, which only syncdp levels "
                          "exchange, and this policy has none; compress an outer loop's "
                          "pseudo-gradient with policy.<level>=\"diloco:compressor=...\"")
    steps = {tuple(sorted(o.items())) for _, _, o in plan[first:]}
    if len(steps) > 1:
        raise ConfigError(f"policy.{plan[first][0]}", "the per-step (syncdp) levels "
                          f"{', '.join(p[0] for p in plan[first:])} must share their options "
                          "(they run as one hierarchical SyncDP)")
    return plan, first


def build_policy(cfg: Config, model, optimizer, comm, levels):
    """The strategy of ``cfg.policy`` on ``comm``; ``levels``: the topology's communicators over
    ``comm`` (:meth:`lowcomm.topology.Topology.comms`)."""
    from .syncdp import SyncDP
    from . import STRATEGIES
    names = levels.names
    plan, first = levels_plan(cfg, names)
    strategy = None
    if first < len(plan):                    # the per-step levels: one SyncDP over their span
        lvl, name, opts = plan[first]
        sub = level_config(cfg, lvl, name, opts)
        scope = comm if first == 0 else levels.group(names[first - 1])
        if first == 0 and len(names) > 1 and "algorithm" not in opts:
            sub.strategy.algorithm = "hierarchical"
        elif first > 0 and sub.strategy.algorithm == "hierarchical":
            raise ConfigError(f"policy.{lvl}.algorithm", "hierarchical spans the whole job; "
                              "inside a unit use mpi, ring, rabenseifner or tree")
        strategy = SyncDP.from_config(sub, model, optimizer, scope,
                                      levels=levels if first == 0 else None)
    for i in range(first - 1, -1, -1):       # outer loops, innermost first
        lvl, name, opts = plan[i]
        sub = level_config(cfg, lvl, name, opts)
        if sub.strategy.algorithm == "hierarchical":
            raise ConfigError(f"policy.{lvl}.algorithm", "an outer loop reduces among unit "
                              "leaders; use mpi, ring, rabenseifner or tree")
        scope = comm if i == 0 else levels.group(names[i - 1])
        innermost = i == len(names) - 1
        inside = None if innermost else levels.group(lvl)
        peers = levels.peers(lvl)
        leaders = peers if inside is not None and inside.rank == 0 else None
        nest = Nesting(strategy, inside, leaders,
                       average_inside=strategy is not None and i + 1 < first)
        strategy = STRATEGIES[name].from_config(sub, model, optimizer, scope, nest=nest)
    return strategy


__all__ = ["POLICY_KEYS", "build_policy", "level_config", "levels_plan"]
