"""The torch optimizer a method wraps: its attributes shared with the method, its own
``step()`` refused outside the method's, and one live method per optimizer."""
from __future__ import annotations

import contextlib
import threading
import weakref

from ..errors import LowcommError

_building = threading.local()      # > 0 while methods are built as parts of another method


@contextlib.contextmanager
def parts_of_one_method():
    """Methods built inside the block are parts of one method (an outer loop's dense warm-up,
    the levels of a per-level policy) and share its torch optimizer: the check that a torch
    optimizer is wrapped by one live method at a time is left to the method they make up
    (:meth:`OptimizerGuard.claim`)."""
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1


def building_parts() -> bool:
    """Whether the methods built now are parts of one method (:func:`parts_of_one_method`)."""
    return bool(getattr(_building, "depth", 0))


def shared_attr(name: str) -> property:
    """A method's ``name`` read through to the optimizer it shares (``_shared``), so that it
    stays the optimizer's even after its ``load_state_dict`` replaces it (accelerate does that
    when it prepares an optimizer); its own until it shares one."""
    def get(self):
        shared = self.__dict__.get("_shared")
        return getattr(shared, name) if shared is not None else self.__dict__["_own_" + name]

    def set_(self, value):       # torch.optim.Optimizer.__init__ sets them before sharing
        if self.__dict__.get("_shared") is not None:
            setattr(self.__dict__["_shared"], name, value)
        else:
            self.__dict__["_own_" + name] = value
    return property(get, set_)


class OptimizerGuard:
    """The wrapped optimizer's ``step()`` refused outside the method's own (it would skip the
    method's communication), until :meth:`release`; :meth:`own_step` marks the method's."""

    def __init__(self, method, optimizer):
        self.method, self.optimizer, self.stepping = method, optimizer, 0
        self._hook = optimizer.register_step_pre_hook(self._direct_step)

    def release(self) -> None:
        """Stop refusing direct steps: a method that drives this one (an outer loop over its
        warm-up or its level below) guards it instead, or the method has ended."""
        self._hook.remove()

    @contextlib.contextmanager
    def own_step(self):
        """The wrapped optimizer steps inside on the method's behalf."""
        self.stepping += 1
        try:
            yield
        finally:
            self.stepping -= 1

    def _direct_step(self, optimizer, args, kwargs):
        if not self.stepping:
            cls, name = type(self.method).__name__, self.method.name
            raise LowcommError(
                f"{type(optimizer).__name__}.step() was called directly, but it is wrapped by "
                f"lowcomm's {cls} ({name}), whose communication it would skip: call step() "
                f"on the {cls} object, and give that object to LR schedulers, GradScaler and "
                "the Trainer in place of the optimizer")


def claim(method, optimizer) -> None:
    """Make ``method`` the one live method wrapping ``optimizer``: refused while another one
    (not finished or closed) wraps it."""
    ref = getattr(optimizer, "_lowcomm_method", None)
    other = ref() if ref is not None else None
    if other is not None and other is not method and not other.closed:
        raise LowcommError(
            f"the {type(optimizer).__name__} optimizer is wrapped by lowcomm's "
            f"{type(other).__name__} ({other.name}) already: a torch optimizer takes one "
            "method at a time; finish() or close() that one first, or build this one on a "
            "new torch optimizer")
    optimizer._lowcomm_method = weakref.ref(method)


def unclaim(method, optimizer) -> None:
    """``optimizer`` is no longer claimed by ``method`` (a build that failed)."""
    ref = getattr(optimizer, "_lowcomm_method", None)
    if ref is not None and ref() is method:
        del optimizer._lowcomm_method
