"""What the registry knows of a method (:class:`Method`) and what a builder takes beside its own
settings (:class:`Context`), with the checks that builders share."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..comm.roles import LevelSet
from ..compress.settings import CompressorSettings
from ..settings import NonFinite
from ..errors import ConfigError


def check_compressor_name(s, prefix: str, allow_empty: bool = False) -> None:
    """``s.compressor`` names a registered compressor (``""`` too where ``allow_empty``)."""
    from ..compress import COMPRESSORS
    if not (allow_empty and s.compressor == "") and s.compressor not in COMPRESSORS:
        raise ConfigError.at(prefix, "compressor", f"unknown compressor {s.compressor!r}; known: "
                          f"{', '.join(COMPRESSORS)}")


def refuse_gradient_compressor(cfg, what: str) -> None:
    """The check of a method that sends no gradients (``what`` says what it sends instead): the
    run's gradient compressor would do nothing, so naming one is an error naming the key."""
    if cfg.compressor.name != "none":
        raise ConfigError("compressor.name", f"{what}; leave compressor.name = \"none\", got "
                          f"{cfg.compressor.name!r}")


@dataclass
class Context:
    """What a builder takes beyond its own settings: the run's ``[compressor]`` table (the
    gradient compressor, and the knobs of a compressor named by a strategy option), the run's
    NaN policy (:class:`~lowcomm.settings.NonFinite`: ABORT never sends a non-finite value; SKIP:
    the loop skips such steps on all ranks),
    the run's step budget (None: open-ended), where a per-level policy nests the strategy, and
    the topology's communicators (:class:`~lowcomm.comm.topology.Levels`, built once by the caller:
    per-level policies and the ``hierarchical`` all-reduce need them; None without a topology),
    and this rank's training batches with the forward that runs the model on one (outer loops
    recompute BatchNorm's statistics on them: ``bn_recompute``; None: not given); the task's
    ``criterion(output, target)`` and ``split(batch)``, for a method that computes the loss
    from the last pipeline stage's output (None: the task defines none); ``replicas``: for a
    method that splits the model under data-parallel levels, the ranks holding its part in the
    other replicas (:mod:`lowcomm.parallel.replicas`; None: no data parallelism around it);
    ``inner``: for a method that splits the model over another split level below it (pipeline
    stages each tensor-parallel), that level (:class:`InnerSplit`; None: no such level);
    ``sharding``: for a method that splits the model under a level that shards its replicas
    (``fsdp`` above ``tp``), that level (:class:`ShardedReplicas`; None: no such level)."""
    compressor: CompressorSettings = field(default_factory=CompressorSettings)
    nonfinite: NonFinite = NonFinite.ABORT
    steps: int | None = None
    nest: Any = None
    levels: LevelSet | None = None
    batches: Any = None
    forward: Any = None
    criterion: Any = None
    split: Any = None
    replicas: Any = None
    inner: Any = None
    sharding: Any = None

    def gradient_compressor(self, name: str | None = None):
        """The run's gradient compressor, or the one called ``name`` with the run's knobs,
        wrapped in error feedback where asked (None for "none")."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name) if name else self.compressor)

    def bare_compressor(self, name: str):
        """The compression operator ``name`` with the run's knobs, without error feedback."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name), error_feedback=False)


@dataclass(frozen=True)
class InnerSplit:
    """The split level below a split method's (``tp`` under ``pp``): its ``settings``, its
    ``comm`` (the ranks of one unit: they split each part again) and ``span`` (the ranks of both
    levels together, over which the torch.distributed group and its mesh are made)."""
    settings: Any
    comm: Any
    span: Any


@dataclass(frozen=True)
class ShardedReplicas:
    """A data-parallel level that shards the replicas of a split model (``fsdp``, ``zero1`` or
    ``zero2`` above ``tp`` or ``pp``): its ``settings``, ``span`` (the ranks of every replica
    together, over which FSDP's torch.distributed group and its 2-D mesh are made) and its
    method's ``name``."""
    settings: Any
    span: Any
    name: str = "fsdp"

    @property
    def stage(self) -> int:
        """ZeRO's stage (1 or 2; 3 for FSDP, which shards the parameters too)."""
        return {"zero1": 1, "zero2": 2}.get(self.name, 3)


@dataclass(frozen=True)
class Method:
    """A strategy as the registry knows it.

    ``build(settings, model, optimizer, comm, ctx) -> Strategy``; ``check(settings, cfg,
    prefix)`` (optional) rejects combinations with the run's other keys before MPI starts,
    naming the key; ``outer`` is True for outer loops (they may wrap a lower policy level);
    ``level``: the method may be a level of a per-level policy; ``fleet``: it runs only across
    a fleet's datacenters (its outer state is the fleet coordinator's; elsewhere its check
    refuses it, and the every-method tests, which run one MPI job, leave it to the fleet's);
    ``splits``: it splits the model itself (pipeline stages), so it trains only a task whose
    model it can cut and whose loss it can take apart (``criterion``; the every-method tests
    and ``lowcomm compare``'s data-parallel list leave it to its own tests); ``splits_over``:
    the split methods it runs over on the level below it (``pp`` over ``tp``: stages each split
    again; :class:`Context`'s ``inner``); ``shards_around``: the split methods whose replicas it
    may shard from the level above them (``fsdp`` around ``tp``; :class:`Context`'s
    ``sharding``); ``deferred``: it materialises only its own part of a model built on the meta
    device, where its settings' ``build`` is ``"stages"``
    (:func:`lowcomm.run.registry.deferred_build`).

    What the derived tables read (the method list of ``lowcomm compare``, ``lowcomm methods``,
    the docs' method table, the every-method tests), so that a method is its module and this
    one entry: ``python`` the name a user constructs it by (its class, or a preset's settings:
    a ``lowcomm`` attribute for a built-in method, a dotted path for one from outside);
    ``optimizer`` the inner optimizer it needs (a name of
    :data:`lowcomm.run.optimizers.OPTIMIZERS`; empty when any will do); ``example`` a spec that
    runs it on a small model within a few steps (short periods, small chunks; default: the
    name); ``compare`` the overrides ``lowcomm compare`` adds to ``strategy.name=NAME`` (its
    own good settings), under ``compare_name`` (default: the name)."""
    name: str
    settings: type
    build: Callable
    summary: str
    check: Callable | None = None
    outer: bool = False
    level: bool = False     # may be a level of a per-level policy (per-step or outer loop)
    fleet: bool = False     # runs only across a fleet's datacenters
    splits: bool = False    # splits the model (pipeline, tensor): needs a task that can be cut
    splits_over: tuple[str, ...] = ()   # split methods it composes over, on the level below
    shards_around: tuple[str, ...] = ()  # split methods whose replicas it shards, from above
    # builds its part only: the run's model made on the meta device (lowcomm.parallel.deferred)
    # where the method's settings say build = "stages"; a method with it has that setting
    deferred: bool = False
    python: str = ""
    optimizer: str = ""
    example: str = ""
    compare: tuple[str, ...] = ()
    compare_name: str = ""
