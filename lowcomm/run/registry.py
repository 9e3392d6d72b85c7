"""Names → methods: the one place that knows every strategy.

Each strategy module publishes a :class:`~lowcomm.strategies.method.Method` (its settings
dataclass, its builder and an optional check against the run's other keys); adding a method is
its module plus one line in :data:`STRATEGIES` (or :func:`register` from user code). Every
other list of methods -- ``lowcomm compare``'s, ``lowcomm methods``, the docs' method table, the
every-method tests -- is derived from it (:func:`catalogue`, :func:`example`).

A method is named by a spec string ``NAME[:key=value,...]`` — the same strings in
``policy.<level>``, in ``--set strategy.name=...`` plus ``strategy.<key>`` keys, and from Python::

    import lowcomm
    opt = lowcomm.build("diloco:period=50,outer_lr=0.7", model, torch.optim.AdamW(model.parameters()))
    opt = lowcomm.build("syncdp", model, optimizer, compressor="int8")      # gradient compressor
    opt = lowcomm.policy({"dc": "diloco:period=50,compressor=int8", "rank": "syncdp"},
                         model, optimizer, topology="dc:2,rank:2")

Values in a spec are read as TOML literals where they are one (``50``, ``0.7``, ``true``), else
as strings; unknown names and keys are :class:`~lowcomm.errors.ConfigError` naming them.
"""
from __future__ import annotations

import dataclasses

from .config import Config, parse_override
from ..compress.settings import CompressorSettings
from ..errors import ArgumentError, ConfigError, refuse_moved
from ..settings import NonFinite
from ..strategies.gossip import gossip, noloco
from ..strategies.optimizers import demo, onebit_adam, zeroone_adam
from ..strategies.outer import async_diloco, desloc, diloco, dylu, localsgd, sparseloco, sparta
from ..strategies.ps import async_ps
from ..strategies.sharded import fsdp, zero
from ..strategies.sync import syncdp
from ..strategies.base import Strategy
from ..strategies.method import Context, Method
from ..strategies.policy import Level, build_policy, check_plan
from ..parallel import ep, mesh

#: every strategy by name, one line each
STRATEGIES: dict[str, Method] = {m.name: m for m in (
    syncdp.METHOD,
    zero.METHOD1,
    zero.METHOD2,
    localsgd.METHOD,
    diloco.METHOD,
    diloco.STREAMING_METHOD,
    diloco.EAGER_METHOD,
    gossip.METHOD,
    async_ps.METHOD,
    onebit_adam.METHOD,
    zeroone_adam.METHOD,
    demo.METHOD,
    demo.DISTRO_METHOD,
    sparta.METHOD,
    sparta.DILOCO_METHOD,
    desloc.METHOD,
    noloco.METHOD,
    fsdp.METHOD,
    sparseloco.METHOD,
    diloco.MULOCO_EF_METHOD,
    dylu.METHOD,
    async_diloco.METHOD,
    mesh.METHOD,
    mesh.TP_METHOD,
    ep.METHOD,
)}


def in_one_job() -> dict[str, Method]:
    """The methods one MPI job runs on any task: all but those that run only across a fleet's
    datacenters (:attr:`Method.fleet <lowcomm.strategies.method.Method>`) and those that split
    the model (``Method.splits``: they train a task they can cut, and have tests of their own).
    What ``lowcomm compare`` and the every-method tests take."""
    return {n: m for n, m in STRATEGIES.items() if not m.fleet and not m.splits}


def register(method: Method) -> Method:
    """Add a user's method (its name must be new); returns it, so it can decorate nothing and
    stand as ``METHOD = register(Method(...))``."""
    if not isinstance(method, Method):
        raise TypeError(f"register() takes a lowcomm.Method, got {type(method).__name__}")
    if method.name in STRATEGIES:
        raise ValueError(f"a method named {method.name!r} is registered already")
    if method.example and method.example.partition(":")[0].strip() != method.name:
        raise ValueError(f"method {method.name!r}: example {method.example!r} must be a spec of "
                         f"{method.name!r} itself (\"{method.name}:key=value,...\")")
    taken = {m.compare_name or n: n for n, m in STRATEGIES.items()}
    if (method.compare_name or method.name) in taken:
        raise ValueError(f"method {method.name!r}: lowcomm compare already has "
                         f"{method.compare_name or method.name!r} (method "
                         f"{taken[method.compare_name or method.name]!r}); give another compare_name")
    STRATEGIES[method.name] = method
    return method


