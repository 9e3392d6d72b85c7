"""The shape every strategy shares: a ``torch.optim.Optimizer`` that wraps the user's optimizer.

A method *is* an optimizer (the design of Horovod's ``DistributedOptimizer``): it shares the
wrapped optimizer's ``param_groups``, ``state`` and ``defaults``, so torch's LR schedulers, AMP's
``GradScaler``, gradient clipping and frameworks that check ``isinstance(opt, Optimizer)`` (the
Hugging Face Trainer) drive it as they would the optimizer itself, while ``step()`` adds the
method's communication. The wrapped optimizer's own ``step()`` refuses to run outside the
method's, so a direct call can never skip the communication silently.

The protocol: ``zero_grad``, ``step``, ``skip``, ``no_sync``, ``state_dict``, ``load_state_dict``,
``finish`` (or leaving a ``with`` block), ``close``, an optional ``metrics`` and ``reshard`` (merge
the checkpoints of another rank count; default: replicated state, rank 0's copy). A strategy
module also owns a :class:`~lowcomm.settings.Settings` dataclass of its knobs and a builder, which
it publishes as a :class:`Method`; :mod:`lowcomm.run.registry` maps names to methods.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..comm.comm import Comm, init
from ..comm.roles import LevelSet
from ..compress.settings import CompressorSettings
from ..errors import CommError, ConfigError, LowcommError
from ..settings import NonFinite


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
    from the last pipeline stage's output (None: the task defines none)."""
    compressor: CompressorSettings = field(default_factory=CompressorSettings)
    nonfinite: NonFinite = NonFinite.ABORT
    steps: int | None = None
    nest: Any = None
    levels: LevelSet | None = None
    batches: Any = None
    forward: Any = None
    criterion: Any = None
    split: Any = None

    def gradient_compressor(self, name: str | None = None):
        """The run's gradient compressor, or the one called ``name`` with the run's knobs,
        wrapped in error feedback where asked (None for "none")."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name) if name else self.compressor)

    def bare_compressor(self, name: str):
        """The compression operator ``name`` with the run's knobs, without error feedback."""
        from ..compress import build_compressor
        return build_compressor(dataclasses.replace(self.compressor, name=name), error_feedback=False)


def check_agreed(comm: Comm, op: str, signature: str, count: int, what: str = "parameters",
                 mine: str = "") -> None:
    """Check once that every rank of ``comm`` holds the layout ``signature`` of its ``what``
    (``count`` parts): a rank that differs is a CommError ``op`` on every rank, naming the
    ranks (and ``mine``: this rank's layout)."""
    bad = comm.disagreeing(signature, count)
    if bad:
        raise CommError(op, comm.rank, f"ranks {bad} hold differently named or shaped {what} "
                        f"than rank 0{f' (this rank: {mine})' if mine else ''}")


def agreed_dup(comm: Comm, op: str, signature: str, count: int, ledger=None, what: str = "parameters",
               mine: str = "") -> Comm:
    """A duplicate of ``comm`` for a method's fixed-layout traffic (``ledger``: its own, else
    ``comm``'s), after checking once that every rank holds the layout ``signature`` of its
    ``what`` (``count`` parts, :func:`check_agreed`); then no per-call agreement check."""
    out = comm.dup(ledger)
    check_agreed(out, op, signature, count, what, mine)
    out.validate = False
    return out


#: the key of a method's ``state_dict()`` that says whose state it is (see Strategy.state_dict)
STATE_TAG = "lowcomm"

_building = threading.local()      # > 0 while methods are built as parts of another method


@contextlib.contextmanager
def parts_of_one_method():
    """Methods built inside the block are parts of one method (an outer loop's dense warm-up,
    the levels of a per-level policy) and share its torch optimizer: the check that a torch
    optimizer is wrapped by one live method at a time is left to the method they make up
    (:meth:`Strategy.claim`)."""
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1


