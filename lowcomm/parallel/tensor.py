"""Tensor and sequence parallelism (``tp``): each layer of the model split over the ranks of a
level by torch's own engine (:mod:`torch.distributed.tensor.parallel`, DTensor).

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053): in each transformer block the attention
heads and the MLP's hidden units are divided among the T ranks; a sub-layer's column-split
projection computes its heads/units from the whole input, its row-split projection a partial
output that one all-reduce sums (forward), and one all-reduce sums the input's gradient
(backward). Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198; ``sequence =
true``) runs the norms (and dropout) on 1/T of the positions: all-gather before the column
split, reduce-scatter after the row split. What is split how is a plan
(:mod:`lowcomm.parallel.plans`): built in for lowcomm's GPT, transformers' GPT-2 and
Llama-shaped models, the user's own otherwise.

Per step, on every rank of the level: the same batch; ``loss = loss_fn(model, batch)`` and its
backward as in any loop (the activations at the split layers' ends are exchanged inside the
forward and backward passes); a replicated parameter whose gradient came out partial (a
sequence-parallel norm's) is summed over the ranks; ``step()``: the wrapped optimizer updates
this rank's pieces. Traffic: every collective DTensor issues on this level's mesh is charged to
the method's ledger (``allreduce.tp``, ``allgather.tp``, ``reduce_scatter.tp``: its
bandwidth-optimal bytes). :meth:`finish` leaves the whole, unsplit model on every rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..comm.comm import Comm
from ..comm.ledger import wire_bytes
from ..errors import ConfigError, LowcommError
from ..settings import Settings
from ..strategies.base import Strategy
from .split import ReducedOnce
from ..strategies.method import Context, Method
from .owners import balanced_owners, share_from_owners
from .plans import Plan, Split, join_parts, local_part, plan_for
from .replicas import average_gradients, local_grads, place


@dataclass
class TensorSettings(Settings):
    """``[strategy]`` keys of ``tp``."""
    sequence: bool = False      # sequence parallelism in the norm regions (Korthikanti et al. 2022)
    timeout_s: float = 300.0    # the torch.distributed group's limit for one operation

    def validate(self, prefix: str = "") -> None:
        self.within(prefix, "timeout_s", 0, float("inf"), low_open=True)


def build(s: TensorSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    return TensorParallel(model, optimizer, comm, settings=s, replicas=ctx.replicas)


METHOD = Method("tp", TensorSettings, build,
                "tensor parallelism: each block's heads and MLP units split over the ranks "
                "(Megatron's column/row splits, sequence-parallel norms), torch's DTensor engine",
                level=True, splits=True, python="TensorParallel")


class SplitOf:
    """One rank's piece of a tensor split over a tensor-parallel level, as checkpoints hold
    it: ``local`` (a plain tensor), the whole ``shape``, the split ``dim`` and the fused
    ``parts`` (:func:`~lowcomm.parallel.plans.local_part`)."""

    def __init__(self, local: torch.Tensor, shape, dim: int, parts: int):
        self.local, self.shape, self.dim, self.parts = local, torch.Size(shape), dim, parts

    def __repr__(self) -> str:
        return f"SplitOf({tuple(self.local.shape)} of {tuple(self.shape)} on dim {self.dim})"


torch.serialization.add_safe_globals([SplitOf])


def join(values: list) -> object:
    """The whole state from every rank's (in rank order): :class:`SplitOf` pieces joined, dicts
    key by key, anything else rank 0's."""
    if isinstance(values[0], SplitOf):
        v = values[0]
        return join_parts([x.local for x in values], v.dim, v.parts).view(v.shape)
    if isinstance(values[0], dict):
        return {k: join([v[k] for v in values]) for k in values[0]}
    return values[0]


_FUNCOL = ("all_reduce", "all_gather_single", "reduce_scatter_single")
_OPS = {"all_reduce": "allreduce.tp", "all_gather_single": "allgather.tp",
        "reduce_scatter_single": "reduce_scatter.tp"}
# mesh -> (ledger, level, size), the originals under "originals". By the mesh's value (its
# ranks): DTensor's redistributions may pass an equal mesh torch cached for the same ranks
_CHARGED: dict = {}


