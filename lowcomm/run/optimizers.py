"""The run's inner optimizer: any optimizer torch ships, named in the config, and Muon with an
AdamW group for the parameters that are not matrices.

``optimizer.name`` is a ``torch.optim`` class name in lower case (``sgd``, ``adam``, ``adamw``,
``muon``, ``nadam``, ``radam``, ``rmsprop``, …; :data:`OPTIMIZERS`). The run's keys reach the
constructor where it takes them: ``lr``; ``optimizer.weight_decay``; ``optimizer.beta1``/``beta2``
as ``betas`` (unused by an optimizer without betas); ``optimizer.momentum`` (unset: the
optimizer's own default; set non-zero for an optimizer without momentum: an error). Any other
constructor argument goes in ``[optimizer.options]`` (``--set optimizer.options.ns_steps=6``),
checked against the constructor's signature. Unknown names and keys are
:class:`~lowcomm.errors.ConfigError` naming the key, before any rank starts.

``muon`` builds :class:`MuonAdamW`: torch's Muon takes 2-D parameters only (hidden-layer
matrices); everything else (biases, LayerNorm gains, convolution kernels) is stepped by AdamW,
as in the Muon write-up (Jordan et al. 2024) and torch's own Muon example. From the config both
groups share ``lr`` and ``weight_decay``, and Muon's ``adjust_lr_fn`` defaults to
``"match_rms_adamw"`` (Liu et al. 2025, arXiv 2502.16982: the update's RMS scaled to AdamW's,
so that one learning rate serves both groups) unless the options name another.
"""
from __future__ import annotations

import inspect

import torch

from ..errors import ConfigError


class MuonAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks";
    torch's ``torch.optim.Muon``) on the 2-D parameters, AdamW (Loshchilov & Hutter 2019,
    arXiv 1711.05101) on the others, as one ``torch.optim.Optimizer``.

    Update, per step, for the gradients g:

      1. every 2-D parameter W: ``torch.optim.Muon``'s step (momentum B ← μB + g, Nesterov
         B̃ = g + μB, O = Newton–Schulz(B̃), W ← W(1 − lr·λ) − lr'·O with lr' Muon's
         shape-adjusted lr);
      2. every other parameter (1-D, 0-D, more than 2-D): ``torch.optim.AdamW``'s step.

    Each step is the torch optimizer's own, on the same group dicts and state: an LR scheduler's
    ``param_groups[i]["lr"]`` reaches the optimizer that steps the group, ``state_dict()``
    saves both, and a lowcomm method wraps it as it wraps any torch optimizer. Group 0 is
    Muon's (when there are matrices), then AdamW's; each group's ``"algorithm"`` says which.

    Args:
        params: parameters (an iterable of tensors).
        lr, weight_decay: both groups' learning rate and decoupled weight decay.
        betas, eps: AdamW's.
        **muon: further arguments of ``torch.optim.Muon`` (momentum, nesterov, ns_steps,
            ns_coefficients, eps as ``muon_eps``, adjust_lr_fn).

    Example::

        opt = MuonAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        opt = lowcomm.DiLoCo(model, opt, period=50)          # MuLoCo: DiLoCo with Muon inside
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, **muon):
        params = list(params)
        if not params:
            raise ValueError("MuonAdamW got no parameters")
        if any(isinstance(p, dict) for p in params):
            raise TypeError("MuonAdamW splits plain parameters by shape itself; give it tensors, "
                            "not parameter groups")
        if "muon_eps" in muon:
            muon["eps"] = muon.pop("muon_eps")
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        parts = []
        if matrices:
            parts.append(("muon", torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, **muon)))
        if others:
            parts.append(("adamw", torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps,
                                                     weight_decay=weight_decay)))
        self._parts = [opt for _, opt in parts]
        groups = [dict(opt.param_groups[0], algorithm=name) for name, opt in parts]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self._link()

    def _link(self) -> None:
        """The parts read this optimizer's group dicts and state (after construction and after
        ``load_state_dict``, which replaces both)."""
        for opt, group in zip(self._parts, self.param_groups, strict=True):
            opt.param_groups = [group]
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._parts:
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


#: optimizers whose step does not fit a training loop that calls ``step()`` once per batch
UNSUITED = {"lbfgs": "needs a closure that re-evaluates the loss at every step",
            "sparseadam": "takes sparse gradients only"}


