"""Fully sharded data parallelism (ZeRO-3) through torch's FSDP2 (``fully_shard``).

Not a home-made one: the sharding, the parameter all-gathers and the gradient reduce-scatters
are torch's :func:`torch.distributed.fsdp.fully_shard`, over a torch.distributed group that
lowcomm makes from its MPI job (:func:`lowcomm.comm.process_group.default_group`: gloo on CPU,
NCCL on CUDA). This module adds what a lowcomm method is: a torch optimizer wrapping the user's,
its settings, checkpoints in lowcomm's run folder (sharded, resumable on another rank count) and
a :meth:`FSDP.finish` that leaves one plain model on every rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...errors import ArgumentError, ConfigError, LowcommError
from ...settings import Settings
from ..base import Strategy
from ..method import Context, Method
from ..buffers import Buffers

DTYPES = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: the torch releases whose FSDP2 internals this module was tested with (make test: 2.13.0,
#: make test-install: 2.14.1)
TESTED_TORCH = ("2.13", "2.14")
#: torch's private names this module relies on: FSDP2's default collectives (subclassed to charge
#: the ledger) and the registry keys of composable APIs (cleared by unshard_model)
INTERNALS = {
    "torch.distributed.fsdp._fully_shard._fsdp_collectives": ("DefaultAllGather", "DefaultReduceScatter"),
    "torch.distributed._composable.contract": ("REGISTRY_KEY", "STATE_KEY"),
    "torch.distributed._composable_state": ("_module_state_mapping",),
}


def internals_moved(what: str, problem: object) -> LowcommError:
    """The error for torch's FSDP2 internals that this torch does not have where lowcomm
    expects them (a torch release newer than :data:`TESTED_TORCH`)."""
    return LowcommError(f"fsdp needs torch's internal {what}, which torch {torch.__version__} "
                        f"does not have ({problem}); lowcomm's fsdp is tested with torch "
                        f"{' and '.join(TESTED_TORCH)}: use one of those, or shard with lowcomm's "
                        "own zero1/zero2 methods, which use no torch internals")


def torch_internal(module: str, *names: str) -> tuple:
    """``names`` from torch's private ``module`` (:data:`INTERNALS`), or :func:`internals_moved`'s
    error naming this torch's version."""
    import importlib
    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names)
    except (ImportError, AttributeError) as e:
        raise internals_moved(f"{module}.{'/'.join(names)}", e) from None


@dataclass
class FSDPSettings(Settings):
    """``[strategy]`` keys of ``fsdp``."""
    # the units sharded on their own before the whole model: "auto" = every block of every
    # nn.ModuleList (a transformer's layers), "none" = the model as one unit, or class names such
    # as "GPT2Block"; from Python also a callable module -> bool (see wrap_units). Names or a
    # callable that match no module are an error naming wrap
    wrap: str = "auto"
    reshard_after_forward: bool = True   # free gathered block parameters after forward
    param_dtype: str = ""       # mixed precision: the dtype forward/backward compute in ("": the parameters')
    reduce_dtype: str = ""      # the gradient reduce-scatter's dtype ("": param_dtype's)
    timeout_s: float = 300.0    # the torch.distributed group's limit for one collective

    def validate(self, prefix: str = "") -> None:
        self.one_of(prefix, "param_dtype", list(DTYPES))
        self.one_of(prefix, "reduce_dtype", list(DTYPES))
        self.within(prefix, "timeout_s", 0, float("inf"), low_open=True)
        if not self.wrap.strip():
            raise ConfigError.at(prefix, "wrap", "is empty; give \"auto\", \"none\" or module "
                                 "class names such as \"GPT2Block\"")