def example(m: Method) -> tuple[str, list[str]]:
    """``m`` as the every-method tests run it on a small model: (its example spec, the run keys
    it needs: ``optimizer.name`` where it needs an inner optimizer of its own)."""
    return m.example or m.name, [f"optimizer.name={m.optimizer}"] if m.optimizer else []


def catalogue() -> list[dict]:
    """One row per registered method (user-registered ones included), in registry order: its
    spec name, Python name, inner optimizer, example spec, ``lowcomm compare`` name and summary
    -- what ``lowcomm methods`` prints and the docs' method table shows."""
    return [{"name": n, "python": m.python, "optimizer": m.optimizer, "example": example(m)[0],
             "compare": m.compare_name or n, "summary": m.summary} for n, m in STRATEGIES.items()]


def method(name: str, key: str = "strategy.name") -> Method:
    if name not in STRATEGIES:
        raise ConfigError(key, f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def parse_spec(spec: str, key: str = "strategy") -> tuple[Method, dict]:
    """``"diloco:period=50,compressor=int8"`` -> (the diloco method, ``{"period": 50, ...}``)."""
    if not isinstance(spec, str):
        raise ConfigError(key, f"expects a spec string like \"diloco:period=50\", got {spec!r}")
    name, _, rest = spec.partition(":")
    m = method(name.strip(), key)
    opts: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        k, eq, raw = item.partition("=")
        if not eq:
            raise ConfigError(key, f"option {item!r} in {spec!r} must look like key=value")
        if k.strip() in opts:
            raise ConfigError(key, f"option {k.strip()!r} given twice in {spec!r}")
        opts[k.strip()] = parse_override(f"v={raw}")[1]
    return m, opts


def _defaults(key: str) -> list:
    return [f.default for m in STRATEGIES.values() for f in dataclasses.fields(m.settings)
            if f.name == key]


def settings(m: Method, options: dict, prefix: str = "strategy."):
    """``m``'s settings from ``options``. A key of another method is accepted only at that
    method's default value (it asks for nothing: e.g. a shared TOML's ``bucket_mb = 4.0`` under
    gossip); set to anything else it is an error naming it, since this method would ignore it."""
    own = m.settings.fields()
    mine = {}
    for k, v in options.items():
        if k == "name":
            continue
        if k in own:
            mine[k] = v
            continue
        defaults = _defaults(k)
        if not defaults:
            raise ConfigError.at(prefix, k, f"unknown key (an option of no strategy); {m.name} "
                              f"takes: {', '.join(own) or '(none)'}")
        if v not in defaults:
            owners = sorted(n for n, o in STRATEGIES.items() if k in o.settings.fields())
            raise ConfigError.at(prefix, k, f"is an option of {', '.join(owners)}, which {m.name} "
                              f"would ignore (it takes: {', '.join(own) or '(none)'})")
    return m.settings.from_options(mine, prefix, m.name)


def strategy_settings(cfg) -> tuple[Method, object]:
    """The run's method and its settings, from ``cfg.strategy`` (``name`` + options)."""
    m = method(cfg.strategy.get("name", "syncdp"))
    return m, settings(m, cfg.strategy)


def policy_levels(cfg, names) -> list[Level]:
    """``cfg.policy`` on the topology levels ``names`` (outermost first): every level's method
    and settings (spec options over the run's ``[strategy]`` keys); errors name
    ``policy.<level>.<key>``."""
    unknown = sorted(set(cfg.policy) - set(names))
    if unknown:
        raise ConfigError(f"policy.{unknown[0]}", f"no such level in topology "
                          f"{cfg.topology or '(from the environment)'}; levels: {', '.join(names)}")
    plan = []
    for lvl in names:
        m, opts = parse_spec(cfg.policy.get(lvl, "syncdp"), f"policy.{lvl}")
        if not m.level:
            levels = ", ".join(n for n, o in STRATEGIES.items() if o.level)
            raise ConfigError(f"policy.{lvl}", f"{m.name} cannot be a level of a per-level policy; "
                              f"levels take: {levels}")
        base = {k: v for k, v in cfg.strategy.items() if k in m.settings.fields()}
        s = settings(m, {**base, **opts}, f"policy.{lvl}.")
        if m.check is not None:
            m.check(s, cfg, f"policy.{lvl}.")
        plan.append(Level(lvl, m, s, opts))
    return plan


def check(cfg) -> None:
    """Every method-level key of ``cfg``: the strategy and its options, each policy spec, the
    combinations with the run's keys; raises ConfigError naming the key."""
    if cfg.policy:
        if cfg.strategy.get("name", "syncdp") != "syncdp":
            raise ConfigError("policy", f"give either strategy.name ({cfg.strategy['name']!r}) or "
                              "policy.<level>, not both")
        if cfg.topology:       # else the levels come from the environment when the job starts
            from ..comm.topology import Topology
            names = Topology.parse(cfg.topology).names
            check_plan(policy_levels(cfg, names), cfg.compressor.name)
        else:                  # each spec on its own; the order is known at the start
            policy_levels(cfg, list(cfg.policy))
        return
    m, s = strategy_settings(cfg)
    if m.check is not None:
        m.check(s, cfg, "strategy.")
    own = m.settings.fields()        # keep what was given, as the settings typed it
    cfg.strategy = {"name": m.name, **{k: getattr(s, k) if k in own else v
                                       for k, v in cfg.strategy.items() if k != "name"}}


def deferred_build(cfg) -> str | None:
    """The setting under which the run's model is built on the meta device, each rank
    materialising its own part (``strategy.build`` or ``policy.<level>.build``), None where it
    is built whole: the method (or a policy level's) declares ``Method.deferred`` and its
    ``build`` setting is ``"stages"``."""
    if cfg.policy:
        chosen = [parse_spec(spec, f"policy.{lvl}") + (f"policy.{lvl}.",)
                  for lvl, spec in cfg.policy.items()]
    else:
        chosen = [(method(cfg.strategy.get("name", "syncdp")), {}, "strategy.")]
    for m, opts, prefix in chosen:
        if m.deferred:
            base = {k: v for k, v in cfg.strategy.items() if k in m.settings.fields()}
            if settings(m, {**base, **opts}, prefix).build == "stages":
                return prefix + "build"
    return None


def context(cfg) -> Context:
    """What builders take from the run's config."""
    return Context(compressor=cfg.compressor, nonfinite=cfg.on_nonfinite, steps=cfg.steps)


def build_strategy(cfg, model, optimizer, comm, given: Context | None = None) -> Strategy:
    """The run's strategy on ``comm``: a per-level policy, or ``cfg.strategy``. ``given``: what
    the run gives the method beyond its config (:class:`~lowcomm.strategies.method.Context`): the
    topology's communicators over ``comm`` (:func:`topology_comms`), which a policy and the
    hierarchical all-reduce need; this rank's training batches (a function of the step) and the
    task's forward, criterion and split; the config's compressor, NaN policy and steps are
    filled in here."""
    given = given or Context()
    ctx = dataclasses.replace(given, compressor=cfg.compressor, nonfinite=cfg.on_nonfinite,
                              steps=cfg.steps)
    if cfg.policy:
        return build_policy(policy_levels(cfg, ctx.levels.names), model, optimizer, comm, ctx)
    m, s = strategy_settings(cfg)
    return m.build(s, model, optimizer, comm, ctx)


#: ``lowcomm.build``'s keywords that moved into its ``context``
BUILD_MOVED = {"nonfinite": "context=lowcomm.Context(nonfinite=...)",
               "steps": "context=lowcomm.Context(steps=...)",
               "levels": "context=lowcomm.Context(levels=...)",
               "bn_batches": "context=lowcomm.Context(batches=...)",
               "bn_forward": "context=lowcomm.Context(forward=...)"}


def _python_context(compressor, context: Context | None) -> Context:
    """``context`` (default: none) with ``compressor`` (a name, a CompressorSettings or None:
    the context's) checked, and its NaN policy parsed ("abort", "skip" or a NonFinite)."""
    context = context or Context()
    if not isinstance(context, Context):
        raise ArgumentError("context", f"must be a lowcomm.Context, got {type(context).__name__}")
    if compressor is None:
        compressor = context.compressor
    elif context.compressor != CompressorSettings():
        raise ArgumentError("compressor", "given twice: as compressor= and as the context's "
                            "compressor; give one")
    elif isinstance(compressor, str):
        compressor = CompressorSettings(name=compressor)
    elif not isinstance(compressor, CompressorSettings):
        raise TypeError("compressor must be a name, a CompressorSettings or None, got "
                        f"{type(compressor).__name__}")
    compressor.validate("compressor.")
    return dataclasses.replace(context, compressor=compressor, nonfinite=NonFinite.parse(
        context.nonfinite, "context.nonfinite", ArgumentError))


def build(spec: str, model, optimizer, comm=None, *, compressor=None,
          context: Context | None = None, **options) -> Strategy:
    """Any registered strategy from Python: ``spec`` is ``NAME[:key=value,...]`` and
    ``options`` more keys (they win over the spec's). ``compressor``: the gradient
    compressor's name or a :class:`~lowcomm.compress.settings.CompressorSettings` (its knobs
    also serve a compressor a strategy option names). ``comm``: default the world.
    ``context``: the run's objects (:class:`~lowcomm.strategies.method.Context`): ``nonfinite``,
    the NaN policy ("abort" or "skip"); ``steps``, the run's step budget (the parameter server
    needs it); ``levels``, the topology's communicators
    (:meth:`lowcomm.comm.topology.Topology.comms`) for ``algorithm=hierarchical``; ``batches``
    and ``forward``, training batches for an outer loop's ``bn_recompute`` (see
    :class:`~lowcomm.strategies.outer.loop.OuterLoop`).

    Example::

        opt = lowcomm.build("streaming-diloco:period=100,fragments=4,delay=5", model, inner)
        ps = lowcomm.build("async-ps", model, inner, context=lowcomm.Context(steps=1000))
    """
    from ..comm.comm import init
    refuse_moved(options, BUILD_MOVED, "lowcomm.build()")
    m, opts = parse_spec(spec, "spec")
    s = settings(m, {**opts, **options}, "")
    context = _python_context(compressor, context)      # its errors before MPI starts
    return m.build(s, model, optimizer, comm or init(), context)


def policy(levels: dict[str, str], model, optimizer, comm=None, *, topology: str = "",
           compressor=None, nonfinite: NonFinite | str = NonFinite.ABORT) -> Strategy:
    """A per-level policy from Python: ``levels`` maps each topology level to a spec (levels
    left out are ``syncdp``); ``topology`` a spec such as ``"dc:2,rank:2"`` (default: the
    environment, as :meth:`lowcomm.comm.topology.Topology.from_env`)."""
    from ..comm.comm import init
    from ..comm.topology import Topology
    comm = comm or init()
    comms = Topology.from_env(comm, topology).comms(comm)
    cfg = Config(topology=topology, policy=dict(levels))
    plan = policy_levels(cfg, comms.names)
    return build_policy(plan, model, optimizer, comm, _python_context(
        compressor, Context(levels=comms, nonfinite=NonFinite.parse(nonfinite, "nonfinite",
                                                                    ArgumentError))))


__all__ = ["STRATEGIES", "build", "build_strategy", "deferred_build", "catalogue", "check", "context", "example", "method",
           "parse_spec", "policy", "policy_levels", "register", "settings", "strategy_settings"]