def _classes() -> dict[str, type]:
    out = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and \
                cls is not torch.optim.Optimizer and name.lower() not in UNSUITED:
            out[name.lower()] = cls
    return dict(sorted(out.items()))


#: ``optimizer.name`` -> the torch optimizer class (``muon``: :class:`MuonAdamW`)
OPTIMIZERS: dict[str, type] = {**_classes(), "muon": MuonAdamW}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments of ``cls``'s constructor (for ``muon``: Muon's and AdamW's)."""
    if cls is MuonAdamW:
        own = dict(inspect.signature(MuonAdamW.__init__).parameters)
        muon = dict(inspect.signature(torch.optim.Muon.__init__).parameters)
        muon["muon_eps"] = muon.pop("eps")
        params = {**muon, **own}
    else:
        params = dict(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in params.items() if k not in ("self", "params")
            and v.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}


#: keys of the ``[optimizer]`` table that are the run's, with the constructor argument each sets
RUN_KEYS = {"lr": "lr", "weight_decay": "optimizer.weight_decay", "betas": "optimizer.beta1/beta2",
            "momentum": "optimizer.momentum"}


def _option(key: str, value, default):
    """``value`` for a constructor argument whose default is ``default``: a list becomes a tuple
    (TOML has no tuples), and the type must match a bool/number/tuple default."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, tuple) and len(value) == len(default)
    else:                            # None, str, or no default: the constructor checks it
        ok = True
    if not ok:
        raise ConfigError(key, f"expects a value like the default {default!r}, got {value!r}")
    return value


def optimizer_kwargs(o, lr: float) -> tuple[type, dict]:
    """The class and constructor keyword arguments of an ``[optimizer]`` table ``o``
    (:class:`~lowcomm.run.config.OptimizerConfig`); ConfigError naming the key for an unknown
    name, an unknown option, an option that is a run key, or a momentum the optimizer lacks."""
    if o.name not in OPTIMIZERS:
        why = f" ({UNSUITED[o.name]})" if o.name in UNSUITED else ""
        raise ConfigError("optimizer.name", f"unknown or unsuited optimizer {o.name!r}{why}; "
                          f"known: {', '.join(OPTIMIZERS)}")
    cls = OPTIMIZERS[o.name]
    params = _parameters(cls)
    kwargs: dict = {"lr": lr}
    if "weight_decay" in params:
        kwargs["weight_decay"] = o.weight_decay
    if "betas" in params:
        kwargs["betas"] = (o.beta1, o.beta2)
    if o.momentum is not None:
        if "momentum" in params:
            kwargs["momentum"] = o.momentum
        elif o.momentum != 0:
            raise ConfigError("optimizer.momentum", f"{o.name} ({cls.__name__}) takes no "
                              f"momentum; unset it or choose an optimizer that has one")
    if cls is MuonAdamW:
        kwargs["adjust_lr_fn"] = "match_rms_adamw"
    for key, value in o.options.items():
        where = f"optimizer.options.{key}"
        if key in RUN_KEYS:
            raise ConfigError(where, f"is set by the run's key {RUN_KEYS[key]}; set that instead")
        if key not in params:
            raise ConfigError(where, f"not an argument of {o.name} ({cls.__name__}); it takes: "
                              f"{', '.join(k for k in params if k not in RUN_KEYS)}")
        kwargs[key] = _option(where, value, params[key].default)
    return cls, kwargs


def check_optimizer(o) -> None:
    """Raise the ConfigError :func:`build_optimizer` would, without building anything (values
    the constructor itself rejects are caught by building on one dummy parameter)."""
    cls, kwargs = optimizer_kwargs(o, 1e-3)
    dummy = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    try:
        cls(dummy if cls is MuonAdamW else dummy[1:], **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError("optimizer.options", f"{o.name} ({cls.__name__}) rejects the "
                          f"options {o.options or {}}: {e}") from None


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The run's inner optimizer over ``params`` (module docstring)."""
    cls, kwargs = optimizer_kwargs(cfg.optimizer, cfg.lr)
    return cls(params, **kwargs)


__all__ = ["MuonAdamW", "OPTIMIZERS", "build_optimizer", "check_optimizer", "optimizer_kwargs"]