def wrap_units(model: torch.nn.Module, wrap, key: str = "wrap") -> list[torch.nn.Module]:
    """The modules ``fully_shard`` wraps on their own before the root (innermost first):

    * ``"auto"``: every block of every ``nn.ModuleList`` (a transformer's layers: GPT-2's
      ``transformer.h``, Llama's ``model.layers``); none where the model has no ModuleList
      (then the model is one unit);
    * ``"none"``: none (the model is one unit);
    * ``"A,B"``: every module whose class is named A or B (``"GPT2Block"``);
    * a callable (Python): every module ``m`` other than the root with ``wrap(m)`` true.

    A list of names or a callable that matches no module is an error naming ``key``."""
    subs = [m for m in model.modules() if m is not model]
    if callable(wrap):
        units = [m for m in subs if wrap(m)]
        what = f"the callable {getattr(wrap, '__name__', wrap)!r}"
    elif wrap == "auto":
        return [b for m in subs if isinstance(m, torch.nn.ModuleList) for b in m][::-1]
    elif wrap == "none":
        return []
    else:
        names = [n.strip() for n in str(wrap).split(",") if n.strip()]
        units = [m for m in subs if type(m).__name__ in names]
        what = f"{wrap!r}"
        missing = sorted(set(names) - {type(m).__name__ for m in units})
        if units and missing:
            raise ArgumentError(key, f"{', '.join(missing)} matches no module of "
                                f"{type(model).__name__}")
    if not units:
        kinds = sorted({type(m).__name__ for m in subs})
        raise ArgumentError(key, f"{what} matches no module of {type(model).__name__} (its "
                            f"module classes: {', '.join(kinds[:12]) or 'none'}); give class "
                            "names, \"auto\" or \"none\"")
    return units[::-1]        # pre-order reversed: a block's inner units before the block


class ShardOf:
    """One rank's shard of a parameter or optimizer tensor sharded on dim 0 (FSDP2's
    ``Shard(0)``), as checkpoints hold it: ``local`` (a plain tensor) and the full ``shape``."""

    def __init__(self, local: torch.Tensor, shape):
        self.local, self.shape = local, torch.Size(shape)

    def __repr__(self) -> str:
        return f"ShardOf({tuple(self.local.shape)} of {tuple(self.shape)})"


torch.serialization.add_safe_globals([ShardOf])    # checkpoints and heals load weights only


def _to_shards(tree):
    """A state dict with every DTensor replaced by this rank's :class:`ShardOf` (CPU copy)."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, DTensor):
        return ShardOf(tree.to_local().detach().cpu().clone(), tree.shape)
    if isinstance(tree, dict):
        return {k: _to_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_shards(v) for v in tree]
    return tree


def _from_shards(tree, mesh, device):
    """The inverse of :func:`_to_shards`: each :class:`ShardOf` as a DTensor on ``mesh``."""
    from torch.distributed.tensor import DTensor, Shard
    if isinstance(tree, ShardOf):
        stride = torch.empty(tree.shape, device="meta").stride()
        return DTensor.from_local(tree.local.to(device), mesh, [Shard(0)], run_check=False,
                                  shape=tree.shape, stride=stride)
    if isinstance(tree, dict):
        return {k: _from_shards(v, mesh, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_from_shards(v, mesh, device) for v in tree]
    return tree


def join_shards(values: list) -> object:
    """The whole state from every rank's (in rank order): each :class:`ShardOf` joined with the
    other ranks' (concatenated on dim 0), dicts key by key, anything else rank 0's."""
    if isinstance(values[0], ShardOf):
        return torch.cat([v.local for v in values], dim=0).view(values[0].shape)
    if isinstance(values[0], dict):
        return {k: join_shards([v[k] for v in values]) for k in values[0]}
    return values[0]


def charged_collectives(ledger, level: str, size: int):
    """FSDP2's all-gather and reduce-scatter (torch's default ones, set on each unit through
    ``set_custom_all_gather``/``set_custom_reduce_scatter``) that record every call in
    ``ledger`` under ``level``: the bandwidth-optimal bytes of the call
    (:func:`~lowcomm.comm.ledger.wire_bytes`) and the seconds the call itself took (an
    asynchronous call's later wait is not in them)."""
    import time

    from ...comm.ledger import wire_bytes
    DefaultAllGather, DefaultReduceScatter = torch_internal(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives", *INTERNALS[
            "torch.distributed.fsdp._fully_shard._fsdp_collectives"])

    def charge(op: str, t: torch.Tensor, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sent, recv = wire_bytes(op, t.numel() * t.element_size(), size)
        ledger.record(op, level, sent, recv, time.perf_counter() - t0)
        return out

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return charge("allgather.fsdp", input_tensor, super().__call__, output_tensor,
                          input_tensor, group, async_op)

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return charge("reduce_scatter.fsdp", input_tensor, super().__call__, output_tensor,
                          input_tensor, group, op, async_op)
    return AllGather(), ReduceScatter()


def fsdp_modules(model: torch.nn.Module) -> list:
    """The modules of ``model`` that ``fully_shard`` wrapped."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def charge_units(units: list, comm: Comm) -> None:
    """FSDP's all-gathers and reduce-scatters of ``units`` (over ``comm``'s ranks) charged to
    ``comm``'s ledger and level (:func:`charged_collectives`)."""
    for m in units:
        state = m._get_fsdp_state()
        if not hasattr(state, "_fsdp_param_group"):
            raise internals_moved("FSDPState._fsdp_param_group", "no such attribute")
        if state._fsdp_param_group is not None:
            gather, scatter = charged_collectives(comm.ledger, comm.level, comm.size)
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)


