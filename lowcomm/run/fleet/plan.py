"""A run in the form a fleet of datacenters runs it, decided once (:func:`plan` →
:class:`FleetPlan`), and a job's place in the fleet (:func:`identity`).

:func:`plan` puts the run's outer method on the ``dc`` level of a per-level policy (``dc`` =
the method across datacenters, ``rank`` = SyncDP inside each); a policy given by the user must
have ``dc`` as its outermost level. The topology is parsed here and nowhere else in the fleet:
the supervisor, the coordinator's limits, the report's period and every datacenter's levels
read it from the :class:`FleetPlan`.
"""
from __future__ import annotations

import dataclasses
import os

from ...comm.topology import Topology
from ...errors import ConfigError
from .store import Limits
from .trust import SECRET_ENV, SESSION_ENV

#: what the fleet tells each datacenter's job: the coordinator's address, the datacenter,
#: its incarnation, whether it rejoins, its ranks' place in the fleet ("offset,total"), and
#: the fleet's secret and the coordinator's session (:mod:`~lowcomm.run.fleet.trust`)
ENV = ("LOWCOMM_FLEET", "LOWCOMM_FLEET_DC", "LOWCOMM_FLEET_INC", "LOWCOMM_FLEET_JOIN",
       "LOWCOMM_FLEET_RANKS", SECRET_ENV, SESSION_ENV)

#: outer methods a fleet runs across datacenters
OUTER = ("diloco", "streaming-diloco", "diloco-eager", "localsgd", "diloco-dylu", "diloco-async")

#: outer methods whose state is the coordinator's arrival server (no rounds)
ARRIVALS = ("diloco-async",)


def identity() -> dict | None:
    """This job's place in a fleet, from :data:`ENV`, or None outside a fleet."""
    if not os.environ.get("LOWCOMM_FLEET"):
        return None
    try:
        offset, total = (int(x) for x in os.environ["LOWCOMM_FLEET_RANKS"].split(","))
        return {"address": os.environ["LOWCOMM_FLEET"], "dc": int(os.environ["LOWCOMM_FLEET_DC"]),
                "inc": int(os.environ.get("LOWCOMM_FLEET_INC", "0")),
                "join": os.environ.get("LOWCOMM_FLEET_JOIN", "0") == "1",
                "offset": offset, "total": total}
    except (KeyError, ValueError) as e:
        raise ConfigError("LOWCOMM_FLEET", f"a fleet's job needs {', '.join(ENV)} (set by "
                          f"lowcomm train --dcs): {e}") from None


def _spec(strategy: dict) -> str:
    def lit(v):
        return str(v).lower() if isinstance(v, bool) else str(v)
    opts = ",".join(f"{k}={lit(v)}" for k, v in strategy.items() if k != "name")
    return strategy["name"] + (":" + opts if opts else "")


@dataclasses.dataclass(frozen=True)
class FleetPlan:
    """A run in the form a fleet of datacenters runs it (:func:`plan`): ``cfg`` with its outer
    method on the ``dc`` level of a per-level policy, and that policy's topology, parsed once."""
    cfg: object
    topology: Topology

    @property
    def link(self):
        """The cross-datacenter links' α–β model (None: not modelled)."""
        return self.topology.link("dc")

    def limits(self) -> Limits:
        """How long the fleet waits (:class:`~lowcomm.run.fleet.store.Limits`)."""
        c = self.cfg
        return Limits.of(self.link, c.fleet.heartbeat_s, c.comm.watchdog_factor, c.comm.outage_s,
                         c.fleet.join_s)

    def _dc_level(self):
        from ..registry import policy_levels
        return policy_levels(self.cfg, self.topology.names)[0]

    @property
    def period(self) -> int:
        """H of the outer method across datacenters."""
        return int(self._dc_level().settings.period)

    @property
    def arrivals(self) -> bool:
        """Whether the outer method is asynchronous DiLoCo: arrivals at the coordinator's
        server (:mod:`~lowcomm.run.fleet.server`) instead of rounds."""
        return self._dc_level().method.name in ARRIVALS

    def server(self) -> dict | None:
        """The arrival server's settings (None: a fleet of rounds): the outer learning rate
        and momentum, and N arrivals between momentum updates (``nesterov_every``; 0: as many
        as the fleet's datacenters)."""
        if not self.arrivals:
            return None
        s = self._dc_level().settings
        return {"lr": s.outer_lr, "momentum": s.outer_momentum,
                "every": s.nesterov_every or self.cfg.fleet.dcs}


