"""Pipeline stages whose replicas FSDP2 shards (``fsdp`` above ``pp``, :class:`ShardedPipeline`):
torchtitan's composition of pipeline parallelism with fully sharded data parallelism.

Narayanan et al. 2021 (arXiv 2104.04473) put data parallelism around the pipeline's stages; Zhao
et al. 2023 (arXiv 2304.11277, PyTorch FSDP) shard each replica's parameters, gradients and
optimizer state over the data-parallel ranks instead of copying them. On a per-level policy the
pipeline is the inner level and FSDP the level above (``topology = "node:2,rank:2"``,
``policy.node = "fsdp"``, ``policy.rank = "pp"``): the P ranks of a node hold one pipeline,
rank s of every node stage s, sharded 1/D over the D nodes.

Construction, on every rank of the span (both levels) together:
  1. the model cut into stages over the pipeline level, this rank keeping its stage
     (:class:`~lowcomm.parallel.pipeline.PipelineParallel`);
  2. torch.distributed's default group over the span and a ``DeviceMesh`` of shape (D, P) with
     dims ("dp", "pp");
  3. ``fully_shard`` on the "dp" dim: each of the stage's blocks, then the stage module itself
     (its stem or head); the optimizer's groups point at the sharded parameters;
  4. torch's ``PipelineStage`` over the "pp" dim's group (torch's schedules know an FSDP stage:
     gradients accumulate unreduced over the micro-batches and are reduce-scattered once, after
     the last one).

Per step: the schedule (activations between stages over "pp"; each block's parameters
all-gathered over "dp" for its forward and backward); after the last micro-batch every stage's
gradients reduce-scattered over "dp" (the mean over the replicas, as ``syncdp`` above ``pp``
averages them), then divided by the micro-batches, a tied embedding's shards summed over the
first and last stages; ``step()``: the wrapped optimizer on this rank's shard of its stage.
Traffic: activations charged to the pipeline level, FSDP's all-gathers and reduce-scatters to
the data-parallel level (``allgather.fsdp``, ``reduce_scatter.fsdp``).

Checkpoints hold each stage's whole tensors (the shards gathered over "dp"), as ``pp`` with
``syncdp`` above writes them: either composition resumes from the other's, and on another
number of stages (:meth:`~lowcomm.parallel.pipeline.PipelineParallel.reshard`).
"""
from __future__ import annotations

import torch

from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError
from ..strategies.method import Context, ShardedReplicas
from ..strategies.sharded.fsdp import charge_units, unshard_model
from .pipeline import SINGLE, PipelineParallel, PipelineSettings


def plain_fsdp(sharding: ShardedReplicas, level: str, what: str) -> None:
    """The FSDP settings a split model's replicas are sharded with: the defaults of dtype and
    wrap (a ConfigError naming the first other one)."""
    f = sharding.settings
    odd = [k for k, v in (("param_dtype", f.param_dtype), ("reduce_dtype", f.reduce_dtype))
           if v] + (["wrap"] if f.wrap != "auto" else [])
    if odd:
        raise ConfigError(f"policy.{level}.{odd[0]}", f"fsdp above {what} shards every block in "
                          "the parameters' dtype: leave param_dtype, reduce_dtype and wrap at "
                          "their defaults")