def check(s: FSDPSettings, cfg, prefix: str) -> None:
    """Before MPI starts: FSDP shards inside a datacenter, never across one (a level whose
    links' latency is a WAN's, ≥ 1 ms: ``dc`` unless the topology says otherwise). An outer
    loop above it keeps each rank's shard (:meth:`FSDP.local_shards`), in one MPI job or in a
    fleet (each rank averaging its chunks with rank i of the other datacenters)."""
    from ...comm.topology import Topology
    if not cfg.topology:
        return
    topo = Topology.parse(cfg.topology)
    policy = dict(getattr(cfg, "policy", {}) or {})
    if not policy:                       # one method over the whole topology
        spanned = [lvl for lvl in topo.names[:-1] if len(topo.units(lvl)) > 1]
        levels = [(lvl, "strategy.name") for lvl in spanned]
    else:
        first = next(i for i, lvl in enumerate(topo.names) if str(policy.get(lvl, "syncdp"))
                     .split(":")[0].strip() == "fsdp")
        levels = [(lvl, f"policy.{lvl}") for lvl in topo.names[first:-1]]
    for lvl, key in levels:
        if topo.link(lvl).alpha_s >= 1e-3:
            raise ConfigError(key, f"fsdp would shard across the {lvl!r} level, a wide-area "
                              f"link ({topo.link(lvl)}): every forward and backward would "
                              "all-gather parameters over it. Shard inside a datacenter "
                              "(policy.rank=fsdp) with an outer loop between datacenters")


