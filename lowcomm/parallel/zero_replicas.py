"""ZeRO over the replicas of a split model (``zero1`` / ``zero2`` above ``tp`` or ``pp``): each
rank's local tensors (its stage's parameters, or its tensor-parallel pieces) are owned one each
by the ranks holding the same part in the other replicas, which partition the optimizer state.

Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054, §5): P_os partitions the optimizer state over
the data-parallel ranks, P_os+g the gradients too; Megatron-LM's distributed optimizer does the
same over the data-parallel groups of a tensor- and pipeline-parallel model (Narayanan et al.
2021, arXiv 2104.04473). Here the partition is by whole local tensor (balanced by size over the
D replicas, :func:`~lowcomm.strategies.layout.balance`), so an optimizer that needs a whole
tensor steps it whole, and a checkpoint keeps each tensor's state by name.

Per step, on rank d of the D replicas, with local gradients g_d:
  1. the gradients, flat in owner order, reduce-scattered over the replicas: the owner of each
     tensor receives its mean ``(1/D) Σ_d g_d`` (what ``syncdp`` above the split all-reduces);
     under ``zero2`` the others drop their copy (``p.grad = None``), under ``zero1`` they keep it
     until step 3 (P_os: the gradients whole through the step);
  2. the wrapped optimizer, which holds this rank's tensors only, steps them;
  3. the parameters, flat in owner order, all-gathered: every replica's tensors equal again.
Bytes: a reduce-scatter and an all-gather of the local tensors, what one all-reduce moves.
"""
from __future__ import annotations

import dataclasses

import torch

from ..comm.collectives import allgather_, reduce_scatter
from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError
from ..strategies.layout import balance
from ..strategies.method import ShardedReplicas
from .pipeline import PipelineParallel
from .replicas import local_of as local
from .tensor import TensorParallel, sum_partials


class OwnedByReplicas:
    """The tensors of ``params`` (name → parameter, this rank's part of the model) owned over
    ``replicas`` (module docstring); the wrapped ``optimizer``'s groups keep the owned ones.
    ``stage``: 1 (``zero1``) or 2 (``zero2``); ``algorithm``: the reduce-scatter's and
    all-gather's (:func:`~lowcomm.comm.collectives.reduce_scatter`)."""

    def __init__(self, params: dict, optimizer: torch.optim.Optimizer, replicas: Comm,
                 stage: int, algorithm: str = "auto"):
        dtypes = {p.dtype for p in params.values()}
        if len(dtypes) > 1:
            raise ConfigError(f"policy.{replicas.level}", f"zero{stage} above a split model "
                              f"reduces one flat buffer of one dtype; the parameters hold "
                              f"{sorted(map(str, dtypes))}")
        self.replicas, self.stage, self.algorithm = replicas, stage, algorithm
        names = list(params)
        owner = balance([local(p).numel() for p in params.values()], replicas.size)
        order = sorted(range(len(names)), key=lambda i: (owner[i], i))
        self.order = [(names[i], params[names[i]]) for i in order]
        self.counts = [sum(local(params[names[i]]).numel() for i in order if owner[i] == r)
                       for r in range(replicas.size)]
        self.mine = {names[i] for i in order if owner[i] == replicas.rank}
        held = {id(params[n]) for n in self.mine}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in held]

    def owns(self, name: str) -> bool:
        return name in self.mine

    @torch.no_grad()
    def reduce(self) -> None:
        """Step 1: each owned tensor's gradient the mean over the replicas."""
        flat = torch.cat([local(p.grad).reshape(-1) if p.grad is not None else
                          torch.zeros(local(p).numel(), dtype=p.dtype, device=local(p).device)
                          for _, p in self.order])
        mine = reduce_scatter(flat, self.replicas, self.counts, self.algorithm, "avg")
        at = 0
        for n, p in self.order:
            if n in self.mine:
                g = local(p.grad) if p.grad is not None else None
                if g is None:
                    p.grad = torch.zeros_like(p)
                    g = local(p.grad)
                g.copy_(mine[at:at + g.numel()].view_as(g))
                at += g.numel()
            elif self.stage >= 2:
                p.grad = None

    @torch.no_grad()
    def gather(self) -> None:
        """Step 3: every replica's owned tensors to every replica."""
        flat = torch.cat([local(p).reshape(-1) for _, p in self.order])
        allgather_(flat, self.replicas, self.counts, self.algorithm)
        at = 0
        for n, p in self.order:
            t = local(p)
            if n not in self.mine:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                p.grad = None           # zero1's whole local gradient, used up by the step
            at += t.numel()