def sharded_like(value: torch.Tensor, param) -> torch.Tensor:
    """``value`` (a whole tensor) as the DTensor ``param`` is placed: this rank's shard of it,
    cut locally (every rank holds ``value``)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                             param.placements, src_data_rank=None)


def whole(t):
    """``t`` whole: a DTensor's shards gathered (collective over its mesh), others as they are."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedPipeline(PipelineParallel):
    """Pipeline stages over ``comm`` (the ranks of one pipeline), FSDP2 over ``replicas`` (rank s
    of every pipeline) on a (dp, pp) mesh over ``sharding.span`` (module docstring). The other
    arguments are :class:`~lowcomm.parallel.pipeline.PipelineParallel`'s; its schedule holds
    one stage per rank (``GPipe`` or ``1F1B``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, sharding: ShardedReplicas, context: Context,
                 **options):
        plain_fsdp(sharding, context.replicas.level, "pp")
        self.sharding, self.mesh2 = sharding, None
        super().__init__(model, optimizer, comm, context=context, **options)

    # construction -------------------------------------------------------------------------------
    def _build_schedule(self, s: PipelineSettings):
        if s.schedule not in SINGLE:
            raise ConfigError(f"policy.{self.comm.level}.schedule", f"fsdp above pp shards one "
                              f"stage per rank: use {' or '.join(SINGLE)}, not {s.schedule}")
        self.mesh2 = self._mesh(s.timeout_s)
        self._shard_stages()
        return super()._build_schedule(s)

    def _mesh(self, timeout_s: float):
        """The default group over the span and its (dp, pp) mesh: stage s of replica d at (d, s)."""
        from torch.distributed.device_mesh import DeviceMesh

        from ..comm.process_group import default_group
        span, D, P = self.sharding.span, self.replicas.size, self.comm.size
        if span.size != D * P:
            raise LowcommError(f"fsdp above pp: {span.size} ranks are not {D} replicas of "
                               f"{P} stages")
        default_group(span, self.device, timeout_s, holder=self)
        grid = torch.empty(D, P, dtype=torch.int64)
        for r, (d, p) in enumerate(span.allgather_object((self.replicas.rank, self.comm.rank))):
            grid[d, p] = r
        return DeviceMesh(self.device.type, grid, mesh_dim_names=("dp", "pp"))

    def _shard_stages(self) -> None:
        """``fully_shard`` each block of this rank's stage, then the stage; the optimizer's
        groups, the held and the tied parameters renamed to the sharded ones."""
        from torch.distributed.fsdp import fully_shard
        names = {id(p): n for n, p in self.model.named_parameters()}
        again = self.sharding.settings.reshard_after_forward
        (stage,) = self.stages
        self._units = [*stage.blocks, stage]
        for unit in self._units:
            fully_shard(unit, mesh=self.mesh2["dp"], reshard_after_forward=again)
        charge_units(self._units, self.replicas)
        sharded = dict(self.model.named_parameters())
        for group in self.optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self._held = [sharded[names[id(p)]] for p in self._held]
        self._tied = [sharded[names[id(p)]] for p in self._tied]
        self.built.fix()

    def _stage_group(self, s: PipelineSettings):
        return self.mesh2.get_group("pp")

    # the step -----------------------------------------------------------------------------------
    def _average_replicas(self) -> None:
        """FSDP2 reduce-scattered the gradients over the replicas after the last micro-batch."""

    def _norm_comm(self) -> Comm:
        return self.sharding.span

    # checkpoints --------------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """This rank's stage keys, whole (its shards gathered over "dp": collective)."""
        return {k: whole(v) for k, v in super().model_state_dict().items()}

    def _copy_owned(self, state: dict) -> None:
        """This rank's keys from ``state`` (whole tensors), each parameter as its shard."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for k, v in self.model.state_dict(keep_vars=True).items():
                if k in self._owned:
                    if isinstance(v, DTensor):
                        v.to_local().copy_(sharded_like(state[k], v).to_local())
                    else:
                        v.copy_(state[k])

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's stage, whole (gathered over "dp")."""
        state = super()._state_dict()
        sd = state["optimizer"]
        return {**state, "optimizer": {**sd, "state": {
            i: {k: whole(v) for k, v in s.items()} for i, s in sd["state"].items()}}}

    def _load_state_dict(self, state: dict) -> None:
        """Load a stage's whole optimizer state, each tensor as its parameter's shard."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        opt = state["optimizer"]
        loaded = {i: {k: sharded_like(v, params[i]) if torch.is_tensor(v) and v.dim() > 0
                      else v for k, v in s.items()} for i, s in opt["state"].items()}
        self.optimizer.load_state_dict({**opt, "state": loaded})

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """FSDP2 removed (every stage's parameters whole again), then the pipeline's end."""
        unshard_model(self.model, self._units)
        self._units = []
        super()._finish()


__all__ = ["ShardedPipeline", "plain_fsdp", "sharded_like", "whole"]
