"""A model built on the meta device whose parts are materialised later with the values a whole
build gives: what lets a rank of a split model hold only its part, from the start.

:func:`build_deferred` runs the user's own ``build()`` (e.g. ``task.model(cfg)``) with its tensors made on
the meta device (as under ``torch.device("meta")``) — no parameter memory — while a torch function mode records, per tensor
storage, how it was made and every in-place operation on it (``normal_``, ``zeros_``,
``kaiming_uniform_``, ``mul_``, a ``copy_`` from another tensor, ...). Each random operation is
also run once on a scratch CPU tensor of the same layout, so the process's generator advances
exactly as in a whole build, and the generator's state before it is kept.
:meth:`Deferred.materialise` then gives chosen modules real storage (``to_empty``) and replays
their tensors' records — random operations from their recorded generator states — so each
tensor equals, bit for bit, the one a whole build under the same seed makes.

A build this cannot replay (an operation on a meta tensor whose result is neither a view nor a
new tensor, a non-tensor result read from a meta tensor's values, a random operation with a
generator that is not a CPU one) fails with a :class:`~lowcomm.errors.ConfigError` naming
``key`` (the setting that chose it: build the whole model instead).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError

#: in-place operations that draw from a generator (their advance is reproduced during the build)
RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
          "log_normal_", "cauchy_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_"}
#: factories that draw from a generator
RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like",
                    "randint_like", "bernoulli", "multinomial"}
#: methods whose name ends in ``_`` that change no value
NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "detach_", "resize_"}

_BUILT: "weakref.WeakKeyDictionary[nn.Module, Deferred]" = weakref.WeakKeyDictionary()


@dataclass
class _Event:
    """One recorded operation: ``func(*args, **kwargs)`` with meta tensors as :class:`_Ref`
    placeholders; ``target`` (in place) or None (the storage's creation); the generator's
    state before it (random operations)."""
    func: object
    args: tuple
    kwargs: dict
    target: "_Ref | None" = None
    rng: torch.Tensor | None = None


@dataclass(frozen=True)
class _Ref:
    """A meta tensor as an operation saw it: its storage's key, layout, and the event count then."""
    key: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    seq: int


@dataclass
class _Storage:
    nbytes: int
    dtype: torch.dtype
    events: list = field(default_factory=list)     # (seq, _Event), creation first


def _is_meta(t) -> bool:
    return torch.is_tensor(t) and t.is_meta


def _flat(args, kwargs) -> list:
    out = []
    for a in [*args, *kwargs.values()]:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


class _Recorder(TorchFunctionMode):
    """Records, per meta storage, its creation and in-place operations (module docstring)."""

    def __init__(self, key: str):
        super().__init__()
        self.key, self.seq, self.storages, self._alive = key, 0, {}, []
        self.scratch = _Scratch()

    def ref(self, t: torch.Tensor) -> _Ref:
        s = t.untyped_storage()
        k = s._cdata
        if k not in self.storages:
            raise ConfigError(self.key, f"a meta tensor of shape {tuple(t.shape)} that the build "
                              "did not make (made before it, or by an operation this cannot "
                              "replay) is used to initialise the model")
        return _Ref(k, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, self.seq)

    def _swap(self, args, kwargs):
        sub = lambda a: self.ref(a) if _is_meta(a) else a      # noqa: E731
        deep = lambda a: type(a)(sub(x) for x in a) if isinstance(a, (list, tuple)) else sub(a)  # noqa: E731
        return tuple(deep(a) for a in args), {k: deep(v) for k, v in kwargs.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not args and "tensor" in kwargs:         # torch.nn.init's functions, dispatched
            args = (kwargs.pop("tensor"),)
        name = getattr(func, "__name__", "")
        target = args[0] if args and _is_meta(args[0]) else None
        writes = target is not None and name not in NOT_WRITES and (
            name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))
        if writes:
            self._record_write(func, name, args, kwargs)
        out = func(*args, **_on_meta(func, args, kwargs))
        if not writes:
            self._record_new(func, name, args, kwargs, out)
        return out

    def _record_write(self, func, name, args, kwargs):
        rng = _advance(func, args, kwargs, self.key, self.scratch) if name in RANDOM else None
        a, kw = self._swap(args, kwargs)
        event = _Event(func, a[1:], kw, a[0], rng)
        self.storages[a[0].key].events.append((self.seq, event))
        self.seq += 1

    def _record_new(self, func, name, args, kwargs, out):
        outs = out if isinstance(out, (list, tuple)) else [out]
        metas = [o for o in outs if _is_meta(o)]
        if len(metas) != 1 or len(outs) != 1:
            return          # shapes, sizes, several outputs: views or values of no tensor made
        o = metas[0]
        k = o.untyped_storage()._cdata
        if k in self.storages:
            return          # a view of a recorded storage
        rng = _advance(func, args, kwargs, self.key, self.scratch) \
            if name in RANDOM_FACTORIES else None
        a, kw = self._swap(args, kwargs)
        self._alive.append(o.untyped_storage())     # keeps its key unique while recording
        self.storages[k] = _Storage(o.untyped_storage().nbytes(), o.dtype,
                                    [(self.seq, _Event(func, a, kw, None, rng))])
        self.seq += 1


def _on_meta(func, args, kwargs) -> dict:
    """A factory's keywords with ``device="meta"`` where it names no device (as
    ``torch.device("meta")`` does), except an empty ``torch.tensor([])``: a tensor of no
    elements holds nothing, and builders such as transformers' read its device to decide
    whether to initialise at all."""
    from torch.utils._device import _device_constructors
    if func not in _device_constructors() or kwargs.get("device") is not None:
        return kwargs
    empty = func is torch.tensor and args and isinstance(args[0], (list, tuple)) and not args[0]
    return {**kwargs, "device": "cpu" if empty else "meta"}


def _generator(kwargs, key: str) -> torch.Generator:
    g = kwargs.get("generator")
    if g is not None and g.device.type != "cpu":
        raise ConfigError(key, f"a random initialisation draws from a {g.device} generator; only "
                          "CPU generators can be replayed")
    return g if g is not None else torch.default_generator


class _Scratch:
    """One reused CPU buffer, grown to the largest tensor drawn into: a fresh tensor per draw
    would leave the heap fragmented by the small generator states kept between them (the
    process's resident set grew by the whole model's size, measured)."""

    def __init__(self):
        self.storage = torch.UntypedStorage(0)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        need = span * t.element_size()
        if self.storage.nbytes() < need:
            self.storage = torch.UntypedStorage(0)          # freed before the larger one
            self.storage = torch.UntypedStorage(need)
        return torch.empty(0, dtype=t.dtype).set_(self.storage, 0, t.shape, t.stride())


def _advance(func, args, kwargs, key: str, scratch: _Scratch) -> torch.Tensor:
    """Run random ``func`` once on ``scratch`` CPU memory (the generator advances as in a whole
    build); the generator's state before it."""
    g = _generator(kwargs, key)
    state = g.get_state()
    real = lambda t: scratch.like(t) if _is_meta(t) else t      # noqa: E731
    with torch.no_grad(), torch.device("cpu"):
        func(*[real(a) for a in args], **{k: real(v) for k, v in kwargs.items()})
    return state


class Deferred:
    """How a model built by :func:`build_deferred` was initialised: replays any of its tensors."""

    def __init__(self, storages: dict, key: str, device: torch.device):
        self.storages, self.key, self.device = storages, key, torch.device(device)

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """Meta tensor ``t``'s value at the end of the build (a CPU tensor)."""
        k = t.untyped_storage()._cdata
        if k not in self.storages:
            raise ConfigError(self.key, f"a tensor of shape {tuple(t.shape)} was not made by the "
                              "recorded build (it cannot be given the whole build's values)")
        base = self._storage(k, float("inf"), {})
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def _storage(self, k: int, upto: float, memo: dict) -> torch.Tensor:
        """Storage ``k`` as a flat tensor of its dtype after its events before ``upto``."""
        if (k, upto) in memo:
            return memo[(k, upto)]
        rec = self.storages[k]
        events = [e for s, e in rec.events if s < upto]
        made = self._run(events[0], memo)
        base = made.as_strided((rec.nbytes // made.element_size(),), (1,), 0) \
            if made.dim() else made.reshape(1)
        for e in events[1:]:
            t = e.target
            view = base.as_strided(t.size, t.stride, t.offset)
            self._run(e, memo, view)
        memo[(k, upto)] = base
        return base

    def _run(self, e: _Event, memo: dict, target: torch.Tensor | None = None):
        def real(a):
            if isinstance(a, _Ref):
                return self._storage(a.key, a.seq, memo).clone().as_strided(a.size, a.stride, a.offset)
            return type(a)(real(x) for x in a) if isinstance(a, (list, tuple)) else a
        args = tuple(real(a) for a in e.args)
        kwargs = {k: real(v) for k, v in e.kwargs.items()}
        g = _generator(kwargs, self.key)
        if e.rng is not None:
            g.set_state(e.rng)
        with torch.no_grad(), torch.device("cpu"):
            if target is None:
                return e.func(*args, **kwargs)
            return e.func(target, *args, **kwargs)

    def materialise(self, model: nn.Module, names: list[str]) -> None:
        """Give modules ``names`` of ``model`` real storage on this build's device, each tensor
        the value the whole build gives it (the same tensor objects: an optimizer holding them
        keeps them; a tensor two modules share, once)."""
        rng = torch.get_rng_state()
        try:
            values = {}
            for n in names:
                m = model.get_submodule(n)
                for t in (*m.parameters(), *m.buffers()):
                    if t.is_meta and id(t) not in values:
                        values[id(t)] = (t, self.value(t))
        finally:
            torch.set_rng_state(rng)
        for t, v in values.values():
            new = v.to(self.device)         # no second copy on the CPU
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            torch.utils.swap_tensors(t, new)


def build_deferred(build, key: str, device="cpu") -> nn.Module:
    """``build()`` on the meta device, recorded (module docstring); the model remembers its
    record (:func:`deferred_of`). ``key``: the setting named where the build cannot be
    recorded; ``device``: where materialised parts live."""
    recorder = _Recorder(key)
    try:
        with recorder:
            model = build()
    except ConfigError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        raise ConfigError(key, f"the model cannot be built on the meta device: "
                          f"{str(e).splitlines()[0][:200]}; build it whole on every rank "
                          "instead") from None
    recorder.scratch = None
    _BUILT[model] = Deferred(recorder.storages, key, device)
    return model


def deferred_of(model: nn.Module) -> Deferred | None:
    """The record of a model :func:`build_deferred` built, or None."""
    return _BUILT.get(model)


__all__ = ["Deferred", "build_deferred", "deferred_of"]