def check_zero(sharding: ShardedReplicas, level: str) -> None:
    """ZeRO's settings that apply to a split model's replicas: ``algorithm`` alone (a
    ConfigError naming the first other key set)."""
    s = sharding.settings
    odd = [f.name for f in dataclasses.fields(s) if f.name != "algorithm"
           and getattr(s, f.name) != f.default]
    if odd:
        raise ConfigError(f"policy.{level}.{odd[0]}", f"{sharding.name} above a split model "
                          "owns whole local tensors over the replicas and takes only "
                          "algorithm; leave the other keys at their defaults")


class ZeroOverReplicas:
    """Mixed into a split method: ZeRO over its ``replicas`` (the ranks holding the same part
    in the other replicas), each local tensor's optimizer state kept by its owner alone (module
    docstring). ``sharding``: the ZeRO level; the other arguments are the split method's."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, sharding: ShardedReplicas, **options):
        # the replicas: tp's own argument, a pipeline's context's (either passed on as given)
        replicas = options["replicas"] if "replicas" in options else options["context"].replicas
        check_zero(sharding, replicas.level)
        self.sharding = sharding
        super().__init__(model, optimizer, comm, **options)
        self.zero = OwnedByReplicas(self._parts(), optimizer, replicas, sharding.stage,
                                    sharding.settings.algorithm)
        self.built.fix()

    def _parts(self) -> dict:
        """This rank's parameters by name (the split method's part of the model)."""
        raise NotImplementedError

    def _norm_comm(self) -> Comm:
        return self.sharding.span

    def reshard(self, old: list[dict]) -> dict:
        raise LowcommError(f"{self.sharding.name} above {self.name} resumes on the split that "
                           "wrote the checkpoint only (the same topology and policy)")


class ZeroPipeline(ZeroOverReplicas, PipelineParallel):
    """Pipeline stages over ``comm``, ZeRO over ``replicas`` (rank s of every pipeline): each
    stage's optimizer state partitioned over the replicas holding it."""

    def _parts(self) -> dict:
        held = {id(p) for p in self._held}
        return {n: p for n, p in self.model.named_parameters() if id(p) in held}

    def _average_replicas(self) -> None:
        self.zero.reduce()

    def _step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.zero.gather()
        return loss

    def _own_grads(self) -> list[torch.Tensor]:
        """This rank's share of the whole gradient: its owned tensors (a tied one on the first
        stage only)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        tied = {id(p) for p in self._tied} if not self.holds_first else set()
        return [local(p.grad) for p in self._held if p.grad is not None and id(p) not in tied
                and self.zero.owns(names[id(p)])]


class ZeroTensorParallel(ZeroOverReplicas, TensorParallel):
    """Tensor parallelism over ``comm``, ZeRO over ``replicas`` (rank t of every unit): each
    piece's optimizer state partitioned over the replicas holding it."""

    def _parts(self) -> dict:
        return dict(self.model.named_parameters())

    def _reduce(self) -> None:
        """Partial gradients summed, then each owned piece's the mean over the replicas."""
        if self._averaged:
            return
        sum_partials(self.model.parameters())
        self.zero.reduce()
        self._averaged = True

    def _step(self, closure=None):
        loss = super()._step(closure)
        self.zero.gather()
        return loss

    def _counts_grad(self, name: str) -> bool:
        return self.zero.owns(name)


__all__ = ["OwnedByReplicas", "ZeroOverReplicas", "ZeroPipeline", "ZeroTensorParallel",
           "check_zero"]
