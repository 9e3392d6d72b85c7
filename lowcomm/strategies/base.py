"""The shape every strategy shares: a ``torch.optim.Optimizer`` that wraps the user's optimizer.

A method *is* an optimizer (the design of Horovod's ``DistributedOptimizer``): it shares the
wrapped optimizer's ``param_groups``, ``state`` and ``defaults``, so torch's LR schedulers, AMP's
``GradScaler``, gradient clipping and frameworks that check ``isinstance(opt, Optimizer)`` (the
Hugging Face Trainer) drive it as they would the optimizer itself, while ``step()`` adds the
method's communication. The wrapped optimizer's own ``step()`` refuses to run outside the
method's, so a direct call can never skip the communication silently.

The small helpers the contract owns live beside it: the parameter guard
(:mod:`~lowcomm.strategies.guard`), the wrapped optimizer's guard
(:mod:`~lowcomm.strategies.wrapped`), the AMP vote (:mod:`~lowcomm.strategies.amp`) and the
state-ownership tags (:mod:`~lowcomm.strategies.ownership`). A strategy module also owns a
:class:`~lowcomm.settings.Settings` dataclass of its knobs and a builder, which it publishes as a
:class:`~lowcomm.strategies.method.Method`; :mod:`lowcomm.run.registry` maps names to methods.
See ``docs/extending.md`` for a method written from scratch.
"""
from __future__ import annotations

import functools

import torch

from ..comm.comm import Comm, init
from ..errors import LowcommError, refuse_moved
from .capabilities import Capabilities, Role  # noqa: F401 (Role: the contract's)
from .amp import AmpVote, amp_skips
from .guard import ParameterGuard, refuse_sparse_gradients
from .layout import check_agreed
from .ownership import STATE_TAG, check_tag, tag_of
from .wrapped import OptimizerGuard, building_parts, claim, shared_attr, unclaim


