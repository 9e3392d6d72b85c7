"""Tensor-parallel plans: which module of a model is split how (Megatron-LM's column and row
splits, Shoeybi et al. 2019, arXiv 1909.08053; sequence parallelism of the norm regions,
Korthikanti et al. 2022, arXiv 2205.05198), as torch's own parallel styles
(:mod:`torch.distributed.tensor.parallel`) keyed by module name.

In a transformer block on T ranks the attention's query/key/value projection and the MLP's first
layer are split by output features (:class:`Colwise`: each rank computes H/T heads, F/T hidden
units), the attention's output projection and the MLP's second layer by input features
(:class:`Rowwise`: each rank's partial product, summed by an all-reduce). One all-reduce of the
block's activations per forward sub-layer, one per backward. Sequence parallelism
(``sequence=True``) cuts the LayerNorms' (and dropout's) region by sequence position instead of
replicating it: the all-reduce becomes a reduce-scatter after the row split and an all-gather
before the column split (same bytes, activations 1/T per rank).

torch's styles take ``nn.Linear`` and ``nn.Embedding``; :class:`Colwise` and :class:`Rowwise`
also take transformers' ``Conv1D`` (GPT-2's layers: weight stored (in, out)) and a fused
projection of ``parts`` equal outputs (GPT-2's and lowcomm's GPT's query/key/value in one
matrix): each rank holds the r-th T-th of each part, so its local output is again
[q_r, k_r, v_r]. A plan is a :class:`Plan`; :func:`plan_for` builds the built-in families'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, partial

import torch
from torch import nn

from ..errors import ConfigError
from .chains import GPT2Chain, LlamaChain, TinyGPTChain, blocks_of, chain_for


def _conv1d_type():
    """transformers' ``Conv1D`` (a linear layer whose weight is stored (in, out)), or None."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def local_part(full: torch.Tensor, dim: int, parts: int, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` split ``degree`` ways on ``dim``: of each of ``parts``
    equal consecutive parts (a fused projection's q, k, v) its ``rank``-th chunk, concatenated."""
    return torch.cat([p.chunk(degree, dim)[rank] for p in full.chunk(parts, dim)], dim)


def join_parts(pieces: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of :func:`local_part` over every rank's piece (in rank order)."""
    split = [p.chunk(parts, dim) for p in pieces]
    return torch.cat([torch.cat([s[j] for s in split], dim) for j in range(parts)], dim)


class Split:
    """What :class:`Colwise` and :class:`Rowwise` share: the module kinds they take and how a
    parameter is cut (``dims``: parameter name -> the sharded dim, or None: replicated)."""

    parts = 1

    def _dims(self, module: nn.Module) -> dict[str, int | None]:
        raise NotImplementedError

    def _partition(self, name, module, mesh):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        T, r = mesh.size(), mesh.get_local_rank()
        for pname, dim in self._dims(module).items():
            param = getattr(module, pname, None)
            if param is None:
                continue
            if dim is None:
                local, placement = param.detach(), Replicate()
            else:
                local, placement = local_part(param.detach(), dim, self.parts, T, r), Shard(dim)
            dt = DTensor.from_local(local.contiguous(), mesh, [placement], run_check=False,
                                    shape=param.shape, stride=param.stride())
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _kind(self, module: nn.Module) -> str:
        conv = _conv1d_type()
        if isinstance(module, nn.Linear):
            return "linear"
        if conv is not None and isinstance(module, conv):
            return "conv1d"
        if isinstance(module, nn.Embedding):
            return "embedding"
        raise ConfigError("plan", f"{type(self).__name__} splits nn.Linear, transformers' Conv1D "
                          f"and nn.Embedding, not {type(module).__name__}")

    def _distribute(self, module, mesh, desired):
        from torch.distributed.tensor import distribute_module
        return distribute_module(
            module, mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, desired),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


@cache
def _column_style():
    from torch.distributed.tensor.parallel import ColwiseParallel

    class Colwise(Split, ColwiseParallel):
        """torch's ``ColwiseParallel`` (output features split), also for ``Conv1D`` and for a
        fused projection of ``parts`` equal outputs (module docstring)."""

        def __init__(self, *, parts: int = 1, **layouts):
            super().__init__(**layouts)
            self.parts = parts

        def _dims(self, module):
            kind = self._kind(module)
            return {"weight": 1 if kind in ("conv1d", "embedding") else 0, "bias": 0}

        def _apply(self, module, device_mesh):
            self._kind(module)
            return self._distribute(module, device_mesh, self.desired_input_layouts)
    return Colwise


@cache
def _row_style():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    class Rowwise(Split, RowwiseParallel):
        """torch's ``RowwiseParallel`` (input features split; the partial outputs summed), also
        for ``Conv1D``."""

        def _dims(self, module):
            kind = self._kind(module)
            return {"weight": 0 if kind in ("conv1d", "embedding") else 1, "bias": None}

        def _apply(self, module, device_mesh):
            kind = self._kind(module)
            desired = (Replicate(),) if kind == "embedding" else (Shard(-1),)
            self.desired_input_layouts = desired
            return self._distribute(module, device_mesh, desired)
    return Rowwise


def Colwise(**kw):
    """A column (output-feature) split: :func:`_column_style`'s style."""
    return _column_style()(**kw)


def Rowwise(**kw):
    """A row (input-feature) split: :func:`_row_style`'s style."""
    return _row_style()(**kw)


@dataclass
class Plan:
    """A tensor-parallel plan: torch parallel styles by module name (``styles``, what
    ``parallelize_module`` takes), attributes to set to their T-th once split (``local``:
    ``"module.attr" -> full value``, e.g. GPT-2's ``split_size``), the sizes T must divide
    (``divides``: what -> size); under sequence parallelism (``sequence``) the module whose
    input's positions T must divide (``first``: the first block)."""
    styles: dict
    local: dict = field(default_factory=dict)
    divides: dict = field(default_factory=dict)
    sequence: bool = False
    first: str = ""

    def check(self, degree: int, key: str) -> None:
        bad = {w: n for w, n in self.divides.items() if n % degree}
        if bad:
            what = ", ".join(f"{w} = {n}" for w, n in bad.items())
            raise ConfigError(key, f"tensor parallelism over {degree} ranks splits {what}: "
                              f"{degree} does not divide it; use a degree that does")


def _sp(on: bool):
    """The layouts around a block's norm region: (into the column split, out of the row split)."""
    from torch.distributed.tensor import Shard
    return ({"input_layouts": Shard(1)}, {"output_layouts": Shard(1)}) if on else ({}, {})


def _gather_before(**kw):
    """All-gather a module's (sequence-split) input: a sub-layer's, once for all its splits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput
    if kw.get("kwarg"):
        return PrepareModuleInput(input_kwarg_layouts={kw["kwarg"]: Shard(1)},
                                  desired_input_kwarg_layouts={kw["kwarg"]: Replicate()},
                                  use_local_output=True)
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=True)


def _ends(first_block: str, final_norm: str, positional: int = 1) -> dict:
    """Sequence parallelism's ends: the first block's input cut by position (no traffic), the
    final norm's input gathered (the head runs replicated). A block takes ``positional``
    arguments, the hidden states first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput
    rest = (None,) * (positional - 1)
    return {first_block: PrepareModuleInput(input_layouts=(Replicate(), *rest),
                                            desired_input_layouts=(Shard(1), *rest),
                                            use_local_output=True),
            final_norm: _gather_before()}


def _norms(prefix: str, names: tuple[str, ...]) -> dict:
    from torch.distributed.tensor.parallel import SequenceParallel
    return {f"{prefix}.{n}": SequenceParallel(use_local_output=True) for n in names}


def tinygpt_plan(model: nn.Module, sequence: bool) -> Plan:
    """lowcomm's GPT: the fused ``qkv`` and ``mlp.0`` by columns, ``proj`` and ``mlp.2`` by rows."""
    into, out = _sp(sequence)
    styles: dict = _ends("blocks.0", "ln") if sequence else {}
    blocks = list(model.blocks)
    if not all(isinstance(b.mlp, nn.Sequential) for b in blocks):
        raise ConfigError("plan", "the built-in plan for lowcomm's GPT splits each block's dense "
                          f"MLP (mlp.0, mlp.2); this model's blocks have a "
                          f"{type(blocks[0].mlp).__name__} (the MoE task's experts): pass a "
                          "plan of your own, or train it without tp")
    for i, _ in enumerate(blocks):
        p = f"blocks.{i}"
        styles.update({f"{p}.qkv": Colwise(parts=3, **into), f"{p}.proj": Rowwise(**out),
                       f"{p}.mlp.0": Colwise(**into), f"{p}.mlp.2": Rowwise(**out)})
        if sequence:
            styles.update(_norms(p, ("ln1", "ln2")))
    b = blocks[0]
    return Plan(styles, divides={"heads": b.heads, "the MLP's width": b.mlp[0].out_features},
                sequence=sequence, first="blocks.0")


def gpt2_plan(model: nn.Module, sequence: bool) -> Plan:
    """transformers' GPT-2: ``c_attn`` (q, k, v fused) and ``mlp.c_fc`` by columns, the two
    ``c_proj`` by rows; each attention's ``split_size`` becomes its T-th."""
    cfg, (_, out) = model.config, _sp(sequence)
    # (GPT2Model calls a block with 4 positional arguments)
    styles: dict = _ends("transformer.h.0", "transformer.ln_f", 4) if sequence else {}
    local = {}
    for i in range(len(model.transformer.h)):
        p = f"transformer.h.{i}"
        styles.update({f"{p}.attn.c_attn": Colwise(parts=3), f"{p}.attn.c_proj": Rowwise(**out),
                       f"{p}.mlp.c_fc": Colwise(), f"{p}.mlp.c_proj": Rowwise(**out)})
        if sequence:
            styles.update({**_norms(p, ("ln_1", "ln_2")), f"{p}.attn": _gather_before(),
                           f"{p}.mlp": _gather_before()})
        local[f"{p}.attn.split_size"] = model.get_submodule(f"{p}.attn").split_size
    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
    return Plan(styles, local, {"heads (n_head)": cfg.n_head, "the MLP's width": inner},
                sequence, "transformer.h.0")


def llama_plan(model: nn.Module, sequence: bool) -> Plan:
    """transformers' Llama (Mistral, Qwen2): ``q/k/v_proj``, ``gate/up_proj`` by columns,
    ``o_proj`` and ``down_proj`` by rows."""
    cfg, _, out = model.config, *_sp(sequence)
    styles: dict = _ends("model.layers.0", "model.norm") if sequence else {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        styles.update({f"{p}.self_attn.{n}": Colwise() for n in ("q_proj", "k_proj", "v_proj")})
        styles.update({f"{p}.mlp.{n}": Colwise() for n in ("gate_proj", "up_proj")})
        styles.update({f"{p}.self_attn.o_proj": Rowwise(**out), f"{p}.mlp.down_proj": Rowwise(**out)})
        if sequence:
            styles.update({**_norms(p, ("input_layernorm", "post_attention_layernorm")),
                           f"{p}.self_attn": _gather_before(kwarg="hidden_states"),
                           f"{p}.mlp": _gather_before()})
    kv = cfg.num_key_value_heads or cfg.num_attention_heads
    return Plan(styles, divides={"heads (num_attention_heads)": cfg.num_attention_heads,
                                 "key/value heads (num_key_value_heads)": kv,
                                 "the MLP's width (intermediate_size)": cfg.intermediate_size},
                sequence=sequence, first="model.layers.0")


PLANS = {TinyGPTChain: tinygpt_plan, GPT2Chain: gpt2_plan, LlamaChain: llama_plan}


def plan_for(model: nn.Module, sequence: bool = False) -> Plan:
    """The built-in plan of ``model``'s family (lowcomm's GPT, GPT-2, Llama-shaped models);
    a :class:`~lowcomm.errors.ConfigError` naming ``plan`` for any other model."""
    try:
        chain = chain_for(model)
    except Exception:
        chain = None
    make = PLANS.get(type(chain))
    if make is None:
        raise ConfigError("plan", f"tp has no built-in plan for {type(model).__name__} (built in: "
                          "lowcomm's GPT, transformers' GPT-2 and Llama-shaped models); pass "
                          "plan= a lowcomm.parallel.plans.Plan or a dict of torch parallel "
                          "styles by module name")
    blocks_of(model, chain)
    return make(model, sequence)


__all__ = ["Colwise", "Plan", "Rowwise", "Split", "join_parts", "local_part", "plan_for"]
