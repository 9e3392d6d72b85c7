"""A split model's parts joined by name: each rank's keys of the model, the whole model gathered
from them, and a resume on another split.

Each old rank of a pipeline (``pp``) or an expert-parallel level (``ep``) saved the model keys it
held and its optimizer's state with the names of the parameters in its groups. On another
split (P → P' stages, or R → R' expert ranks): the model is the union of the old ranks' keys
(a key several ranks held, a replicated one, is the first rank's); each parameter's optimizer
state is that of the first old rank that held it, matched by name; the param groups' settings
are old rank 0's."""
from __future__ import annotations

import torch

from ..errors import LowcommError


def by_name(old: list[dict], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's ``{"model": ..., "strategy": {"optimizer": ..., "names": ...}}`` from every
    old rank's checkpoint state ``old`` (in old rank order), for the parameters ``optimizer``
    holds now (module docstring)."""
    model_state: dict = {}
    states: dict = {}
    for o in old:
        model_state.update({k: v for k, v in o["model"].items() if k not in model_state})
        opt, names = o["strategy"]["optimizer"], o["strategy"]["names"]
        for i, n in enumerate(names):
            if i in opt["state"] and n not in states:
                states[n] = opt["state"][i]
    template = old[0]["strategy"]["optimizer"]["param_groups"]
    if len(template) != len(optimizer.param_groups):
        raise LowcommError(f"the checkpoint's optimizer has {len(template)} param groups, "
                           f"this one {len(optimizer.param_groups)}")
    names = {id(p): n for n, p in model.named_parameters()}
    groups, state, mine, i = [], {}, [], 0
    for g, t in zip(optimizer.param_groups, template):
        ids = []
        for p in g["params"]:
            if names[id(p)] in states:
                state[i] = states[names[id(p)]]
            ids.append(i)
            mine.append(names[id(p)])
            i += 1
        groups.append({**{k: v for k, v in t.items() if k != "params"}, "params": ids})
    return {"model": model_state,
            "strategy": {"optimizer": {"state": state, "param_groups": groups}, "names": mine}}


class OwnedKeys:
    """The model state of a method whose rank holds some of the model's state-dict keys
    (``self._owned``: a pipeline's stages, an expert-parallel rank's experts and the dense
    part), over ``self.model`` and ``self.comm``: a mixin of those methods."""

    def model_state_dict(self) -> dict:
        """The model's state as this rank holds it: its keys only."""
        return {k: v for k, v in self.model.state_dict().items() if k in self._owned}

    def full_model_state_dict(self) -> dict:
        """The whole model's state dict on rank 0, {} elsewhere; collective."""
        full = self._gather()
        return full if self.comm.rank == 0 else {}

    def _gather(self) -> dict:
        """The whole model's state from every rank's keys (a key several ranks hold is the
        first rank's), in the model's order; collective."""
        parts = self.comm.allgather_object({k: v.detach().cpu() for k, v in
                                            self.model_state_dict().items()})
        out: dict = {}
        for part in parts:
            for k, v in part.items():
                out.setdefault(k, v)
        return {k: out[k] for k in self.model.state_dict() if k in out}

    def _copy_owned(self, state: dict) -> None:
        """This rank's keys copied from ``state`` (its own, or a whole model's) into the model."""
        with torch.no_grad():
            for k, v in self.model.state_dict(keep_vars=True).items():
                if k in self._owned:
                    v.copy_(state[k])


def held_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters in ``optimizer``'s groups, in their order (what
    :func:`by_name` matches a resumed state by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


__all__ = ["OwnedKeys", "by_name", "held_names"]