class Strategy(Capabilities, torch.optim.Optimizer):
    """A method as a torch optimizer: wraps ``optimizer``, sharing its ``param_groups``,
    ``state`` and ``defaults``; ``zero_grad()``, ``backward()``, ``step()`` keep their meaning.

    What a method overrides (everything else has a default that holds for it):

    * ``name``, ``Settings`` (its settings dataclass: the constructor resolves
      ``self.settings`` from ``settings=`` or from keyword arguments, once, before any MPI
      call) and ``__init__`` (call ``super().__init__(model, optimizer, comm, settings=...,
      **options)`` first, then read ``self.settings``);
    * :meth:`_step`: one step, the method's communication around ``self.optimizer.step()``;
    * :meth:`_state_dict` / :meth:`_load_state_dict`: the state that survives a restart;
    * :meth:`_finish` (one model on every rank at the end) and :meth:`_close` (threads, hooks);
    * where it applies: :meth:`skip`, :meth:`no_sync`, :meth:`reshard`, :meth:`metrics`,
      :meth:`memory_tensors`, ``lockstep``, ``per_rank_state``, and the capabilities the
      loop, the fleet, snapshots and integrations ask of a method, declared with their
      defaults on :class:`~lowcomm.strategies.capabilities.Capabilities` (``role``,
      ``sharded``, ``model_state_dict``, ``forward_backward``, ``batch_place``, ...).

    What every method guarantees: LR schedulers set ``param_groups[i]["lr"]``, which *is* the
    wrapped optimizer's; the wrapped optimizer's ``step()`` called directly raises an error
    naming the method; a ``torch.amp.GradScaler`` passes itself to :meth:`step`, the
    gradients are unscaled once and a step with non-finite gradients is skipped (by every rank
    together where :attr:`lockstep`, else by that rank alone, keeping the schedule);
    :meth:`finish` (or leaving a ``with`` block) ends it with the same model on every rank.
    """

    name = "strategy"
    #: the settings dataclass: ``settings=`` or the constructor's keyword arguments
    Settings = None
    #: keyword defaults under a Python caller's own (an outer loop's all-reduce: ``mpi``)
    option_defaults: dict = {}
    #: keywords the constructor took once, each with its new spelling (an error names it)
    moved: dict[str, str] = {}
    #: a skipped step (AMP) must be agreed by every rank: their gradients meet every step
    lockstep = False
    #: the method's state differs between ranks (a rank must load its own, see state_dict)
    per_rank_state = True
    #: the method exchanges gradients as dense tensors (sparse ones are refused at build)
    dense_gradients = False
    #: parameters frozen at build and unfrozen later are exchanged from then on
    #: (:meth:`~lowcomm.strategies.guard.ParameterGuard.members`; else step() refuses them)
    unfreezes = False
    _step_supports_amp_scaling = True

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
                 comm: Comm | None = None, *, settings=None, **options):
        self.settings = self._resolve(settings, options)       # before MPI: errors name the key
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
        self._closed = False
        self._votes = AmpVote()             # AMP skip votes (lockstep methods)
        self.built = ParameterGuard(model, optimizer, self.name, self.unfreezes)
        if self.dense_gradients:
            refuse_sparse_gradients(model, self.name)
        if not building_parts():            # parts of one method leave the claim to it
            claim(self, optimizer)
        layout = self.built.layout
        check_agreed(self.comm, f"{self.name}.layout", repr(layout), len(layout),
                     mine=f"{len(layout)} parameters")
        self.guard = OptimizerGuard(self, optimizer)
        try:
            self._setup(self.settings)
        except BaseException:               # (a subclass's own __init__ is wrapped alike)
            self._abandon()
            raise

    def _setup(self, s) -> None:
        """Set the method up from its resolved settings ``s``, last in the base constructor
        (``model``, ``optimizer``, ``comm`` and ``settings`` in place): a method whose constructor
        takes nothing beyond the base's arguments defines this instead of restating it. Nothing
        by default."""

    @classmethod
    def _resolve(cls, settings, options: dict):
        """``settings`` as given, or validated :attr:`Settings` from keyword arguments (under
        :attr:`option_defaults`): a wrong one raises an ArgumentError naming it (one that
        moved, :attr:`moved`, its new spelling too)."""
        refuse_moved(options, cls.moved, f"{cls.__name__}()")
        if settings is not None or cls.Settings is None:
            if options:
                raise TypeError(f"{cls.__name__}() got keyword arguments {sorted(options)} "
                                f"{'beside settings=' if settings is not None else 'it does not take'}")
            return settings
        return cls.Settings.from_options({**cls.option_defaults, **options}, "", cls.name)

    def _abandon(self) -> None:
        """A build that failed leaves the torch optimizer as it found it: no guard on its
        step(), not claimed (so another method may be built on it)."""
        if "guard" in self.__dict__:
            self.guard.release()
        if "optimizer" in self.__dict__:
            unclaim(self, self.optimizer)
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether the method has ended (:meth:`finish` or :meth:`close`)."""
        return self._closed

    def members(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a method that :attr:`unfreezes` exchanges, in the model's order."""
        return self.built.members()

    def _share(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on this object's ``param_groups``, ``state`` and ``defaults`` are
        ``optimizer``'s (read through: :func:`~lowcomm.strategies.wrapped.shared_attr`)."""
        self.__dict__["_shared"] = optimizer

    param_groups = shared_attr("param_groups")
    state = shared_attr("state")
    defaults = shared_attr("defaults")

    def add_param_group(self, param_group: dict) -> None:
        if "optimizer" not in self.__dict__:             # torch.optim.Optimizer.__init__
            return super().add_param_group(param_group)
        raise TypeError(f"{type(self).__name__} fixed its parameters when it was built (its "
                        "buffers and messages are laid out for them); add the group to the torch "
                        "optimizer before wrapping it")

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
        self.built.check()
        with self.guard.own_step():
            try:
                if grad_scaler is not None and amp_skips(self, grad_scaler):
                    self._skip_step()
                    return None
                return self._step(closure)
            except (RuntimeError, TypeError, ValueError) as e:   # torch's, on a changed model
                changed = self.built.changed()
                if changed is not None:
                    raise LowcommError(changed) from e
                raise

    def _step(self, closure=None):
        """One step of the method (subclasses add their communication)."""
        return self.optimizer.step(closure)

    def skip(self) -> None:
        """Abandon this step on every rank (all ranks call it together): finish whatever
        communication is in flight, discard the gradients, leave parameters as they are."""
        self.zero_grad()

    def _vote(self, mine: bool) -> bool:
        """Whether any rank of this method says yes (an AMP skip under :attr:`lockstep`)."""
        return self._votes(self.comm, mine)

    def _skip_step(self) -> None:
        """A step skipped for non-finite gradients under AMP: every rank together where
        :attr:`lockstep` (:meth:`skip`); methods with local steps keep their schedule instead."""
        self.skip()

    def state_dict(self) -> dict:
        """The method's state (:meth:`_state_dict`) and, under ``"lowcomm"``, whose it is
        (:func:`~lowcomm.strategies.ownership.tag_of`): per-rank state is one rank's, loaded
        back by that rank (:func:`~lowcomm.strategies.ownership.adopt` takes another's)."""
        state = self._state_dict()
        state[STATE_TAG] = tag_of(self)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of this method: refused, naming both, when it was saved by
        another method or other settings, or (per-rank state) by another rank or world size."""
        tag = state.get(STATE_TAG) if isinstance(state, dict) else None
        if tag is not None:
            check_tag(self, tag)
            state = {k: v for k, v in state.items() if k != STATE_TAG}
        self._load_state_dict(state)

    def _state_dict(self) -> dict:
        """The state that must survive a restart (subclasses add theirs; never a Comm)."""
        return {"optimizer": self.optimizer.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

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
        """Release threads and hooks (idempotent); the method cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        self.guard.release()
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
    NoLoCo, the outer loops. A step one rank skips under AMP drops its update only
    (:meth:`skip`); the schedule goes on with the other ranks."""

    #: keys of the strategy state holding per-rank tensor lists that a resize averages
    averaged_state: tuple[str, ...] = ()

    def _step(self, closure=None):
        loss = self._local_step(closure)
        self._advance()
        return loss

    def _local_step(self, closure=None):
        """This rank's step on its own gradients: the wrapped optimizer's."""
        return self.optimizer.step(closure)

    def _skip_step(self) -> None:
        self.skip()
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
