"""Two axes on one two-dimensional device mesh: pipeline stages each split by tensor parallelism
(``pp`` over ``tp``, :class:`PipelineOfTensors`), and tensor parallelism with its replicas
sharded by FSDP2 (``fsdp`` above ``tp``, :class:`ShardedTensorParallel`); the registry's
builders of ``pp`` and ``tp`` (:func:`build`, :func:`build_tp`), which also place a pipeline's
replicas under FSDP2 (:mod:`~lowcomm.parallel.sharded_stages`) and either split's under ZeRO
(:mod:`~lowcomm.parallel.zero_replicas`). An outer loop above either composition keeps each
rank's local tensors (a DTensor's ``to_local()``), a tensor several ranks hold by its owner.

**pp over tp.**
Narayanan et al. 2021 (arXiv 2104.04473, "PTD-P"): the model is cut into P pipeline stages, and
each stage's layers are split again over T ranks as Megatron-LM splits them (Shoeybi et al.
2019, arXiv 1909.08053). On a per-level policy the pipeline is the upper level and tensor
parallelism the level below (``topology = "node:2,rank:2"``, ``policy.node = "pp"``,
``policy.rank = "tp"``): the T ranks of a node hold one stage, rank t of every node the t-th
piece of every stage. torchtitan builds the same shape (its ``pipeline`` then ``parallelize``:
stages cut first, each stage module tensor-parallel on the mesh's "tp" dim, the schedule's P2P on
its "pp" dim).

Construction, on every rank of the span (both levels' ranks) together:
  1. torch.distributed's default group over the span and a ``DeviceMesh`` of shape (P, T) with
     dims ("pp", "tp") from it;
  2. the model cut into stages over the "pp" dim, this rank keeping its stage
     (:class:`~lowcomm.parallel.pipeline.PipelineParallel`);
  3. the tensor-parallel plan of the model's family, restricted to this stage's modules, applied
     on the "tp" dim (:func:`~lowcomm.parallel.tensor.split_layers`);
  4. torch's ``PipelineStage`` over the "pp" dim's group.

Per step: the pipeline's schedule (every micro-batch's forward and backward through the split
stages: TP's all-reduces inside each stage, activations between stages); gradients the mean
over micro-batches, a tied embedding's summed over the first and last stages, the mean over
replicas where data-parallel levels sit above; ``step()``: the wrapped optimizer on this rank's
pieces. Traffic: TP's collectives charged to the tensor level (``allreduce.tp``), activations
and their gradients to the pipeline level (``send.activation.<s>-<s+1>``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError
from ..strategies.base import Strategy
from ..strategies.sharded.fsdp import charge_units, fsdp_modules, unshard_model, wrap_units
from ..strategies.method import Context, InnerSplit, ShardedReplicas
from . import pipeline, tensor
from .pipeline import PipelineParallel, PipelineSettings, stage_options
from .owners import balanced_owners, share_from_owners
from .plans import Plan, local_part, plan_for
from .sharded_stages import ShardedPipeline, plain_fsdp
from .zero_replicas import ZeroPipeline, ZeroTensorParallel
from .tensor import (SplitOf, TensorParallel, as_piece, charge_collectives, from_piece,
                     hook_ids, join, split_layers, uncharge, unsplit_layers)


def build(s: PipelineSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    """A pipeline, its stages tensor-parallel where a ``tp`` level sits below (``ctx.inner``),
    its replicas sharded where ``fsdp`` sits above (``ctx.sharding``)."""
    if ctx.sharding is not None:
        cls = ShardedPipeline if ctx.sharding.name == "fsdp" else ZeroPipeline
        return cls(model, optimizer, comm, settings=s, sharding=ctx.sharding,
                   **stage_options(ctx))
    if ctx.inner is None:
        return pipeline.build(s, model, optimizer, comm, ctx)
    return PipelineOfTensors(model, optimizer, comm, settings=s, inner=ctx.inner,
                             **stage_options(ctx))


#: ``pp`` as the registry knows it: over a ``tp`` level, its stages tensor-parallel
METHOD = dataclasses.replace(pipeline.METHOD, build=build, splits_over=("tp",))


def build_tp(s, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    """Tensor parallelism, its replicas sharded where ``fsdp`` (FSDP2) or ``zero1``/``zero2``
    sits above (``ctx.sharding``)."""
    if ctx.sharding is None:
        return tensor.build(s, model, optimizer, comm, ctx)
    if ctx.sharding.name != "fsdp":
        return ZeroTensorParallel(model, optimizer, comm, settings=s, replicas=ctx.replicas,
                                  sharding=ctx.sharding)
    return ShardedTensorParallel(model, optimizer, comm, settings=s, replicas=ctx.replicas,
                                 sharding=ctx.sharding)


#: ``tp`` as the registry knows it: under an ``fsdp`` level, its replicas sharded
TP_METHOD = dataclasses.replace(tensor.METHOD, build=build_tp)


class PipelineOfTensors(PipelineParallel):
    """Pipeline stages over the ranks of ``comm``, each tensor-parallel over ``inner.comm``
    (module docstring). ``comm``: rank t of every unit of the tensor level (stage order = rank
    order); ``inner``: the tensor level's ranks, settings and the span of both levels. The
    other arguments are :class:`~lowcomm.parallel.pipeline.PipelineParallel`'s."""

    name = "pp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, inner: InnerSplit, **options):
        if inner.settings.sequence:
            raise ConfigError(f"policy.{inner.comm.level}.sequence", "tp with sequence = true "
                              "under pp is not built; use sequence = false under pp")
        self.inner, self.tp_mesh = inner, None
        super().__init__(model, optimizer, comm, **options)

    # construction -------------------------------------------------------------------------------
    def _build_schedule(self, s: PipelineSettings):
        self.mesh = self._mesh(self.inner.settings.timeout_s)
        self.tp_mesh = self.mesh["tp"]
        self._split_stages()
        return super()._build_schedule(s)

    def _mesh(self, timeout_s: float):
        """The default group over the span and its (pp, tp) mesh: rank t of stage s at (s, t)."""
        from torch.distributed.device_mesh import DeviceMesh

        from ..comm.process_group import default_group
        span, tp = self.inner.span, self.inner.comm
        if span.size != self.comm.size * tp.size:
            raise LowcommError(f"pp over tp: {span.size} ranks are not {self.comm.size} stages "
                               f"of {tp.size} tensor-parallel ranks")
        default_group(span, self.device, timeout_s, holder=self)
        self._where = span.allgather_object((self.comm.rank, tp.rank))
        grid = torch.empty(self.comm.size, tp.size, dtype=torch.int64)
        for r, (s, t) in enumerate(self._where):
            grid[s, t] = r
        return DeviceMesh(self.device.type, grid, mesh_dim_names=("pp", "tp"))

    def _split_stages(self) -> None:
        """This rank's stage(s) split over the mesh's "tp" dim by the family's plan."""
        tp = self.inner.comm
        names = {id(p): n for n, p in self.model.named_parameters()}
        held = [names[id(p)] for p in self._held]
        whole = plan_for(self.model, sequence=False)
        mine = {m for m in whole.styles if any(k.startswith(m + ".") for k in self._owned)}
        self.plan = Plan({m: whole.styles[m] for m in mine},
                         {k: v for k, v in whole.local.items() if k.rsplit(".", 1)[0] in mine},
                         whole.divides)
        self.plan.check(tp.size, f"policy.{tp.level}")
        self._hooks = hook_ids(self.model)
        self._pieces = split_layers(self.model, self.optimizer, self.tp_mesh, self.plan)
        params = dict(self.model.named_parameters())
        self._held = [params[n] for n in held]
        self.built.fix()
        charge_collectives(self.tp_mesh, tp.ledger, tp.level)

    def _stage_group(self, s: PipelineSettings):
        return self.mesh.get_group("pp")

    # the step -----------------------------------------------------------------------------------
    def _norm_comm(self) -> Comm:
        return self.inner.span

    def _own_grads(self) -> list[torch.Tensor]:
        """This rank's pieces of the gradient: a split parameter's piece, a replicated one's on
        tensor rank 0 only (a tied tensor on the first stage only)."""
        from torch.distributed.tensor import DTensor
        names = {id(p): n for n, p in self.model.named_parameters()}
        tied = {id(p) for p in self._tied} if not self.holds_first else set()
        first = self.inner.comm.rank == 0
        return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                for p in self._held if p.grad is not None and id(p) not in tied
                and (first or names[id(p)] in self._pieces)]

    # an outer loop above ----------------------------------------------------------------------
    def outer_shards(self) -> dict[str, torch.Tensor]:
        """:meth:`local_shards` less the copies another rank owns: a tied tensor's on the last
        stage (the first stage's rank owns it), a tensor parallelism leaves whole on the tensor
        ranks other than its owner (:mod:`~lowcomm.parallel.owners`)."""
        owner, me = self._tp_owners(), self.inner.comm.rank
        return {n: t for n, t in super().outer_shards().items() if owner.get(n, me) == me}

    def parameters_changed(self) -> None:
        """After an outer loop's merge: each whole tensor of a stage takes its tensor owner's
        copy, then the last stage's tied copy the first stage's."""
        local = self.local_shards()
        share_from_owners(self.inner.comm, [(local[n], r) for n, r in self._tp_owners().items()])
        super().parameters_changed()

    def _tp_owners(self) -> dict[str, int]:
        """The tensor rank owning each parameter of this rank's stage that tp leaves whole."""
        sizes = {n: t.numel() for n, t in self.local_shards().items() if n not in self._pieces}
        return balanced_owners(sizes, self.inner.comm.size)

    # checkpoints --------------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """This rank's stage keys, a split parameter as its :class:`SplitOf` piece."""
        return {k: as_piece(self._pieces, k, v) for k, v in self.model.state_dict().items()
                if k in self._owned}

    def load_model_state_dict(self, state: dict) -> None:
        """Load :meth:`model_state_dict`'s pieces or a whole model's state: this rank takes its
        stage's keys, its piece of each split parameter."""
        own = self.model.state_dict()
        super().load_model_state_dict({k: from_piece(self._pieces, k, v, own[k])
                                       if k in self._owned else v for k, v in state.items()})

    def _gather(self) -> dict:
        """The whole model's state from every rank's pieces (collective over the span): each
        key joined from the tensor ranks of the first stage holding it."""
        parts = self.inner.span.allgather_object(self.model_state_dict())
        order = sorted(range(len(parts)), key=lambda r: self._where[r])
        out: dict = {}
        for k in self.model.state_dict():
            holders = [r for r in order if k in parts[r]]
            if holders:
                stage = self._where[holders[0]][0]
                out[k] = join([parts[r][k] for r in holders if self._where[r][0] == stage])
        return out

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's pieces (:class:`SplitOf`), by name."""
        state = super()._state_dict()
        sd, names = state["optimizer"], state["names"]
        pieces = {i: {k: as_piece(self._pieces, names[i], v) for k, v in s.items()}
                  for i, s in sd["state"].items()}
        return {**state, "optimizer": {**sd, "state": pieces}, "method": "pp over tp"}

    def _load_state_dict(self, state: dict) -> None:
        if state.get("method") != "pp over tp":
            raise LowcommError("the checkpoint's strategy state was not written by pp over tp: "
                               "resume on the topology and policy that wrote it")
        params = dict(self.model.named_parameters())
        names, opt = state["names"], state["optimizer"]
        loaded = {i: {k: from_piece(self._pieces, names[i], v, params[names[i]])
                      if isinstance(v, SplitOf) or (torch.is_tensor(v) and v.dim() > 0) else v
                      for k, v in s.items()} for i, s in opt["state"].items()}
        self.optimizer.load_state_dict({**opt, "state": loaded})

    def reshard(self, old: list[dict]) -> dict:
        raise LowcommError("pp over tp resumes on the split that wrote the checkpoint only (the "
                           "same topology and policy): another split is not built")

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Leave the whole model on every rank: the pieces joined, every stage gathered."""
        full = self._gather()
        uncharge(self.tp_mesh)
        unsplit_layers(self.model, self._hooks, self.plan, self.device)
        self._pieces = {}
        self._restore(full)

    def _close(self) -> None:
        uncharge(self.tp_mesh)
        super()._close()


class ShardedTensorParallel(TensorParallel):
    """Tensor parallelism over ``comm`` (a unit's ranks), FSDP2 over ``replicas`` (rank t of
    every unit): the 2-D (dp, tp) mesh of torch's documented FSDP + TP composition (Zhao et al.
    2023, arXiv 2304.11277; torchtitan's ``parallelize``).

    Construction, on every rank of ``sharding.span`` together: the default group over the span
    and its (dp, tp) mesh; the tensor-parallel plan on the "tp" dim
    (:class:`~lowcomm.parallel.tensor.TensorParallel`); then ``fully_shard`` on the "dp" dim,
    every block of the model's layers, then the root (:func:`~lowcomm.strategies.sharded.fsdp.wrap_units`,
    ``wrap = "auto"``): each rank holds 1/D of its tensor-parallel piece, and its optimizer
    state 1/D.

    Per step: the replicas take different batches; forward and backward all-gather each block's
    pieces over "dp" and reduce-scatter their gradients (the mean over the replicas, as
    ``syncdp`` above ``tp`` averages them), TP's collectives run over "tp" inside; ``step()``:
    the wrapped optimizer on this rank's shard of its piece. Traffic: FSDP's collectives charged
    to the data-parallel level (``allgather.fsdp``, ``reduce_scatter.fsdp``), TP's to its own.
    Checkpoints hold the tensor-parallel pieces (the "dp" shards gathered); a resume cuts each
    piece into this rank's "dp" shard again (:meth:`_tensor`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, sharding: ShardedReplicas, replicas: Comm,
                 **options):
        plain_fsdp(sharding, replicas.level, "tp")
        self.sharding = sharding
        super().__init__(model, optimizer, comm, replicas=replicas, **options)

    def _mesh(self, s):
        """The default group over the span and its (dp, tp) mesh; returns the "tp" dim."""
        from torch.distributed.device_mesh import DeviceMesh

        from ..comm.process_group import default_group
        if s.sequence:
            raise ConfigError(f"policy.{self.comm.level}.sequence", "tp with sequence = true "
                              "under fsdp is not built; use sequence = false")
        span, D, T = self.sharding.span, self.replicas.size, self.comm.size
        default_group(span, self.device, s.timeout_s, holder=self)
        grid = torch.empty(D, T, dtype=torch.int64)
        for r, (d, t) in enumerate(span.allgather_object((self.replicas.rank, self.comm.rank))):
            grid[d, t] = r
        self.mesh2 = DeviceMesh(self.device.type, grid, mesh_dim_names=("dp", "tp"))
        return self.mesh2["tp"]

    def _split(self, model, optimizer) -> None:
        """Tensor parallelism's split, then FSDP2 over the "dp" dim."""
        from torch.distributed.fsdp import fully_shard
        super()._split(model, optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        again = self.sharding.settings.reshard_after_forward
        for unit in wrap_units(model, "auto"):
            fully_shard(unit, mesh=self.mesh2["dp"], reshard_after_forward=again)
        fully_shard(model, mesh=self.mesh2["dp"])
        charge_units(fsdp_modules(model), self.replicas)
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self.built.fix()

    def _reduce_gradients(self) -> None:
        """Nothing: FSDP2 reduce-scattered the gradients over the replicas in the backward pass."""

    def _norm_comm(self) -> Comm:
        return self.sharding.span

    def _piece(self, name: str, t):
        """``t`` as tensor parallelism alone holds it: its "dp" shards gathered (collective)."""
        from torch.distributed.tensor import DTensor, Replicate
        if isinstance(t, DTensor) and "dp" in (t.device_mesh.mesh_dim_names or ()):
            dims = t.device_mesh.mesh_dim_names
            t = t.redistribute(t.device_mesh, [Replicate() if d == "dp" else p
                                               for d, p in zip(dims, t.placements)])
        return as_piece(self._pieces, name, t)

    def distributed_model_state(self) -> dict:
        raise ConfigError("checkpoint.format", "\"dcp\" under fsdp above tp is not built (its "
                          "(dp, tp) shards are not checked against torch.distributed.checkpoint); "
                          "use checkpoint.format = \"torch\"")

    def _tensor(self, name: str, v, like):
        """The inverse of :meth:`_piece`: ``v`` (a tensor-parallel piece, or the whole tensor)
        as ``like`` holds it on this rank, its "dp" shard cut locally (no communication)."""
        from torch.distributed.tensor import DTensor, Replicate
        if not (isinstance(like, DTensor) and "dp" in (like.device_mesh.mesh_dim_names or ())):
            return super()._tensor(name, v, like)
        dims = like.device_mesh.mesh_dim_names      # ("dp",) for a tensor tp leaves whole
        tp = like.placements[dims.index("tp")] if "tp" in dims else Replicate()
        local = v.local if isinstance(v, SplitOf) else v
        if name in self._pieces and not isinstance(v, SplitOf):
            dim, parts = self._pieces[name]
            local = local_part(v, dim, parts, self.comm.size, self.comm.rank)
        held = DTensor.from_local(local.to(like.device, like.dtype), like.device_mesh,
                                  [Replicate() if d == "dp" else tp for d in dims],
                                  run_check=False, shape=like.shape, stride=like.stride())
        return held.redistribute(like.device_mesh, like.placements)

    def _finish(self) -> None:
        """The pieces joined, FSDP2 and then tensor parallelism removed: the whole model."""
        full = self._gather()
        unshard_model(self.model, fsdp_modules(self.model))
        self._leave(full)


__all__ = ["METHOD", "PipelineOfTensors", "ShardedTensorParallel", "TP_METHOD", "build",
           "build_tp"]