def plan(cfg, dcs: int, ranks: int) -> FleetPlan:
    """``cfg`` in the form a fleet of ``dcs`` datacenters (``ranks`` in all) runs: its outer
    method on the ``dc`` level of a per-level policy; refuses what a fleet cannot run, naming
    the key."""
    if ranks % dcs:
        raise ConfigError("fleet.dcs", f"{ranks} ranks do not split evenly over {dcs} datacenters")
    if not cfg.policy:
        name = cfg.strategy.get("name", "syncdp")
        if name not in OUTER:
            raise ConfigError("strategy.name", f"{name} synchronises every step; across "
                              f"datacenters a fleet runs an outer method: {', '.join(OUTER)}")
        cfg = dataclasses.replace(cfg, topology=f"dc:{dcs},rank:{ranks // dcs}",
                                  policy={"dc": _spec(cfg.strategy), "rank": "syncdp"},
                                  strategy={"name": "syncdp"})
    topo = Topology.parse(cfg.topology) if cfg.topology else None
    if topo is None or topo.names[0] != "dc" or len(topo.units("dc")) != dcs:
        raise ConfigError("topology", f"a fleet of {dcs} datacenters needs a topology whose "
                          f"outermost level is dc with {dcs} units, got {cfg.topology!r}")
    if topo.size != ranks:
        raise ConfigError("topology", f"{cfg.topology!r} places {topo.size} ranks, the fleet "
                          f"launches {ranks}")
    _check_dc_level(cfg)
    _check_split_inside(cfg, topo.names[1:])
    return FleetPlan(cfg, topo)


def _check_split_inside(cfg, names: list[str]) -> None:
    """One split level inside each datacenter (tp, pp or ep, syncdp above it): the two-level
    compositions (pp over tp, a sharding level over a split one) are not verified in a fleet."""
    from ..registry import parse_spec
    below = [parse_spec(cfg.policy.get(n, "syncdp"), f"policy.{n}")[0] for n in names]
    sharded = any(b.name in a.shards_around for a, b in zip(below, below[1:]))
    if sum(m.splits for m in below) > 1 or sharded:
        raise ConfigError(f"policy.{names[0]}", f"{' over '.join(m.name for m in below)} inside "
                          "a fleet's datacenters: an outer method over two levels that split or "
                          "shard the model runs in one MPI job (policy.dc above them), not "
                          "verified in a fleet; use one split level with syncdp above it")


def _check_dc_level(cfg) -> None:
    from ..registry import parse_spec
    m, opts = parse_spec(cfg.policy.get("dc", "syncdp"), "policy.dc")
    if m.name not in OUTER:
        raise ConfigError("policy.dc", f"{m.name} across datacenters: a fleet runs an outer "
                          f"method there ({', '.join(OUTER)})")
    merged = {**{k: v for k, v in cfg.strategy.items() if k != "name"}, **opts}
    if merged.get("compressor", "none") not in ("none", ""):
        raise ConfigError("policy.dc.compressor", "a fleet reduces dense pseudo-gradients across "
                          "datacenters (a compressor's error feedback would count a retried "
                          "round twice); use compressor=none")
    inside = parse_spec(cfg.policy.get("rank", "syncdp"), "policy.rank")[0].name
    _check_aggregate(m, merged, cfg, inside)
    if cfg.fleet.quorum and (m.name != "diloco" or inside != "syncdp"):
        raise ConfigError("fleet.quorum", f"rounds that go ahead without a late datacenter "
                          f"merge its steps next round under diloco over syncdp inside; here "
                          f"{m.name} over {inside}: use fleet.quorum = 0")
    if int(merged.get("delay", m.settings.delay)) and inside != "syncdp":
        raise ConfigError("policy.dc.delay", f"a delayed outer loop over datacenters sharded "
                          f"inside ({inside}): their ranks hand each round on in step; use "
                          "delay=0, or syncdp inside")



def _check_aggregate(m, merged: dict, cfg, inside: str) -> None:
    """A robust rule across datacenters: the fleet must be able to carry it."""
    from ...strategies.outer.aggregate import check_rule
    rule = merged.get("aggregate", "mean")
    if rule == "mean":
        return
    if cfg.fleet.quorum:
        raise ConfigError("fleet.quorum", f"aggregate = {rule!r} compares every member's "
                          "pseudo-gradient in one round; rounds that go ahead without a late "
                          "datacenter merge its steps later: use fleet.quorum = 0 with it")
    if inside != "syncdp":
        raise ConfigError("policy.dc.aggregate", f"{rule!r} gathers one pseudo-gradient per "
                          f"datacenter through its leader; {inside} inside reduces by ranges: "
                          "use syncdp inside, or aggregate = \"mean\"")
    check_rule(rule, cfg.fleet.dcs, int(merged.get("trim", 1)), "policy.dc.aggregate")

__all__ = ["ARRIVALS", "ENV", "OUTER", "FleetPlan", "identity", "plan"]
