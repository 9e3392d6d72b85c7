"""A mixture-of-experts task: the built-in byte-level GPT (:class:`~lowcomm.tasks.tinygpt.TinyGPT`)
with every block's MLP a :class:`~lowcomm.parallel.experts.MoE` layer (Switch Transformer,
Fedus et al. 2021, arXiv 2101.03961; GShard, Lepikhin et al. 2020, arXiv 2006.16668), on the
built-in task's text.

Select it with ``--set task=lowcomm.tasks.moe``; its ``[task]`` options are
:class:`~lowcomm.parallel.experts.MoESettings`' (``task.experts``, ``task.top_k``,
``task.capacity_factor``, ``task.hidden``, ``task.aux_coef``); the model's size and the data are
the built-in task's ``[model]`` and ``[data]`` tables. The loss is the next-byte cross-entropy
plus ``aux_coef`` × the load-balancing loss of every MoE layer. Under a data-parallel method
every rank holds every expert; ``ep`` (:mod:`lowcomm.parallel.ep`) spreads them over the ranks
of a level. There is no ``criterion``: a pipeline (``pp``)
computes the loss from the last stage's output alone and would leave the load-balancing loss
out, so pp refuses this task.
"""
from __future__ import annotations

import torch

from ..parallel.experts import MoE, MoESettings, aux_loss
from . import bytelm
from .tinygpt import MODELS


def settings(cfg) -> MoESettings:
    """The MoE layers' settings from the ``[task]`` table (errors name ``task.<key>``)."""
    return MoESettings.from_options(cfg.task.options, "task.", "the MoE task")


def model(cfg) -> torch.nn.Module:
    s, m = settings(cfg), cfg.model
    if m.name != "tinygpt":
        raise ValueError(f"model.name {m.name!r}: the MoE task builds {', '.join(MODELS)} only")
    return MODELS[m.name](cfg.data.seq_len, m.d_model, m.n_layers, m.n_heads,
                          mlp=lambda d: MoE(d, settings=s))


def loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Next-byte cross-entropy + Σ over the MoE layers of aux_coef × E · Σ_i f_i · P_i."""
    x, y = batch
    return bytelm.criterion(model(x), y) + aux_loss(model)


batch = bytelm.batch
eval_batches = bytelm.eval_batches
tokens = bytelm.tokens
describe = bytelm.describe