def _charging(name: str, original):
    def call(tensor, *args, **kwargs):
        group = kwargs.get("group", args[-1] if args else None)
        mesh = group[0] if isinstance(group, tuple) else group
        target = _CHARGED.get(mesh) if mesh is not None and not isinstance(mesh, str) else None
        t0 = time.perf_counter()
        out = original(tensor, *args, **kwargs)
        if target is not None:
            ledger, level, size = target
            sent, recv = wire_bytes(_OPS[name], tensor.numel() * tensor.element_size(), size)
            ledger.record(_OPS[name], level, sent, recv, time.perf_counter() - t0)
        return out
    return call


def charge_collectives(mesh, ledger, level: str) -> None:
    """Charge DTensor's collectives on ``mesh`` to ``ledger`` (torch's functional collectives,
    the calls DTensor's redistributions make, wrapped while any mesh is charged)."""
    import torch.distributed._functional_collectives as funcol
    if "originals" not in _CHARGED:
        missing = [n for n in _FUNCOL if not callable(vars(funcol).get(n))]
        if missing:
            raise LowcommError(f"torch {torch.__version__}'s functional collectives lack "
                               f"{missing}: tp cannot count its traffic on this torch")
        _CHARGED["originals"] = {n: vars(funcol)[n] for n in _FUNCOL}
        for n, f in _CHARGED["originals"].items():
            setattr(funcol, n, _charging(n, f))
    _CHARGED[mesh] = (ledger, level, mesh.size())


def uncharge(mesh) -> None:
    """Stop charging ``mesh``; the functional collectives are torch's again when none is."""
    import torch.distributed._functional_collectives as funcol
    _CHARGED.pop(mesh, None)
    if set(_CHARGED) == {"originals"}:
        for n, f in _CHARGED.pop("originals").items():
            setattr(funcol, n, f)


def split_layers(model: torch.nn.Module, optimizer, mesh, plan: Plan) -> dict:
    """``plan`` applied to ``model`` over ``mesh`` by ``parallelize_module`` (its parameters
    become DTensors holding this rank's piece, the plan's attributes their T-th), and the
    optimizer's groups pointed at them; returns name -> (dim, parts) of each split parameter."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    names = {id(p): n for n, p in model.named_parameters()}
    unknown = sorted(set(plan.styles) - {n for n, _ in model.named_modules()})
    if unknown:
        raise ConfigError("plan", f"names no module of {type(model).__name__}: {unknown[:4]}")
    parallelize_module(model, mesh, plan.styles)
    for key, full in plan.local.items():
        where, attr = key.rsplit(".", 1)
        setattr(model.get_submodule(where), attr, full // mesh.size())
    split = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [split[names[id(p)]] for p in group["params"]]
    pieces = {}
    for n, p in split.items():
        if isinstance(p, DTensor) and isinstance(p.placements[0], Shard):
            style = plan.styles.get(n.rsplit(".", 1)[0])
            pieces[n] = (p.placements[0].dim, style.parts if isinstance(style, Split) else 1)
    return pieces


def unsplit_layers(model: torch.nn.Module, hooks: dict, plan: Plan, device) -> None:
    """Undo :func:`split_layers` but for the values: torch's hooks removed (those not in
    ``hooks``: module -> (pre, post) hook ids before), each DTensor parameter a plain one of the
    whole shape (to be loaded), the plan's attributes whole again."""
    from torch.distributed.tensor import DTensor
    for m, (pre, post) in hooks.items():
        for k in set(m._forward_pre_hooks) - pre:
            del m._forward_pre_hooks[k]
        for k in set(m._forward_hooks) - post:
            del m._forward_hooks[k]
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if isinstance(p, DTensor):
                m._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                                                  device=device),
                                                      requires_grad=p.requires_grad)
    for key, whole in plan.local.items():
        where, attr = key.rsplit(".", 1)
        setattr(model.get_submodule(where), attr, whole)


