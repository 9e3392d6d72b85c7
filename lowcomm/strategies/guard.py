"""The parameter guard: the parameters a method was built for, checked before every step.

A method lays out its buffers and messages for the parameters it was built on. Every parameter
of the torch optimizer must be one of the model's (else it would differ across ranks); a
parameter added to the optimizer since, or unfrozen since unless the method unfreezes, would go
unexchanged; a model cast or moved since would not fit the buffers. Each is a clear error."""
from __future__ import annotations

import torch

from ..errors import LowcommError


def sparse_gradient(method: str, name: str):
    """Raise: parameter ``name`` has (or will have) a sparse gradient, which ``method`` (a
    method exchanging dense tensors) does not support."""
    raise LowcommError(f"parameter {name!r} gets sparse gradients (e.g. nn.Embedding(sparse="
                       f"True)), which lowcomm's {method} does not support: it exchanges "
                       "gradients as dense tensors; use sparse=False")


def refuse_sparse_gradients(model: torch.nn.Module, method: str) -> None:
    """A module that makes sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``) is refused, naming its parameter."""
    for mod_name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            sparse_gradient(method, f"{mod_name}.weight" if mod_name else "weight")


def parameter_layout(model: torch.nn.Module) -> list[tuple]:
    """(name, shape, dtype, device, requires_grad) of every parameter; one another pipeline
    stage holds (on the meta device here) counts as on the model's device."""
    home = next((p.device.type for p in model.parameters() if not p.is_meta), "meta")
    return [(n, tuple(p.shape), str(p.dtype), home if p.is_meta else p.device.type,
             p.requires_grad) for n, p in model.named_parameters()]


class ParameterGuard:
    """What a method was built for: the model's parameters by id (``names``), the optimizer's
    group sizes (``counts``) and members (``ids``), its frozen members and the layout every
    rank must hold (``layout``). :meth:`fix` records them (again, for a method that rearranges
    the optimizer's groups itself); :meth:`check` refuses what changed before a step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: str,
                 unfreezes: bool):
        self.model, self.optimizer, self.method, self.unfreezes = model, optimizer, method, unfreezes
        self.fix()

    def fix(self) -> None:
        """Record the parameters the method is built for (each must be the model's)."""
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        groups = self.optimizer.param_groups
        ranges = getattr(self.optimizer, "lowcomm_ranges", {})   # a sharding level's (ZeRO)
        for i, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in self.names and id(p) not in ranges:
                    raise LowcommError(
                        f"the optimizer's param group {i} holds a tensor of shape {tuple(p.shape)} "
                        f"that is not a parameter of the model: lowcomm's {self.method} exchanges "
                        "the model's parameters, so this one would differ across ranks; make it a "
                        "parameter of the model (an nn.Parameter of a module) or leave it out of "
                        "the optimizer")
        self.counts = [len(g["params"]) for g in groups]
        self.ids = {id(p) for g in groups for p in g["params"]}
        self.frozen = [(self.names[id(p)], p) for g in groups for p in g["params"]
                       if not p.requires_grad and id(p) in self.names]
        self.layout = parameter_layout(self.model)

    def members(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a method that unfreezes exchanges, in the model's order: the model's
        that train now, and the frozen ones (``requires_grad=False``) the torch optimizer holds,
        which a user may unfreeze later (progressive unfreezing). A frozen member never gets a
        gradient, so the optimizer leaves it alone until it is unfrozen."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or id(p) in held]

    def check(self) -> None:
        """Before each step: no parameter added to the optimizer, and none unfrozen unless the
        method unfreezes, since the method was built (each would go unexchanged and differ
        across ranks)."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.counts) or any(len(g["params"]) != n
                                                  for g, n in zip(groups, self.counts)):
            self._added([p for g in groups for p in g["params"] if id(p) not in self.ids])
        for name, p in () if self.unfreezes else self.frozen:
            if p.grad is not None:
                raise LowcommError(
                    f"parameter {name!r} was frozen (requires_grad=False) when lowcomm's "
                    f"{self.method} was built and has a gradient now: this method exchanges the "
                    "parameters that trained when it was built, so this one would differ across "
                    "ranks; to unfreeze during training, finish() the method and build a new one "
                    "on the optimizer after unfreezing (syncdp, localsgd, diloco, "
                    "streaming-diloco and gossip take unfrozen parameters in as they are)")

    def _added(self, new: list[torch.Tensor]):
        what = ", ".join(f"parameter {self.names[id(p)]!r}" if id(p) in self.names
                         else f"a tensor of shape {tuple(p.shape)} (not a parameter of the model)"
                         for p in new) or "a parameter"
        raise LowcommError(
            f"{what} added to the optimizer (add_param_group) after lowcomm's "
            f"{self.method} was built: the method exchanges the parameters it was built for, so "
            "these would differ across ranks; add it before building the method, or "
            "finish() the method and build a new one on the optimizer")

    def changed(self) -> str | None:
        """What changed in the model's parameters since the method was built (dtype, device,
        shape: e.g. ``model.to(torch.bfloat16)``), for a clear error; None if nothing."""
        now = parameter_layout(self.model)
        for was, new in zip(self.layout, now):
            if was[:4] != new[:4]:
                return (f"parameter {was[0]!r} changed from {was[2]} {was[1]} on {was[3]} to "
                        f"{new[2]} {new[1]} on {new[3]} after lowcomm's {self.method} was built "
                        "(e.g. model.to(...)): the method's buffers are laid out for the "
                        "parameters as they were; move or cast the model before building the "
                        "method")
        if len(now) != len(self.layout):
            return (f"the model has {len(now)} parameters now, {len(self.layout)} when lowcomm's "
                    f"{self.method} was built: build the method on the finished model")
        return None
