"""torch's Adam as the compressed Adams read it: which optimizers qualify, and a parameter's
moments made as torch makes them."""
from __future__ import annotations

import torch


def torch_adam(optimizer: torch.optim.Optimizer, method: str) -> bool:
    """Check that ``optimizer`` is a plain torch ``Adam`` or ``AdamW`` (no amsgrad, no
    maximize), which ``method`` steps or reads the moments of; returns whether its weight decay
    is decoupled (AdamW)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(f"{method} wraps torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    for i, g in enumerate(optimizer.param_groups):
        for opt in ("amsgrad", "maximize"):
            if g.get(opt):
                raise ValueError(f"{method} does not support {opt}=True (param group {i})")
    return type(optimizer) is torch.optim.AdamW


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """Adam's state of ``p``, made as torch Adam makes it where Adam has not stepped ``p``
    (no gradient yet)."""
    st = optimizer.state[p]
    if "step" not in st:
        st["step"] = torch.tensor(0.0)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


__all__ = ["adam_state", "torch_adam"]