def adopt(state: dict) -> dict:
    """``state`` (a method's ``state_dict()``, nested ones included) without the rank it was
    saved on, so that another rank may load it on purpose: a merged checkpoint of another rank
    count, a donor's state handed to a rejoining datacenter."""
    out = {k: adopt(v) if isinstance(v, dict) else v for k, v in state.items()}
    if isinstance(out.get(STATE_TAG), dict):
        out[STATE_TAG] = {k: v for k, v in out[STATE_TAG].items() if k not in ("rank", "world")}
    return out


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
    and ``lowcomm compare``'s data-parallel list leave it to its own tests).

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
    python: str = ""
    optimizer: str = ""
    example: str = ""
    compare: tuple[str, ...] = ()
    compare_name: str = ""


def balance(sizes: list[int], bins: int) -> list[int]:
    """Greedy size balancing (LPT, Graham 1969): largest item first onto the least-loaded bin
    (ties: the lowest bin). Returns the bin of each item."""
    load = [0] * bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        out[i] = b
        load[b] += sizes[i]
    return out


class BackwardPasses:
    """When a method that exchanges gradients during backward does so (torch DDP's semantics).

    The exchange ``exchange()`` runs at the end of every ``per_step``-th backward pass (queued
    on autograd's engine from the first gradient hook of the pass), so ``p.grad`` holds the
    exchanged gradients when ``backward()`` returns. Passes inside :meth:`no_sync` accumulate
    locally and do not count; :meth:`before_step` exchanges what they left."""

    def __init__(self, per_step: int, exchange: Callable[[], None]):
        self.per_step, self._exchange = per_step, exchange
        self.done = 0            # counted passes since the last exchange
        self.sync = True         # False inside no_sync()
        self.local = False       # gradients accumulated since the last exchange
        self._queued = False

    def exchanging(self) -> bool:
        """From a gradient hook: whether this pass ends with the exchange (so its gradients
        may be sent as they come)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return self.sync and self.done == self.per_step - 1

    def _end(self) -> None:
        self._queued = False
        self.local = True
        if self.sync:
            self.done += 1
            if self.done == self.per_step:
                self.done, self.local = 0, False
                self._exchange()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients only."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def before_step(self) -> None:
        """Before a step (or skip): exchange gradients left by passes under :meth:`no_sync`;
        a step in the middle of N counted passes is an error."""
        if self.done:
            raise LowcommError(f"step() after {self.done} of {self.per_step} backward passes; set "
                               "backward_passes_per_step to the number of backward() calls per "
                               "step, or accumulate inside no_sync()")
        if self.local:
            self.local = False
            self._exchange()


# torch's GradScaler warns on every step that it will stop passing itself to optimizers that
# handle scaling themselves; lowcomm's methods need it (to agree on a skipped step across ranks
# and to record that agreement where the scaler's update() reads it), and torch is pinned.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


class Role(enum.Enum):
    """What a rank does under its method: trains (a plain method), or is a parameter server's
    worker or server."""
    PLAIN = "plain"
    WORKER = "worker"
    SERVER = "server"


def _settings_text(settings: dict | None) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in (settings or {}).items()) or "no settings"


class Strategy(torch.optim.Optimizer):
    """A method as a torch optimizer: wraps ``optimizer``, sharing its ``param_groups``, ``state``
    and ``defaults``; ``zero_grad()``, ``backward()``, ``step()`` keep their meaning.

    Subclasses add communication in :meth:`_step` (and, for data parallelism, in the backward
    pass). State that must survive a restart goes in :meth:`state_dict` (never a Comm).

    What every method guarantees:

    * LR schedulers (``LambdaLR(method, ...)``) set ``param_groups[i]["lr"]``, which *is* the
      wrapped optimizer's;
    * the wrapped optimizer's ``step()`` called directly raises an error naming the method (it
      would skip the method's communication);
    * a ``torch.amp.GradScaler`` passes itself to :meth:`step`: the gradients are unscaled once,
      and a step with non-finite gradients is skipped — by every rank together where the ranks'
      gradients meet every step (:attr:`lockstep`), else by that rank alone, keeping the
      method's schedule;
    * :meth:`finish` (or leaving a ``with`` block) ends it: threads and hooks released, the same
      model — parameters and buffers — on every rank.
    """

    name = "strategy"
    #: a skipped step (AMP) must be agreed by every rank: their gradients meet every step
    lockstep = False
    #: the settings dataclass whose fields the constructor also takes as keyword arguments
    Settings = None
    #: the method's state differs between ranks (a rank must load its own, see state_dict)
    per_rank_state = True
    #: the method exchanges gradients as dense tensors (sparse ones are refused at build)
    dense_gradients = False
    #: parameters frozen at build and unfrozen later (progressive unfreezing) are exchanged
    #: from then on: the method's members are :meth:`members` (else :meth:`step` refuses them)
    unfreezes = False
    _step_supports_amp_scaling = True

    # declared capabilities: what the loop, the fleet, snapshots and integrations ask of a method
    #: what this rank does (a parameter server's ranks serve or work)
    role = Role.PLAIN
    #: gradients and optimizer state are sharded over the ranks, as ZeRO does; it clips them itself
    sharded = False
    #: the model is split over the ranks, by FSDP here or below or a pipeline's stages; its
    #: model_state_dict() holds this rank's part
    shards_model = False
    #: the ranks of one unit hold different parts of the model (a pipeline's stages)
    splits_model = False
    #: the model's forward is a collective, as FSDP's (it gathers the parameters)
    collective_forward = False
    #: dense steps before the method's first period, an outer loop's warm-up
    warmup_steps = 0
    #: inner steps a round is in flight before it is applied; 0 where rounds block
    delay = 0
    #: seconds the steps waited for rounds in flight
    wait_s = 0.0

    def model_state_dict(self) -> dict:
        """The model's state as this rank keeps it (a sharding method: this rank's shards)."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Load a :meth:`model_state_dict` into the model."""
        self.model.load_state_dict(state)

    def full_model_state_dict(self) -> dict:
        """The whole model's state (collective where the parameters are sharded)."""
        return self.model_state_dict()

    def local_shards(self) -> dict[str, torch.Tensor] | None:
        """This rank's chunk of every parameter where the method itself shards them; else None."""
        return None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type,
                                              error_if_nonfinite)

    def clips_itself(self) -> bool:
        """Whether :meth:`clip_grad_norm_` is the method's own norm (ZeRO's ranges, a pipeline's
        stages), where torch's over the model's parameters would see part of it."""
        return type(self).clip_grad_norm_ is not Strategy.clip_grad_norm_

    def joined(self) -> None:
        """A rejoining fleet member took a donor's state: continue from the live outer state."""

    def drain(self) -> None:
        """Wait for the rounds in flight (each is still applied at its step)."""

    def landed(self, step: int) -> int:
        """The last inner step whose rounds have landed on every member, the loop at ``step``."""
        return step

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for public, own in (("step", "_step"), ("finish", "_finish"), ("close", "_close"),
                            ("state_dict", "_state_dict"), ("load_state_dict", "_load_state_dict")):
            if public in cls.__dict__:
                raise TypeError(f"{cls.__name__} overrides {public}(); override {own}() instead "
                                f"(Strategy.{public}() keeps the optimizer contract around it)")
        init = cls.__dict__.get("__init__")
        if init is not None:
            @functools.wraps(init)
            def building(self, *args, **kwargs):
                try:
                    init(self, *args, **kwargs)
                except BaseException:
                    self._abandon()
                    raise
            cls.__init__ = building

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, Strategy):
            raise TypeError(f"optimizer is a lowcomm method already ({type(optimizer).__name__}); "
                            "wrap the plain torch optimizer")
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.model, self.optimizer = model, optimizer
        self._share(optimizer)
        self.comm = comm or init()
        self._stepping = 0                 # > 0 while this method's own step() runs
        self._closed = False
        self._votes: Comm | None = None  # AMP skip votes (lockstep methods), made on first use
        self._fix_parameters()
        if self.dense_gradients:
            self._refuse_sparse_gradients()
        if not getattr(_building, "depth", 0):
            self.claim()
        check_agreed(self.comm, f"{self.name}.layout", repr(self._built_layout),
                     len(self._built_layout), mine=f"{len(self._built_layout)} parameters")
        self._guard = optimizer.register_step_pre_hook(self._direct_step)

    # what the method was built for ------------------------------------------------------------
    def _fix_parameters(self) -> None:
        """Record the parameters this method was built for: every parameter of the torch
        optimizer must be one of the model's (else it would differ across ranks), and
        :meth:`step` later refuses parameters added to the optimizer since, and those unfrozen
        since unless the method :attr:`unfreezes` (they would not be exchanged). Also the layout every rank must hold (checked once). A method
        that rearranges the optimizer's groups itself calls this again afterwards."""
        self._built_names = {id(p): n for n, p in self.model.named_parameters()}
        groups = self.optimizer.param_groups
        ranges = getattr(self.optimizer, "lowcomm_ranges", {})   # a sharding level's (ZeRO)
        for i, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in self._built_names and id(p) not in ranges:
                    raise LowcommError(
                        f"the optimizer's param group {i} holds a tensor of shape {tuple(p.shape)} "
                        f"that is not a parameter of the model: lowcomm's {self.name} exchanges the "
                        "model's parameters, so this one would differ across ranks; make it a "
                        "parameter of the model (an nn.Parameter of a module) or leave it out of "
                        "the optimizer")
        self._built_counts = [len(g["params"]) for g in groups]
        self._built_ids = {id(p) for g in groups for p in g["params"]}
        self._built_frozen = [(self._built_names[id(p)], p) for g in groups for p in g["params"]
                              if not p.requires_grad and id(p) in self._built_names]
        self._built_layout = self._parameter_layout()

    def _parameter_layout(self) -> list[tuple]:
        """(name, shape, dtype, device, requires_grad) of every parameter; one another pipeline
        stage holds (on the meta device here) counts as on the model's device."""
        home = next((p.device.type for p in self.model.parameters() if not p.is_meta), "meta")
        return [(n, tuple(p.shape), str(p.dtype), home if p.is_meta else p.device.type,
                 p.requires_grad) for n, p in self.model.named_parameters()]

    def members(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a method that :attr:`unfreezes` exchanges, in the model's order: the
        model's that train now, and the frozen ones (``requires_grad=False``) the torch optimizer
        holds, which a user may unfreeze later (progressive unfreezing). A frozen member never
        gets a gradient, so the optimizer leaves it alone until it is unfrozen."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or id(p) in held]

    def _refuse_sparse_gradients(self) -> None:
        """A module that makes sparse gradients (``nn.Embedding(sparse=True)``,
        ``nn.EmbeddingBag(sparse=True)``) is refused, naming its parameter."""
        for mod_name, m in self.model.named_modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                self.sparse_gradient(f"{mod_name}.weight" if mod_name else "weight")

    def sparse_gradient(self, name: str):
        """Raise: parameter ``name`` has (or will have) a sparse gradient."""
        raise LowcommError(f"parameter {name!r} gets sparse gradients (e.g. nn.Embedding(sparse="
                           f"True)), which lowcomm's {self.name} does not support: it exchanges "
                           "gradients as dense tensors; use sparse=False")

    def _check_parameters(self) -> None:
        """Before each step: no parameter added to the optimizer, and none unfrozen unless the
        method :attr:`unfreezes`, since the method was built (each would go unexchanged and
        differ across ranks)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._built_counts) or any(len(g["params"]) != n
                                                      for g, n in zip(groups, self._built_counts)):
            new = [p for g in groups for p in g["params"] if id(p) not in self._built_ids]
            what = ", ".join(f"parameter {self._built_names[id(p)]!r}" if id(p) in self._built_names
                             else f"a tensor of shape {tuple(p.shape)} (not a parameter of the model)"
                             for p in new) or "a parameter"
            raise LowcommError(
                f"{what} added to the optimizer (add_param_group) after lowcomm's "
                f"{self.name} was built: the method exchanges the parameters it was built for, so "
                "these would differ across ranks; add it before building the method, or "
                "finish() the method and build a new one on the optimizer")
        for name, p in () if self.unfreezes else self._built_frozen:
            if p.grad is not None:
                raise LowcommError(
                    f"parameter {name!r} was frozen (requires_grad=False) when lowcomm's "
                    f"{self.name} was built and has a gradient now: this method exchanges the "
                    "parameters that trained when it was built, so this one would differ across "
                    "ranks; to unfreeze during training, finish() the method and build a new one "
                    "on the optimizer after unfreezing (syncdp, localsgd, diloco, "
                    "streaming-diloco and gossip take unfrozen parameters in as they are)")

    def _changed(self) -> str | None:
        """What changed in the model's parameters since the method was built (dtype, device,
        shape: e.g. ``model.to(torch.bfloat16)``), for a clear error; None if nothing."""
        now = self._parameter_layout()
        for was, new in zip(self._built_layout, now):
            if was[:4] != new[:4]:
                return (f"parameter {was[0]!r} changed from {was[2]} {was[1]} on {was[3]} to "
                        f"{new[2]} {new[1]} on {new[3]} after lowcomm's {self.name} was built "
                        "(e.g. model.to(...)): the method's buffers are laid out for the "
                        "parameters as they were; move or cast the model before building the "
                        "method")
        if len(now) != len(self._built_layout):
            return (f"the model has {len(now)} parameters now, {len(self._built_layout)} when lowcomm's "
                    f"{self.name} was built: build the method on the finished model")
        return None

    def _abandon(self) -> None:
        """A build that failed leaves the torch optimizer as it found it: no guard on its
        step(), not claimed (so another method may be built on it)."""
        guard = self.__dict__.get("_guard")
        if guard is not None:
            guard.remove()
        optimizer = self.__dict__.get("optimizer")
        ref = getattr(optimizer, "_lowcomm_method", None)
        if ref is not None and ref() is self:
            del optimizer._lowcomm_method
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether the method has ended (:meth:`finish` or :meth:`close`)."""
        return self._closed

    def claim(self) -> None:
        """Make this method the one live method wrapping its torch optimizer: refused while
        another one (not finished or closed) wraps it. Methods built as parts of one method
        (:func:`parts_of_one_method`) leave it to that one."""
        ref = getattr(self.optimizer, "_lowcomm_method", None)
        other = ref() if ref is not None else None
        if other is not None and other is not self and not other._closed:
            raise LowcommError(
                f"the {type(self.optimizer).__name__} optimizer is wrapped by lowcomm's "
                f"{type(other).__name__} ({other.name}) already: a torch optimizer takes one "
                "method at a time; finish() or close() that one first, or build this one on a "
                "new torch optimizer")
        self.optimizer._lowcomm_method = weakref.ref(self)

    @classmethod
    def settings_from(cls, options: dict, **defaults):
        """Validated :attr:`Settings` from Python keyword arguments (``defaults`` under them):
        a wrong one raises :class:`~lowcomm.errors.ArgumentError` naming it — the same checks
        as a config's (:meth:`~lowcomm.settings.Settings.validate`), made once."""
        return cls.Settings.from_options({**defaults, **options}, "", cls.name)

    def _share(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on this object's ``param_groups``, ``state`` and ``defaults`` are
        ``optimizer``'s — read through, so they stay its own even after its
        ``load_state_dict`` replaces them (accelerate does that when it prepares an optimizer)."""
        self.__dict__["_shared"] = optimizer

    def _shared_attr(name: str):
        def get(self):
            shared = self.__dict__.get("_shared")
            return getattr(shared, name) if shared is not None else self.__dict__["_own_" + name]

        def set_(self, value):       # torch.optim.Optimizer.__init__ sets them before sharing
            if self.__dict__.get("_shared") is not None:
                setattr(self.__dict__["_shared"], name, value)
            else:
                self.__dict__["_own_" + name] = value
        return property(get, set_)

    param_groups = _shared_attr("param_groups")
    state = _shared_attr("state")
    defaults = _shared_attr("defaults")
    del _shared_attr

    def add_param_group(self, param_group: dict) -> None:
        if "optimizer" not in self.__dict__:             # torch.optim.Optimizer.__init__
            return super().add_param_group(param_group)
        raise TypeError(f"{type(self).__name__} fixed its parameters when it was built (its "
                        "buffers and messages are laid out for them); add the group to the torch "
                        "optimizer before wrapping it")

    def release_guard(self) -> None:
        """Stop refusing direct steps of the wrapped optimizer: a method that drives this one
        (an outer loop over its warm-up or its level below) guards it instead."""
        self._guard.remove()

    def _direct_step(self, optimizer, args, kwargs):
        if not self._stepping:
            cls = type(self).__name__
            raise LowcommError(
                f"{type(optimizer).__name__}.step() was called directly, but it is wrapped by "
                f"lowcomm's {cls} ({self.name}), whose communication it would skip: call step() "
                f"on the {cls} object, and give that object to LR schedulers, GradScaler and "
                "the Trainer in place of the optimizer")

    @contextlib.contextmanager
    def _own_step(self):
        self._stepping += 1
        try:
            yield
        finally:
            self._stepping -= 1

    # the optimizer interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None, grad_scaler=None):
        """The wrapped optimizer's step with the method's communication around it. Given a
        ``grad_scaler`` (``torch.amp.GradScaler.step(method)`` passes itself), the gradients
        are unscaled first and a step whose gradients are not finite is skipped."""
        if self._closed:
            raise LowcommError(f"{type(self).__name__}.step() after finish()/close(): the method "
                               "has ended")
        self._check_parameters()
        with self._own_step():
            try:
                if grad_scaler is not None and self._amp_skips(grad_scaler):
                    self._skip_step()
                    return None
                return self._step(closure)
            except (RuntimeError, TypeError, ValueError) as e:   # torch's, on a changed model
                changed = self._changed()
                if changed is not None:
                    raise LowcommError(changed) from e
                raise

    def _step(self, closure=None):
        """One step of the method (subclasses add their communication)."""
        return self.optimizer.step(closure)

    def forward_backward(self, loss_fn: Callable, batch, before_backward: Callable | None = None):
        """One forward and backward pass of this rank's ``batch``: ``loss = loss_fn(model,
        batch)`` (``before_backward(loss)`` where given), ``loss.backward()``; returns the loss.
        A method that splits the model runs its schedule here (pipeline parallelism)."""
        loss = loss_fn(self.model, batch)
        if before_backward is not None:
            before_backward(loss)
        loss.backward()
        return loss

    def evaluate(self, loss_fn: Callable, batch) -> float:
        """The held-out loss of ``batch``: ``loss_fn(model, batch)`` (a method that splits the
        model runs its forward passes here)."""
        return float(loss_fn(self.model, batch).item())

    def batch_place(self) -> tuple[int, int]:
        """This rank's place among the step's batches: (index, count) — its rank and the ranks'
        count; the stages of one pipeline share one batch."""
        return self.comm.rank, self.comm.size

    def takes_step(self) -> bool:
        """Whether this rank computes the next step (forward, backward, :meth:`step`); False
        where the method passes over it (dynamic local updates: a slower member takes fewer
        of a period's steps). Call :meth:`pass_step` instead of computing such a step."""
        return True

    def pass_step(self) -> None:
        """Go past a step this rank does not compute (:meth:`takes_step` is False): the
        method's schedule moves on, nothing is computed or sent except at a period's end."""
        raise LowcommError(f"{type(self).__name__} computes every step: pass_step() is for a "
                           "step that takes_step() says this rank passes over")

    def skip(self) -> None:
        """Abandon this step on every rank (all ranks call it together): finish whatever
        communication is in flight, discard the gradients, leave parameters as they are."""
        self.zero_grad()

    def _skip_step(self) -> None:
        """A step skipped for non-finite gradients under AMP: every rank together where
        :attr:`lockstep` (:meth:`skip`); else this rank only, which must keep the method's
        schedule with the others (methods with local steps override this)."""
        self.skip()

    def _amp_skips(self, scaler) -> bool:
        """Unscale the gradients (once per step) and decide whether to skip this step: the
        scaler's verdict on this rank, or — where :attr:`lockstep` — on any rank (a vote). The
        decision is written where ``scaler.update()`` reads it, so the scale moves alike on
        every rank that voted."""
        from torch.amp.grad_scaler import OptState
        st = scaler._per_optimizer_states[id(self)]
        if st["stage"] is OptState.READY:
            scaler.unscale_(self)
        found = any(bool(v.item()) for v in st["found_inf_per_device"].values()) or \
            self.local_nonfinite() is not None
        if self.lockstep:
            found = self._vote(found)
        for v in st["found_inf_per_device"].values():
            v.fill_(1.0 if found else 0.0)
        return found

    def _vote(self, mine: bool) -> bool:
        """Whether any rank of this method says yes (one 4-byte all-reduce, charged)."""
        if self.comm.size == 1:
            return mine
        if self._votes is None:
            self._votes = self.comm.dup()
        flag = torch.tensor([1.0 if mine else 0.0])
        self._votes.allreduce_(flag, "sum")
        return bool(flag.item() > 0)

    def local_nonfinite(self) -> str | None:
        """What was non-finite in this rank's own gradients before the method exchanged them
        (e.g. ``"the gradient of 'w'"``), for methods that average gradients during backward
        (their ``p.grad`` then holds the average, with nothing non-finite sent); else None."""
        return None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients (torch DDP's ``no_sync``):
        the next backward outside the block exchanges them. A no-op for methods that exchange
        nothing during backward."""
        yield

    def state_dict(self) -> dict:
        """The method's state (:meth:`_state_dict`: the wrapped optimizer's and the method's own)
        and, under ``"lowcomm"``, whose it is: the method's name and settings, and where the
        state differs between ranks (:attr:`per_rank_state`: local models, error feedback,
        per-rank optimizer state) the rank and world size that saved it. Such a state is
        one rank's: every rank saves its own and loads it back (:meth:`load_state_dict` refuses
        another rank's; :func:`adopt` takes one on purpose)."""
        state = self._state_dict()
        state[STATE_TAG] = self._whose()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of this method: refused, naming both, when it was saved by
        another method or other settings, or (per-rank state) by another rank or world size."""
        tag = state.get(STATE_TAG) if isinstance(state, dict) else None
        if tag is not None:
            self._check_whose(tag)
            state = {k: v for k, v in state.items() if k != STATE_TAG}
        self._load_state_dict(state)

    def _settings(self) -> dict:
        s = getattr(self, "settings", None)
        return dataclasses.asdict(s) if dataclasses.is_dataclass(s) else {}

    def _whose(self) -> dict:
        tag = {"method": self.name, "settings": self._settings()}
        if self.per_rank_state:
            tag.update(rank=self.comm.rank, world=self.comm.size)
        return tag

    def _check_whose(self, tag: dict) -> None:
        mine = self._whose()
        if tag.get("method") != self.name:
            raise LowcommError(
                f"load_state_dict: the state was saved by {tag.get('method')} "
                f"({_settings_text(tag.get('settings'))}), this method is {self.name} "
                f"({_settings_text(mine['settings'])}): build {tag.get('method')} with those "
                "settings to resume it")
        theirs = tag.get("settings") or {}
        differ = {k: (theirs.get(k), v) for k, v in mine["settings"].items()
                  if k in theirs and theirs[k] != v}
        if differ:
            raise LowcommError(
                f"load_state_dict: the state was saved by {self.name} with "
                f"{_settings_text({k: a for k, (a, _) in differ.items()})}, this {self.name} has "
                f"{_settings_text({k: b for k, (_, b) in differ.items()})}: build it with the "
                "saved settings to resume")
        if self.per_rank_state and "rank" in tag and \
                (tag["rank"], tag["world"]) != (self.comm.rank, self.comm.size):
            raise LowcommError(
                f"load_state_dict: rank {self.comm.rank} of {self.comm.size} was given the state "
                f"that rank {tag['rank']} of {tag['world']} saved, but {self.name}'s state differs "
                "between ranks: each rank loads the state_dict() it saved itself (rank 0's on "
                "every rank, torch DDP's habit, resumes the others inexactly), e.g. "
                "torch.save(method.state_dict(), f\"method-rank{rank}.pt\") on every rank; "
                "lowcomm.adopt(state) takes another rank's on purpose")

    def _state_dict(self) -> dict:
        """The state that must survive a restart (subclasses add theirs; never a Comm)."""
        return {"optimizer": self.optimizer.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks: from ``old``, every old rank's checkpoint state
        (``{"model": ..., "strategy": ...}``, in old rank order), return this rank's
        ``{"model": model state dict, "strategy": state for load_state_dict}`` in the new world
        (``self.comm``); it may add ``"loop"`` and ``"rng"`` (the loop's counters and the RNG
        states to continue from; default: old rank ``rank mod K_old``'s). Called on every new
        rank with the same ``old``.

        Default: the state is replicated, so rank 0's copy carries over (checked equal on every
        old rank, see :func:`~lowcomm.strategies.reshard.replicated`). Strategies with per-rank
        state merge it by their own rule; one that cannot be resized raises a
        :class:`~lowcomm.errors.LowcommError` saying why."""
        from .reshard import replicated
        return replicated(old, self.name)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors the method holds beside the model's and its optimizer's, by kind ("param",
        "grad", "state"), for the memory a run reports (:mod:`lowcomm.run.memory`)."""
        return {}

    def parameters_changed(self) -> None:
        """The model's parameters were set from outside the method (an outer loop above it
        merged a synchronisation): a method keeping its own copy of them refreshes it."""

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """Extra fields for a log line of metrics.jsonl, or (``final``, after :meth:`close`)
        for summary.json; e.g. consensus distance. Called on every rank together; reduce over
        ``ctl``, the uncharged control communicator."""
        return {}

    # the end ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """End the method on every rank together: :meth:`close`, then leave on every rank the
        model the run delivers (e.g. the average of the ranks' local models, buffers included),
        identical on every rank. Traffic is charged to the method."""
        self.close()
        self._finish()

    def _finish(self) -> None:
        """Deliver one model on every rank (after :meth:`close`); subclasses say how."""

    def close(self) -> None:
        """Release threads and hooks (idempotent); the method cannot step afterwards. Use
        :meth:`finish` to end a run: it closes and delivers one model."""
        if self._closed:
            return
        self._closed = True
        self._guard.remove()
        self._close()

    def _close(self) -> None:
        """Subclasses release their threads and hooks here."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.close()


class LocalSteps(Strategy):
    """A method whose ranks step the wrapped optimizer on their own gradients and then
    communicate on the method's schedule (:meth:`_advance`, after every step): SPARTA, DES-LOC,
    NoLoCo. A step one rank skips under AMP drops its update only; the schedule goes on with
    the other ranks."""

    #: keys of the strategy state holding per-rank tensor lists that a resize averages
    averaged_state: tuple[str, ...] = ()

    def _step(self, closure=None):
        loss = self.optimizer.step(closure)
        self._advance()
        return loss

    def _skip_step(self) -> None:
        self.zero_grad()
        self._advance()

    def _advance(self) -> None:
        """After the step (or the skipped one): count it and communicate what is due."""
        raise NotImplementedError

    def reshard(self, old: list[dict]) -> dict:
        """The old ranks' models, buffers, optimizer state (momentum, Adam moments) and the
        tensors of :attr:`averaged_state` are averaged; the step counter ``t`` (every old rank's)
        and the rest of the state are rank 0's
        (:func:`~lowcomm.strategies.reshard.local_replicas`)."""
        from .reshard import local_replicas
        return local_replicas(old, self.name, self.averaged_state)