def hook_ids(model: torch.nn.Module) -> dict:
    """Every module's forward hook ids now (:func:`unsplit_layers` removes the others)."""
    return {m: (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in model.modules()}


def as_piece(pieces: dict, name: str, t):
    """``t`` (a parameter or its optimizer state) as checkpoints keep it: a :class:`SplitOf`
    where ``name`` is split (``pieces``: :func:`split_layers`'), else a plain CPU copy."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return t.detach().cpu().clone() if torch.is_tensor(t) else t
    if name in pieces:
        dim, parts = pieces[name]
        return SplitOf(t.to_local().detach().cpu().clone(), t.shape, dim, parts)
    return t.to_local().detach().cpu().clone()


def from_piece(pieces: dict, name: str, v, like):
    """The inverse of :func:`as_piece`: ``v`` (a :class:`SplitOf` or the whole tensor) as
    ``like`` (a DTensor, or a plain tensor: ``v`` as it is) holds it on this rank."""
    from torch.distributed.tensor import DTensor
    if not isinstance(like, DTensor):
        return v
    local = v.local if isinstance(v, SplitOf) else v
    if name in pieces and not isinstance(v, SplitOf):
        dim, parts = pieces[name]
        mesh = like.device_mesh
        local = local_part(v, dim, parts, mesh.size(), mesh.get_local_rank())
    if tuple(local.shape) != tuple(like.to_local().shape):
        raise LowcommError(f"tp: {name}'s piece in the state is {tuple(local.shape)}, this "
                           f"rank holds {tuple(like.to_local().shape)}: it was saved by "
                           "another split (the level's rank count or strategy.sequence)")
    return DTensor.from_local(local.to(like.device, like.dtype), like.device_mesh,
                              like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def sum_partials(params) -> None:
    """A replicated parameter's gradient that came out partial (a sequence-parallel norm's on
    its 1/T of the positions) summed over the ranks."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(x, Partial) for x in g.placements):
            p.grad = g.redistribute(placements=[Replicate()])


