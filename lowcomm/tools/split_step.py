"""The model-parallel rows of ``lowcomm bench step``: ``pp`` (torch's 1F1B schedule),
``pp-gpipe`` (GPipe) and ``tp`` (Megatron's column/row split), each over every rank of the run.

A row's model is built as ``lowcomm train`` builds it (a pipeline's stages alone, from the meta
device) from the same seed as the data-parallel rows'; its ranks share one batch (one pipeline,
or one split model), so a step moves 1/K of the tokens a data-parallel step moves on K ranks.
A pipeline row adds its measured bubble — 1 − the stages' compute time over the schedule's
wall-clock, the mean over ranks (:meth:`~lowcomm.parallel.pipeline.PipelineParallel.metrics`) —
beside the schedule's formula, (P−1)/(M+P−1) (Huang et al. 2019, arXiv 1811.06965; Narayanan
et al. 2021, arXiv 2104.04473).
"""
from __future__ import annotations

import torch

from ..comm.comm import Comm

#: the rows and their specs (the run's ``[strategy]`` keys fill the rest: ``microbatches``)
STEP_SPLIT = {"pp": "pp", "pp-gpipe": "pp:schedule=GPipe", "tp": "tp"}


def split_row(name: str, run: Comm, task, cfg, row_cls):
    """Row ``name`` of :data:`STEP_SPLIT` as a ``row_cls`` (bench's step row), ready to step."""
    from ..run.loop import build_model
    from ..run.registry import build_strategy
    from ..run.schedule import build_optimizer
    from ..strategies.method import Context
    from .memory_bench import method_config
    spec = STEP_SPLIT[name]
    base = {k: v for k, v in cfg.strategy.items() if k == "microbatches"}
    rcfg = method_config(cfg, spec)
    rcfg.strategy = {**rcfg.strategy, **base}
    torch.manual_seed(cfg.seed)
    model = build_model(task, rcfg)
    params = sum(p.numel() for p in model.parameters())
    opt = build_strategy(rcfg, model, build_optimizer(cfg, model.parameters()), run,
                         Context(criterion=task.criterion_fn, split=task.split_fn))
    return row_cls(name, params, opt, None, opt.close,
                   run=lambda b: opt.forward_backward(task.loss, b), place=opt.batch_place(),
                   extra=lambda ctl: {k: v for k, v in opt.metrics(ctl, final=True).items()
                                      if k.startswith("pp_bubble")})


__all__ = ["STEP_SPLIT", "split_row"]
