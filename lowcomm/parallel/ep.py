"""Expert parallelism (``ep``): the experts of every mixture-of-experts layer spread over the ranks
of a level, tokens moved to them and back by all-to-all (:mod:`lowcomm.parallel.experts`).

GShard (Lepikhin et al. 2020, arXiv 2006.16668) and Switch Transformer (Fedus et al. 2021, arXiv
2101.03961): rank r of the R ranks of the level holds the experts [r·E/R, (r+1)·E/R) of each
:class:`~lowcomm.parallel.experts.MoE` layer and a replica of everything else (attention, router,
embeddings: the *dense* part). The ranks take different batches, as data-parallel ranks do.

Per step, on every rank of the level:
  1. ``loss = loss_fn(model, batch)`` on this rank's batch and its backward; inside each MoE
     layer the kept assignments' rows go to their experts' ranks and back (``alltoall.dispatch``,
     ``alltoall.combine``; the backward the reverse, ``….grad``; ``alltoall.counts`` the row
     counts), so an expert's gradient is the sum over every rank's tokens routed to it;
  2. the dense part's gradients are averaged over the level (one all-reduce per dtype,
     ``allreduce``), an expert's divided by R: every parameter's gradient is then the mean over
     the level's ranks of their losses' gradients, g = (1/R) Σ_r ∇L_r, as data parallelism of
     the whole model gives;
  3. with data-parallel levels above (``policy.node=syncdp``), every gradient is averaged with
     the ranks holding the same experts in the other replicas (:mod:`lowcomm.parallel.replicas`);
  4. ``step()``: the wrapped optimizer updates the dense part and this rank's experts.

An outer loop above (``policy.dc=diloco``) keeps the outer state of this rank's part only (its
experts and the replicated dense part) and averages it with the same rank of the other units.
Each step's dropped assignments and tokens (over a layer's capacity) and its load-balancing loss
go into the run's metrics (:meth:`ExpertParallel.metrics`). :meth:`finish` gathers every rank's
experts: the whole model, the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.collectives import broadcast_
from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError
from ..settings import Settings
from ..strategies.base import Strategy
from .split import ReducedOnce
from ..strategies.method import Context, Method
from .experts import MoE, expert_parallel, moe_layers
from .merge import OwnedKeys, by_name, held_names
from .replicas import average_gradients


@dataclass
class ExpertSettings(Settings):
    """``[strategy]`` keys of ``ep``: none (the MoE layers' experts, top-k and capacity are the
    task's settings, ``task.experts``, ...)."""


def build(s: ExpertSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    if not moe_layers(model):
        raise ConfigError("task", f"ep spreads the experts of mixture-of-experts layers over the "
                          f"ranks; the task's model ({type(model).__name__}) has no MoE layer: "
                          "use task=lowcomm.tasks.moe or a model with lowcomm.MoE layers")
    return ExpertParallel(model, optimizer, comm, settings=s, replicas=ctx.replicas,
                          key="task.experts")


METHOD = Method("ep", ExpertSettings, build,
                "expert parallelism: each MoE layer's experts spread over the ranks, tokens "
                "dispatched and returned by all-to-all, the dense part's gradients averaged",
                level=True, splits=True, python="ExpertParallel")


class Routed:
    """The MoE layers' routing counts since the last metrics line and since the start: per step,
    dropped assignments, tokens with every assignment dropped, assignments routed (summed over
    the layers) and the load-balancing loss (the mean over the layers)."""

    FIELDS = ("dropped", "tokens_dropped", "routed", "aux_loss", "steps")

    def __init__(self):
        self.window = [0.0] * len(self.FIELDS)
        self.total = [0.0] * len(self.FIELDS)

    def add(self, layers: list[MoE]) -> None:
        step = [sum(m.dropped for m in layers), sum(m.tokens_dropped for m in layers),
                sum(m.routed for m in layers),
                sum(float(m.aux_loss.detach()) for m in layers) / len(layers), 1]
        self.window = [a + b for a, b in zip(self.window, step)]
        self.total = [a + b for a, b in zip(self.total, step)]

    def line(self, ctl: Comm, final: bool) -> dict:
        """``ep_dropped`` (assignments per step, summed over the ranks), ``ep_tokens_dropped``,
        ``ep_dropped_fraction`` (of the assignments routed) and ``ep_aux_loss`` (per rank and
        step), over the steps since the last line (``final``: since the start); collective."""
        mine = torch.tensor(self.total if final else self.window, dtype=torch.float64)
        if not final:
            self.window = [0.0] * len(self.FIELDS)
        ctl.allreduce_(mine, "sum")
        dropped, tokens, routed, aux, steps = mine.tolist()
        per_step = ctl.size / steps if steps else 0.0       # steps: summed over the ranks too
        out = {"ep_dropped": dropped * per_step, "ep_tokens_dropped": tokens * per_step,
               "ep_dropped_fraction": dropped / routed if routed else 0.0,
               "ep_aux_loss": aux / steps if steps else 0.0}
        return {f"{k}_per_step" if final else k: v for k, v in out.items()}

    def state_dict(self) -> dict:
        return {"total": list(self.total)}

    def load_state_dict(self, state: dict) -> None:
        self.total = [float(x) for x in state["total"]]
        self.window = [0.0] * len(self.FIELDS)


class ExpertParallel(OwnedKeys, ReducedOnce):
    """Expert parallelism over the ranks of ``comm`` (module docstring).

    Construction, on every rank of ``comm`` together: the dense part and the buffers broadcast
    from rank 0; every MoE layer keeps this rank's experts (the others' stay as placeholders on
    the meta device, so the parameter layout is the same on every rank); the wrapped
    optimizer's ``param_groups`` keep this rank's parameters (the same group dicts: LR
    schedulers keep working). The model must be built alike on every rank.

    The training loop does not change: each rank takes its own batch and runs ``loss_fn(model,
    batch)`` and its backward (every forward is collective over ``comm``: every rank runs the
    same number of them). ``clip_grad_norm_`` clips by the whole model's norm.

    Args:
        model, optimizer: the user's torch objects (the optimizer on ``model.parameters()``,
            with no state yet); the model has :class:`~lowcomm.parallel.experts.MoE` layers.
        comm: the ranks of the level (default: world).
        replicas: rank i of every other expert-parallel unit, for data parallelism around it
            (:mod:`~lowcomm.parallel.replicas`).
        key: the setting a ConfigError names when a layer's experts do not divide over the ranks.
        settings: a validated :class:`ExpertSettings`.

    Example::

        opt = ExpertParallel(model, torch.optim.AdamW(model.parameters()))
        for step, batch in enumerate(data):            # each rank its own batch
            opt.zero_grad()
            loss = opt.forward_backward(task_loss, batch)
            opt.step()
        opt.finish()                                   # the whole model on every rank
    """

    name = "ep"
    Settings = ExpertSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: ExpertSettings | None = None,
                 replicas: Comm | None = None, key: str = "experts", **options):
        if optimizer.state:
            raise ConfigError("optimizer", f"{type(optimizer).__name__} holds state already (it "
                              "has stepped): ep keeps each rank's experts' state; wrap a fresh one")
        super().__init__(model, optimizer, comm, settings=settings, **options)
        self.replicas = replicas
        self.device = next(model.parameters()).device
        broadcast_(self.comm, [*model.parameters(), *model.buffers()], root=0)
        self.layers = expert_parallel(model, self.comm, placeholders=True, key=key)
        self._owned = {k for k, v in model.state_dict().items() if not v.is_meta}
        own = {name: p for name, p in model.named_parameters() if not p.is_meta}
        self._held = list(own.values())
        self._experts = {id(p) for name, p in own.items() if _is_expert(model, name)}
        held = {id(p) for p in self._held}     # (the others' experts are new meta tensors)
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in held]
        self.built.fix()
        self.routed = Routed()

    # the step -----------------------------------------------------------------------------------
    def batch_place(self) -> tuple[int, int]:
        """Each rank of the level its own batch; the replicas' units one after another."""
        if self.replicas is None:
            return self.comm.rank, self.comm.size
        R = self.comm.size
        return self.replicas.rank * R + self.comm.rank, self.replicas.size * R

    def _reduce_gradients(self) -> None:
        """After a backward pass (once): the dense gradients averaged over the level, the
        experts' divided by R, then every gradient averaged over the replicas."""
        for p in self._held:                # every rank sends every dense gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dense = [p.grad for p in self._held if id(p) not in self._experts]
        average_gradients(self.comm, dense)
        for p in self._held:
            if id(p) in self._experts:
                p.grad.div_(self.comm.size)
        if self.replicas is not None:
            average_gradients(self.replicas, [p.grad for p in self._held])

    def _after_backward(self) -> None:
        self.routed.add(self.layers)

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (its experts and the dense part): what an outer loop
        above keeps and averages with rank i of the other units (the same experts)."""
        return {n: p for n, p in self.model.named_parameters() if not p.is_meta}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the whole model's gradient norm (the experts' summed over the level, the
        dense part counted once); returns the norm, on every rank."""
        if norm_type != 2.0:
            raise ConfigError("norm_type", f"ep clips by the 2-norm, got {norm_type}")
        self._reduce()
        sq = {k: torch.zeros((), dtype=torch.float64) for k in (True, False)}
        for p in self._held:
            g = p.grad.detach().double()
            sq[id(p) in self._experts] += torch.linalg.vector_norm(g).cpu() ** 2
        experts = sq[True].reshape(1)
        self.comm.allreduce_(experts, "sum")
        norm = (experts[0] + sq[False]).sqrt().to(torch.float32)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise LowcommError(f"the gradients' norm over every rank's experts is {float(norm)}")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self._held:
            p.grad.mul_(coef.to(p.grad.device))
        return norm

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """Dropped assignments and tokens and the load-balancing loss (:class:`Routed`)."""
        return self.routed.line(ctl, final)

    # checkpoints --------------------------------------------------------------------------------
    def load_model_state_dict(self, state: dict) -> None:
        """Load :meth:`model_state_dict`'s keys, or a whole model's state (:meth:`reshard`'s):
        this rank takes its experts' keys and the dense part."""
        missing = sorted(self._owned - set(state))
        if missing:
            raise LowcommError(f"ep rank {self.comm.rank} of {self.comm.size} holds keys the "
                               f"state lacks ({missing[:3]} and {max(0, len(missing) - 3)} "
                               "more): it was saved by another split of the experts")
        self._copy_owned(state)

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's parameters, with their names, the
        level's rank count and the routing counts."""
        return {"optimizer": self.optimizer.state_dict(), "method": self.name,
                "names": held_names(self.model, self.optimizer), "degree": self.comm.size,
                "routed": self.routed.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.name:
            raise LowcommError(f"the checkpoint's strategy state was written by "
                               f"{state.get('method', 'another method')!r}, not ep")
        if state["degree"] != self.comm.size:
            raise ConfigError("topology", f"the checkpoint spread the experts over "
                              f"{state['degree']} ranks, this level has {self.comm.size}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.routed.load_state_dict(state["routed"])

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks (R → R'): the old ranks' experts and optimizer
        state joined by name (:func:`~lowcomm.parallel.merge.by_name`); the routing totals are
        new rank 0's (summed over the old ranks)."""
        bad = [r for r, o in enumerate(old) if o["strategy"].get("method") != self.name]
        if bad:
            raise LowcommError(f"old rank {bad[0]}'s strategy state was not written by ep")
        merged = by_name(old, self.model, self.optimizer)
        totals = [sum(x) for x in zip(*(o["strategy"]["routed"]["total"] for o in old))]
        routed = {"total": totals if self.comm.rank == 0 else [0.0] * len(totals)}
        merged["strategy"].update(method=self.name, degree=self.comm.size, routed=routed)
        return merged

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Leave the whole model on every rank: every rank's experts gathered, the layers whole
        again (their calls local) and loaded."""
        full = self._gather()
        for m in self.layers:
            m.whole_(self.device)
        self.model.load_state_dict(full)
        self._owned = set(full)


def _is_expert(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter ``name`` belongs to an expert of one of ``model``'s MoE layers."""
    for prefix, m in model.named_modules():
        if isinstance(m, MoE) and name.startswith(f"{prefix}.experts." if prefix else "experts."):
            return True
    return False


__all__ = ["METHOD", "ExpertParallel", "ExpertSettings", "Routed"]