def _checked(model, optimizer) -> tuple[dict, torch.device]:
    """Before anything is changed: each parameter's name by id and the model's one device; an
    error naming the argument where FSDP cannot take them."""
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError("optimizer", f"must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
    if optimizer.state:
        raise ArgumentError("optimizer", f"{type(optimizer).__name__} holds state already (it "
                            "has stepped): FSDP shards the optimizer state; wrap a fresh one")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ArgumentError("model", f"FSDP needs the model's parameters on one device, found "
                            f"{sorted(map(str, devices)) or 'none'}")
    names = {id(p): n for n, p in model.named_parameters()}
    strangers = [(i, p) for i, g in enumerate(optimizer.param_groups)
                 for p in g["params"] if id(p) not in names]
    if strangers:
        i, p = strangers[0]
        raise ArgumentError("optimizer", f"param group {i} holds a tensor of shape "
                            f"{tuple(p.shape)} that is not a parameter of the model: FSDP shards "
                            "the model's parameters only")
    return names, devices.pop()


def build(s: FSDPSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    return FSDP(model, optimizer, comm, settings=s)


METHOD = Method("fsdp", FSDPSettings, build,
                "fully sharded data parallelism (ZeRO-3) through torch's FSDP2 fully_shard",
                check=check, level=True, shards_around=("tp", "pp"), python="FSDP")


class FSDP(Strategy):
    """Fully sharded data parallelism: torch FSDP2 (``fully_shard``) behind lowcomm's method
    interface (ZeRO-3: Rajbhandari et al. 2019, arXiv 1910.02054; FSDP: Zhao et al. 2023,
    arXiv 2304.11277).

    Construction, on every rank of ``comm`` together:
      1. rank 0's parameters and buffers are broadcast (the ranks start from one model);
      2. torch.distributed's default group is made over ``comm``'s ranks (gloo on CPU, NCCL on
         CUDA) and a 1-D device mesh over it; FSDP's all-gathers and reduce-scatters are
         charged to ``comm``'s ledger (:func:`charged_collectives`);
      3. ``fully_shard`` wraps each unit of ``wrap`` (:func:`wrap_units`), innermost first, then
         the root: every parameter becomes a DTensor of which this rank holds the dim-0 chunk;
      4. the wrapped optimizer's ``param_groups`` are pointed at the sharded parameters (the
         same group dicts, so LR schedulers keep working): its state is made per shard, 1/K.

    Per step t:
      1. forward: each unit all-gathers its parameters before it runs (and frees them after,
         ``reshard_after_forward``); backward gathers them again, and reduce-scatters each
         unit's gradients as they are made: ``p.grad`` is this rank's chunk of ``(1/K) Σ_k g_k``
         (a DTensor; ``clip_grad_norm_`` on it computes the global norm);
      2. ``step()``: the wrapped optimizer updates this rank's chunk;
      3. persistent buffers (BatchNorm's statistics) become rank 0's, as SyncDP's do.

    :meth:`finish` gathers every parameter and removes FSDP from the model: a plain module with
    the full parameters, the same on every rank. Checkpoints hold each rank's shards
    (:meth:`state_dict`, :meth:`model_state_dict`, via ``torch.distributed.checkpoint``'s
    state-dict API); :meth:`reshard` rebuilds the full tensors from every old rank's shards to
    resume on another rank count.

    Args:
        model, optimizer: the user's torch objects (sharded in place; build the optimizer on
            ``model.parameters()`` before wrapping, with no state yet).
        comm: the ranks that shard (default: world).
        settings: a validated :class:`FSDPSettings`; otherwise its fields as keyword arguments
            (``wrap`` may also be a callable ``module -> bool``).

    Example::

        opt = FSDP(model, torch.optim.AdamW(model.parameters()), wrap="GPT2Block")
        loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    """

    name = "fsdp"
    lockstep = True
    #: the model's forward is a collective (parameters are gathered in it) until finish()
    collective_forward = True
    shards_model = True
    Settings = FSDPSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: FSDPSettings | None = None, **options):
        wrap = options.pop("wrap", None) if callable(options.get("wrap")) else None
        names, self.device = _checked(model, optimizer)
        for module, private in INTERNALS.items():      # before anything changes: this torch has them
            torch_internal(module, *private)
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s = self.settings
        units = wrap_units(model, wrap if wrap is not None else s.wrap)
        self.buffers = Buffers(model)
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        self.mesh = self._mesh(s)
        self._shard(model, units, s)
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]

    def _mesh(self, s: FSDPSettings):
        from torch.distributed.device_mesh import DeviceMesh

        from ...comm.process_group import default_group
        group = default_group(self.comm, self.device, s.timeout_s, holder=self)
        # the mesh over that group itself: init_device_mesh makes a further group where a GPU
        # is visible and the group is gloo (FSDP on CPU tensors on a GPU machine), whose name
        # torch 2.11 could no longer resolve once an earlier group had been replaced
        return DeviceMesh.from_group(group, self.device.type)

    def _shard(self, model, units, s: FSDPSettings) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[s.param_dtype],
                                  reduce_dtype=DTYPES[s.reduce_dtype or s.param_dtype])
        for unit in units:
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=s.reshard_after_forward,
                        mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        charge_units(fsdp_modules(self.model), self.comm)   # FSDP's traffic in the ledger

    def _fsdp_modules(self) -> list:
        return fsdp_modules(self.model)

    # the optimizer interface ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate unsharded local gradients (no reduce-scatter);
        the next backward outside reduces them."""
        units = self._fsdp_modules()
        for m in units:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in units:
                m.set_requires_gradient_sync(True, recurse=False)

    def _step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.buffers.broadcast(self.comm)
        return loss

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's chunk of every parameter (``DTensor.to_local()``: views, by name)."""
        from torch.distributed.tensor import DTensor
        return {n: p.to_local() for n, p in self.model.named_parameters()
                if isinstance(p, DTensor)}

    # checkpoints --------------------------------------------------------------------------------
    def model_state_dict(self) -> dict:
        """The model's state as this rank holds it: :class:`ShardOf` each parameter, buffers whole."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return _to_shards(get_model_state_dict(self.model))

    def full_model_state_dict(self) -> dict:
        """The whole model's state dict on rank 0 (CPU), {} elsewhere; collective: every rank
        calls it (the parameters are gathered)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                        cpu_offload=True))

    def load_model_state_dict(self, state: dict) -> None:
        """Load :meth:`model_state_dict`'s shards, or full tensors (:meth:`reshard`'s)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        full = not any(isinstance(v, ShardOf) for v in state.values())
        set_model_state_dict(self.model, _from_shards(state, self.mesh, self.device),
                             options=StateDictOptions(full_state_dict=full))

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's shards, keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        fresh = not self.optimizer.state
        with self.guard.own_step():       # (as in load_state_dict)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:       # torch made the state with a step at lr 0 (Adam's count 1): undone
            self.optimizer.state.clear()
            optimizer["state"] = {}
        return {"optimizer": _to_shards(optimizer),
                "method": self.name, "world_size": self.comm.size}

    def _load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)
        if state.get("method") != self.name:
            raise LowcommError(f"the checkpoint's strategy state was written by "
                               f"{state.get('method', 'another method')!r}, not fsdp (a "
                               "checkpoint of one method cannot resume another)")
        full = state["world_size"] != self.comm.size
        with self.guard.own_step():       # torch makes empty state with a step of the optimizer
            set_optimizer_state_dict(self.model, self.optimizer,
                                     _from_shards(state["optimizer"], self.mesh, self.device),
                                     options=StateDictOptions(full_state_dict=full))
        if not state["optimizer"]["state"]:     # written before the first step: none yet
            self.optimizer.state.clear()

    def reshard(self, old: list[dict]) -> dict:
        """From every old rank's shards, the full model and optimizer state (exact
        concatenations), which :meth:`load_model_state_dict` and :meth:`load_state_dict`
        shard for this rank count."""
        bad = [r for r, s in enumerate(old) if s["strategy"].get("method") != self.name]
        if bad:
            raise LowcommError(f"old rank {bad[0]}'s strategy state was not written by fsdp")
        return {"model": join_shards([s["model"] for s in old]),
                "strategy": {"optimizer": join_shards([s["strategy"]["optimizer"] for s in old]),
                             "method": self.name, "world_size": len(old)}}

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Leave the plain model with the full parameters on every rank; the torch.distributed
        group stays (for a later FSDP on the same ranks; one on other ranks replaces it)."""
        from ...comm.process_group import release
        unshard_model(self.model, self._fsdp_modules())
        release(self)