class TensorParallel(ReducedOnce):
    """Tensor (and sequence) parallelism over the ranks of ``comm`` (module docstring).

    Construction, on every rank of ``comm`` together: torch.distributed's group over ``comm``
    (gloo on CPU, NCCL on CUDA) and a one-dimensional ``DeviceMesh``; the plan's modules split
    by ``parallelize_module`` (their parameters become DTensors holding this rank's piece); the
    wrapped optimizer's ``param_groups`` point at them (the same group dicts: LR schedulers keep
    working). The model must be built alike on every rank.

    The training loop does not change: every rank of the level takes the same batch and runs
    ``loss_fn(model, batch)`` and its backward. ``clip_grad_norm_`` clips by the whole model's
    norm.

    Args:
        model, optimizer: the user's torch objects (the optimizer on ``model.parameters()``,
            with no state yet).
        comm: the ranks of the level (default: world).
        plan: a :class:`~lowcomm.parallel.plans.Plan`, or torch's ``parallelize_module`` plan
            (a dict of parallel styles by module name); default: the model family's
            (:func:`~lowcomm.parallel.plans.plan_for`).
        replicas: rank i of every other split of the model, for data parallelism around it
            (:mod:`~lowcomm.parallel.replicas`: gradients averaged over them each step).
        settings: a validated :class:`TensorSettings`; otherwise its fields as keywords.
    """

    name = "tp"
    Settings = TensorSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: TensorSettings | None = None,
                 plan: Plan | dict | None = None, replicas: Comm | None = None, **options):
        if optimizer.state:
            raise ConfigError("optimizer", f"{type(optimizer).__name__} holds state already (it "
                              "has stepped): tp splits its parameters; wrap a fresh one")
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s, self.device = self.settings, next(model.parameters()).device
        self.replicas, self._owner = replicas, None
        self.plan = plan if isinstance(plan, Plan) else Plan(plan) if plan is not None else \
            plan_for(model, s.sequence)
        self.plan.check(self.comm.size, "strategy.name")
        self._hooks = hook_ids(model)
        self.mesh = self._mesh(s)
        self._split(model, optimizer)
        charge_collectives(self.mesh, self.comm.ledger, self.comm.level)

    def _mesh(self, s: TensorSettings):
        from torch.distributed.device_mesh import DeviceMesh

        from ..comm.process_group import default_group
        group = default_group(self.comm, self.device, s.timeout_s, holder=self)
        return DeviceMesh.from_group(group, self.device.type)

    def _split(self, model, optimizer) -> None:
        """The plan applied; ``self._pieces``: name -> (dim, parts) of each split parameter."""
        if self.plan.sequence and self.plan.first:      # before torch's hooks: checked first
            model.get_submodule(self.plan.first).register_forward_pre_hook(self._positions)
        self._pieces = split_layers(model, optimizer, self.mesh, self.plan)
        self.built.fix()

    def _positions(self, module, args) -> None:
        """Sequence parallelism cuts the positions into T equal parts: refuse others."""
        x = args[0] if args else None
        if torch.is_tensor(x) and x.dim() > 1 and x.shape[1] % self.comm.size:
            raise LowcommError(f"tp with strategy.sequence = true cuts the {x.shape[1]} "
                               f"positions of a batch over {self.comm.size} ranks: "
                               f"{self.comm.size} does not divide them; use a sequence length "
                               "it divides, or sequence = false")

    # the step -----------------------------------------------------------------------------------
    def batch_place(self) -> tuple[int, int]:
        """Every rank of the level takes the same batch (its replica's)."""
        return place(self.replicas)

    def _reduce_gradients(self) -> None:
        """After a backward pass: partial gradients summed, then the mean over the replicas."""
        sum_partials(self.model.parameters())
        if self.replicas is not None:
            average_gradients(self.replicas, local_grads(self.model.parameters()))

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter (a replicated one whole), by name: what an outer
        loop above keeps and averages with rank i of the other units (the same piece)."""
        from torch.distributed.tensor import DTensor
        return {n: p.to_local() if isinstance(p, DTensor) else p
                for n, p in self.model.named_parameters()}

    def outer_shards(self) -> dict[str, torch.Tensor]:
        """:meth:`local_shards` with each replicated parameter kept by its owner only
        (:mod:`~lowcomm.parallel.owners`): an outer loop above sends each tensor once per unit."""
        owner, me = self._owners(), self.comm.rank
        return {n: p for n, p in self.local_shards().items() if owner.get(n, me) == me}

    def parameters_changed(self) -> None:
        """An outer loop above merged its synchronisation: each replicated parameter takes its
        owner's copy (one broadcast per owner over the level)."""
        owner, local = self._owners(), self.local_shards()
        share_from_owners(self.comm, [(local[n], r) for n, r in owner.items()])

    def _owners(self) -> dict[str, int]:
        """The rank that owns each replicated parameter (the split ones are every rank's)."""
        if self._owner is None:
            sizes = {n: p.numel() for n, p in self.model.named_parameters()
                     if n not in self._pieces}
            self._owner = balanced_owners(sizes, self.comm.size)
        return self._owner

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the whole model's gradient norm (a split parameter's pieces summed over the
        ranks, a replicated one counted once); returns the norm, on every rank."""
        from torch.distributed.tensor import DTensor
        if norm_type != 2.0:
            raise ConfigError("norm_type", f"tp clips by the 2-norm, got {norm_type}")
        self._reduce()
        split, whole = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for n, p in self.model.named_parameters():
            if p.grad is None or not self._counts_grad(n):
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq = torch.linalg.vector_norm(g.detach().double()).cpu() ** 2
            split, whole = (split + sq, whole) if n in self._pieces else (split, whole + sq)
        # a replicated parameter's gradient is alike on every rank of the level: counted once
        total = torch.stack([split, whole if self.comm.rank == 0 else torch.zeros_like(whole)])
        self._norm_comm().allreduce_(total, "sum")
        norm = total.sum().sqrt().to(torch.float32)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise LowcommError(f"the gradients' norm over every rank's pieces is {float(norm)}")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(self.device))
        return norm

    def _norm_comm(self) -> Comm:
        """The ranks whose gradient pieces make up the whole model's gradient."""
        return self.comm

    def _counts_grad(self, name: str) -> bool:
        """Whether this rank's gradient of parameter ``name`` is in the clipping norm."""
        return True

    # checkpoints --------------------------------------------------------------------------------
    def _piece(self, name: str, t):
        """``t`` (a parameter or its optimizer state) as checkpoints keep it."""
        return as_piece(self._pieces, name, t)

    def _tensor(self, name: str, v, like):
        """The inverse of :meth:`_piece`: ``v`` (a piece or the whole tensor) as ``like`` holds
        it on this rank."""
        return from_piece(self._pieces, name, v, like)

    def model_state_dict(self) -> dict:
        """The model's state as this rank holds it: :class:`SplitOf` each split parameter."""
        return {k: self._piece(k, v) for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, state: dict) -> None:
        """Load :meth:`model_state_dict`'s pieces, or a whole model's state (:meth:`reshard`'s,
        or an unsplit model's): this rank takes its pieces."""
        own = self.model.state_dict()
        if set(state) != set(own):
            odd = sorted(set(state) ^ set(own))
            raise LowcommError(f"tp: the state's keys differ from the model's ({odd[:3]} and "
                               f"{max(0, len(odd) - 3)} more)")
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for k, v in own.items():
                new = self._tensor(k, state[k], v)
                if isinstance(v, DTensor):
                    v, new = v.to_local(), new.to_local()
                v.copy_(new)

    def distributed_model_state(self) -> dict:
        """The model's state dict as it stands, each split parameter a DTensor (its piece and
        its place in the whole): what torch.distributed.checkpoint saves and loads in place."""
        return self.model.state_dict()

    def full_model_state_dict(self) -> dict:
        """The whole model's state dict on rank 0, {} elsewhere; collective."""
        full = self._gather()
        return full if self.comm.rank == 0 else {}

    def _gather(self) -> dict:
        """The whole model's state from every rank's pieces (collective)."""
        return join(self.comm.allgather_object(self.model_state_dict()))

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's pieces, with the parameters' names."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        sd = self.optimizer.state_dict()
        state = {i: {k: self._piece(order[i], v) for k, v in s.items()}
                 for i, s in sd["state"].items()}
        return {"optimizer": {**sd, "state": state}, "names": order, "method": self.name}

    def _load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.name:
            raise LowcommError(f"the checkpoint's strategy state was written by "
                               f"{state.get('method', 'another method')!r}, not tp")
        params = {n: p for n, p in self.model.named_parameters()}
        names = state["names"]
        opt = state["optimizer"]
        loaded = {i: {k: self._tensor(names[i], v, params[names[i]]) if isinstance(v, SplitOf)
                      or (torch.is_tensor(v) and v.dim() > 0) else v for k, v in s.items()}
                  for i, s in opt["state"].items()}
        self.optimizer.load_state_dict({**opt, "state": loaded})

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another degree (TP 2 → 1): every old rank's pieces joined into the whole
        model and optimizer state, which this split cuts again."""
        bad = [r for r, o in enumerate(old) if o["strategy"].get("method") != self.name]
        if bad:
            raise LowcommError(f"old rank {bad[0]}'s strategy state was not written by tp")
        return {"model": join([o["model"] for o in old]),
                "strategy": {"optimizer": join([o["strategy"]["optimizer"] for o in old]),
                             "names": old[0]["strategy"]["names"], "method": self.name}}

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Leave the plain, whole model on every rank: each split parameter joined, torch's
        hooks removed, the plan's attributes whole again."""
        self._leave(self._gather())

    def _leave(self, full: dict) -> None:
        """The plain model again, ``full`` (the whole model's state) loaded into it."""
        from ..comm.process_group import release
        uncharge(self.mesh)
        unsplit_layers(self.model, self._hooks, self.plan, self.device)
        self.model.load_state_dict(full)
        self._pieces = {}
        release(self)

    def _close(self) -> None:
        from ..comm.process_group import release
        uncharge(self.mesh)
        release(self)


__all__ = ["METHOD", "SplitOf", "TensorParallel", "TensorSettings", "as_piece", "from_piece", "join",
           "split_layers", "sum_partials", "unsplit_layers"]
