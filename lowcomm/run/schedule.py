"""The run's inner optimizer and its learning-rate schedule (a function of the step alone)."""
from __future__ import annotations

import math

import torch

from .optimizers import build_optimizer


def lr_at(cfg, step: int) -> float:
    """The (inner) optimizer's lr at ``step`` (1-based): a linear warm-up over
    ``optimizer.warmup_steps`` steps (Goyal et al. 2017, arXiv 1706.02677), then ``lr`` constant
    or, for ``schedule = "cosine"``, SGDR's cosine without restarts (Loshchilov & Hutter 2017,
    arXiv 1608.03983) from ``lr`` down to ``min_lr_ratio · lr`` at the last step:
    ``lr_t = lr · (r + (1 − r) · ½(1 + cos(π · (t − W) / (T − W))))``.
    A function of the step alone, so a resumed run sets the same lr without saved state."""
    o = cfg.optimizer
    if step <= o.warmup_steps:
        return cfg.lr * step / o.warmup_steps
    if o.schedule == "constant":
        return cfg.lr
    progress = (step - o.warmup_steps) / (cfg.steps - o.warmup_steps)   # warmup < steps
    r = o.min_lr_ratio
    return cfg.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


__all__ = ["build_optimizer", "lr_at", "set_lr"]