def unshard_model(model: torch.nn.Module, units: list) -> None:
    """Remove FSDP2 from ``model`` in place (collective over its mesh): every DTensor parameter
    becomes an ``nn.Parameter`` holding the full tensor (``full_tensor()``, shared parameters
    stay shared), FSDP's hooks are removed and each module gets its own class back."""
    from torch.distributed.tensor import DTensor
    REGISTRY_KEY, STATE_KEY = torch_internal("torch.distributed._composable.contract",
                                             "REGISTRY_KEY", "STATE_KEY")
    for m in units:
        m.reshard()                              # registered parameters: the sharded DTensors
    full: dict[int, torch.nn.Parameter] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if isinstance(p, DTensor) and id(p) not in full:
                full[id(p)] = torch.nn.Parameter(p.full_tensor().detach().clone(),
                                                 requires_grad=p.requires_grad)
    for m in units:
        _unhook(m)
        m.__class__ = type(m).__mro__[getattr(type(m), "_orig_cls_mro_index", 2)]
        for key in (STATE_KEY, REGISTRY_KEY):
            m.__dict__.pop(key, None)
    for m in model.modules():
        for k in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            m.__dict__.pop(k, None)
        for n, p in list(m._parameters.items()):
            if id(p) in full:
                m._parameters[n] = full[id(p)]


def _unhook(m) -> None:
    """Remove the forward and state-dict hooks FSDP2's state put on ``m`` (private attributes of
    FSDP2's state: :func:`internals_moved`'s error where this torch has others)."""
    (mapping,) = torch_internal("torch.distributed._composable_state", "_module_state_mapping")
    state = m._get_fsdp_state()
    try:
        hooks = [state._pre_forward_hook_handle, state._post_forward_hook_handle]
        groups = getattr(state, "_fsdp_param_groups", None)       # torch < 2.13: one group
        groups = [g for g in (groups if groups is not None else [state._fsdp_param_group])
                  if g is not None]
        tables = [table for group in groups
                  for table in (group._module_to_pre_save_state_dict_hook_handle,
                                group._module_to_pre_load_state_dict_hook_handle)]
        # each parameter's post-load hook (it would re-shard what load_state_dict loads)
        hooks += [fp._post_load_hook_handle for g in groups for fp in g.fsdp_params]
    except AttributeError as e:
        raise internals_moved("FSDPState's hook handles", e) from None
    for h in hooks:
        h.remove()
    for handles in tables:
        for h in handles.values():
            h.remove()
        handles.clear()
    mapping.pop(m, None)


__all__ = ["FSDP", "FSDPSettings", "INTERNALS", "METHOD", "ShardOf", "TESTED_TORCH",
           "charge_units", "charged_collectives", "check", "fsdp_modules", "internals_moved",
           "join_shards", "torch_internal", "unshard_model", "wrap_units"]
