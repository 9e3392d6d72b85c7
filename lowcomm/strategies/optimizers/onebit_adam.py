"""1-bit Adam: Adam whose momentum is exchanged with 1 bit per element after a dense warm-up."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...compress.base import Segment, nonfinite_segments
from ...compress.compressor import Compressor
from ...compress.error_feedback import ErrorFeedback
from ...compress.sign import MomentumSign, TensorMomentumSign
from ...compress.twophase import TwoPhase
from ...errors import ConfigError, NonFiniteError
from ...settings import Settings
from .family import ExchangingOptimizer
from ..method import Context, Method
from ..adam import adam_state, torch_adam
from ..buffers import Buffers


#: the step counts a schedule may read (1-bit and 0/1 Adam's ``counter``)
COUNTERS = ("steps", "deepspeed")
#: what one compression scale covers (1-bit and 0/1 Adam's ``scale``)
SCALES = ("model", "tensor")


def onebit_codec(scale: str):
    """The 1-bit codec: one scale for the whole vector, or one per parameter tensor."""
    return TensorMomentumSign() if scale == "tensor" else MomentumSign()


def counter_offset(counter: str) -> int:
    """What DeepSpeed's step counter adds to the steps taken: its initialisation step (``step``
    1 of its 1-bit optimizers updates nothing), so its step s is our step t = s − 1."""
    return 1 if counter == "deepspeed" else 0


def warmup_steps(freeze_step: int, counter: str = "steps") -> int:
    """T_w, the dense Adam updates before the variance is frozen: ``freeze_step``, or with
    DeepSpeed's counter (which counts its initialisation step) ``max(1, freeze_step − 1)``."""
    return max(1, freeze_step - counter_offset(counter))


@dataclass
class OneBitAdamSettings(Settings):
    """``[strategy]`` keys of ``onebit-adam`` (``strategy.name = "onebit-adam"``, or the spec
    ``onebit-adam:freeze_step=100``)."""
    freeze_step: int = 100         # dense Adam warm-up steps before the variance is frozen
    # which count freeze_step reads: "steps" = the steps taken (freeze_step dense updates);
    # "deepspeed" = DeepSpeed's counter, which counts its initialisation step (one that discards
    # its gradient): max(1, freeze_step - 1) dense updates, as a DeepSpeed run with that value
    counter: str = "steps"
    # the 1-bit compression's scale ‖·‖₂/√d: "model" = one for all the method's parameters;
    # "tensor" = one per parameter tensor, as DeepSpeed (4 more bytes per tensor and message)
    scale: str = "model"

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "freeze_step", 1)
        self.one_of(prefix, "counter", COUNTERS)
        self.one_of(prefix, "scale", SCALES)


def build(s: OneBitAdamSettings, model, optimizer, comm: Comm, ctx: Context) -> "OneBitAdam":
    return OneBitAdam(model, optimizer, comm, settings=s)


def adam_only(method: str):
    """The check of a method that steps a torch Adam/AdamW itself and compresses what it sends
    itself (1-bit Adam, 0/1 Adam): its combinations with the run's keys."""
    def check_run(s, cfg, prefix: str) -> None:
        if cfg.optimizer.name not in ("adam", "adamw"):
            raise ConfigError("optimizer.name", f"{method} steps torch Adam or AdamW; use "
                              f"optimizer.name = \"adam\" or \"adamw\", got {cfg.optimizer.name!r}")
        if cfg.compressor.name != "none":
            raise ConfigError("compressor.name", f"{method} compresses what it sends itself; "
                              f"leave compressor.name = \"none\", got {cfg.compressor.name!r}")
    return check_run


check_run = adam_only("onebit-adam")


METHOD = Method("onebit-adam", OneBitAdamSettings, build,
                "1-bit Adam: dense Adam warm-up, then the momentum exchanged with 1 bit per "
                "element", check=check_run, python="OneBitAdam", optimizer="adam",
                example="onebit-adam:freeze_step=3")


class OneBitAdam(ExchangingOptimizer):
    """1-bit Adam (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang & He 2021,
    arXiv 2102.02888, Algorithm 1) on a plain ``torch.optim.Adam``.

    Warm-up, steps t = 1 … T_w (``freeze_step``; ``counter="deepspeed"``: ``freeze_step − 1``,
    at least 1): the gradients are averaged with one dense all-reduce and the wrapped
    ``torch.optim.Adam`` steps, so the run equals torch Adam on the averaged gradient exactly.
    Compression stage, t > T_w, on each of K ranks:

      1. the variance is frozen: ``v = v_{T_w}``, and with it Adam's denominator
         ``δ = √v/√(1-β2^{T_w}) + ε`` (torch Adam's bias correction, frozen at the switch);
      2. local momentum ``m_k = β1 m_{t-1} + (1-β1) g_k`` (``g_k`` + weight decay · x, as Adam's
         L2 term), from the last agreed momentum ``m_{t-1}``;
      3. preconditioned: ``u_k = clip(m_k / δ, ±B·(1-β1^t))``, ``B = max(1, (1-β1)/√(1-β2))``,
         and ``u_k = 0`` where ``v = 0``;
      4. worker side, with error ``e_k``: ``p = u_k + e_k``, ``C(p) = (‖p‖₂/√d) sign(p)``,
         ``e_k ← p − C(p)``; the packed signs are split in K chunks, and chunk j with the scale
         goes to rank j (one all-to-all; steps 4–6 are the shared two-phase exchange,
         :class:`~lowcomm.compress.twophase.TwoPhase`, with
         :class:`~lowcomm.compress.error_feedback.ErrorFeedback` around
         :class:`~lowcomm.compress.sign.MomentumSign`);
      5. server side, rank j for its chunk, with error ``ē_j``: ``w = (1/K) Σ_k C(p_k)_j + ē_j``,
         ``C(w)`` with the chunk's own scale, ``ē_j ← w − C(w)``; the packed chunk and its scale
         go to every rank (one all-gather);
      6. every rank decodes the same ``ū`` (0 where ``v = 0``), stores ``m_t = ū·δ`` as Adam's
         ``exp_avg`` and steps ``x ← x − lr/(1-β1^t) · ū``.

    Steps 4–5 are Tang et al.'s error-compensated compressed all-reduce, with DeepSpeed's scale
    ``‖·‖₂/√d``. Where they compress ``m`` and divide the result by ``δ``, lowcomm compresses
    ``m/δ``: the 1-bit error of a coordinate is about the scale of the whole vector, so divided
    afterwards by a tiny ``δ_i`` (a coordinate whose gradient was numerically zero during the
    warm-up, e.g. an attention key bias, whose gradient is zero up to rounding) it became a step
    of thousands and a NaN; compressed after the division it stays in step units. As ``δ > 0``
    the signs on the wire are the paper's, and where ``δ`` is the same for every coordinate the
    update is the paper's (C is positively homogeneous; tested). Step 3's bound is Adam's own
    bound on its step ``|m̂/√v̂|`` (Kingma & Ba 2015, arXiv 1412.6980, Section 2.1), which a
    frozen ``v`` no longer enforces once a gradient outgrows its warm-up variance; the mask
    where ``v = 0`` (no gradient at all during the warm-up: an unused layer) is DeepSpeed's
    momentum mask (``exp_avg_mask``), found from ``v`` instead of given by the user: 1 bit
    cannot say zero, and such a coordinate must not move. torch Adam's bias corrections are
    kept, so the update is continuous at the switch (Tang et al. drop them; the difference
    vanishes for a long warm-up). A parameter no rank has a gradient for in a step (a branch
    not taken) is left alone, as torch Adam and DDP leave it: the ranks agree on it with one
    slot per parameter tensor (n tensors), carried in the warm-up's all-reduce and, in the
    compression stage, in a small all-reduce of its own.
    Against DeepSpeed's ``OnebitAdam`` (``deepspeed/runtime/fp16/onebit/adam.py``), beside the
    points above: (a) its first step initialises and discards the gradient, and its counter
    includes that step, so ``freeze_step = N`` there makes N − 1 dense updates; here N, unless
    ``counter="deepspeed"``; (b) it scales the 1-bit momentum per parameter tensor (each tensor
    all-reduced on its own, padded to 8K), here by default one scale ``‖·‖₂/√d`` for all of the
    method's parameters (one exchange, fewer bytes); the signs are the same, the magnitudes
    differ where the tensors' momenta differ in size; ``scale="tensor"`` scales each tensor on
    its own (:class:`~lowcomm.compress.sign.TensorMomentumSign`, still one exchange: the owners
    scale each piece of a tensor they hold, and a tensor's scale counts its own elements,
    DeepSpeed's its padding too); (c) on one rank neither compresses (nothing to send),
    so the compression stage is Adam with the frozen variance.
    Bytes per rank and compressed step: the all-to-all and the all-gather each send
    ``(K-1)·(D/(8K) + 4)``, D = d rounded up to a multiple of 8K (d: parameter count), plus
    an all-reduce of 4n; during warm-up a dense all-reduce of 4(d + n).

    Args:
        model, optimizer: the user's model and a ``torch.optim.Adam`` or ``AdamW`` (decoupled
            weight decay, Loshchilov & Hutter 2019: ``x ← x(1 − lr·λ)`` before step 6 instead
            of the L2 term of step 2) over its parameters
            (no amsgrad, no maximize).
        comm: communicator (default: world).
        freeze_step: warm-up steps with dense Adam, ≥ 1.
        counter: "steps" (T_w = freeze_step) or "deepspeed" (T_w = max(1, freeze_step − 1),
            DeepSpeed's count, which includes its initialisation step).
        scale: "model" (one compression scale) or "tensor" (one per parameter tensor, as
            DeepSpeed); bytes per message grow by 4 per tensor piece.

    Example::

        opt = OneBitAdam(model, torch.optim.Adam(model.parameters(), lr=1e-3), freeze_step=100)
        opt = lowcomm.build("onebit-adam:freeze_step=100", model, torch.optim.Adam(model.parameters()))
        opt.zero_grad(); loss.backward(); opt.step()

    From a config: ``strategy.name = "onebit-adam"``, ``strategy.freeze_step = 100``.
    """

    name = "onebit-adam"
    Settings = OneBitAdamSettings

    def _setup(self, s: OneBitAdamSettings) -> None:
        s = self._onebit()
        self.decoupled = torch_adam(self.optimizer, "1-bit Adam")   # AdamW's weight decay
        self.freeze_step = s.freeze_step
        self.warmup = warmup_steps(s.freeze_step, s.counter)          # T_w: dense updates
        names = {p: n for n, p in self.model.named_parameters()}
        self._params = [(names.get(p, f"param{i}"), p, g) for g in self.optimizer.param_groups
                        for i, p in enumerate(g["params"]) if p.requires_grad]
        dtypes = {p.dtype for _, p, _ in self._params}
        if len(dtypes) != 1:
            raise ValueError(f"1-bit Adam needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.d = sum(p.numel() for _, p, _ in self._params)
        ends = list(itertools.accumulate(p.numel() for _, p, _ in self._params))
        self._segments = [Segment(n, p.shape, e - p.numel(), e)       # where each gradient sits
                          for (n, p, _), e in zip(self._params, ends)]
        K = self.comm.size
        self.D = -(-self.d // (8 * K)) * 8 * K          # chunks of whole bytes, one per rank
        self.chunk = self.D // K
        self.exchange = Compressor(ErrorFeedback(onebit_codec(s.scale)), TwoPhase())
        self.t = 0
        broadcast_(self.comm, list(self.model.state_dict().values()), root=0)
        self._comm = self.comm.dup()          # fixed shapes: no per-call agreement check
        self._comm.validate = False
        self.buffers = Buffers(self.model)
        self._frozen: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # δ, v > 0

    def _onebit(self) -> OneBitAdamSettings:
        """The settings of the 1-bit Adam steps (0/1 Adam's are derived from its own)."""
        return self.settings

    # the step ---------------------------------------------------------------------------------
    def _grads(self) -> tuple[torch.Tensor, list[bool]]:
        """This rank's gradients as one flat tensor (zeros for a parameter without one) and
        which parameters have one here."""
        mine = [p.grad is not None for _, p, _ in self._params]
        flat = torch.cat([p.grad.detach().reshape(-1) if p.grad is not None else
                          torch.zeros(p.numel(), dtype=self.dtype, device=p.device)
                          for _, p, _ in self._params])
        bad = nonfinite_segments(flat, self._segments)
        if bad:
            raise NonFiniteError(self.comm.rank, "the gradient of " + ", ".join(repr(s.name) for s in bad),
                                 self.t + 1)
        return flat, mine

    def _dense_average(self, flat: torch.Tensor, mine: list[bool]) -> tuple[torch.Tensor, list[bool]]:
        """The gradients averaged with one dense all-reduce, and which parameters any rank had
        a gradient for (one slot per parameter carried after the gradients)."""
        both = torch.cat([flat, torch.tensor(mine, dtype=flat.dtype, device=flat.device)])
        self._comm.allreduce_(both, "avg")
        return both[:self.d], (both[self.d:] > 0).tolist()

    def _agreed(self, mine: list[bool]) -> list[bool]:
        """Which parameters any rank had a gradient for (one small all-reduce): a parameter no
        rank had one for is left alone, as torch Adam leaves a parameter whose grad is None."""
        flags = torch.tensor(mine, dtype=torch.int32)
        if self._comm.size > 1:
            self._comm.allreduce_(flags, "sum")
        return (flags > 0).tolist()

    def _step(self, closure=None):
        loss = closure() if closure is not None else None
        flat, mine = self._grads()
        if self.t < self.warmup:
            flat, present = self._dense_average(flat, mine)
            for (_, p, _), s, here in zip(self._params, self._segments, present):
                g = flat[s.start:s.stop].view_as(p)
                if not here:
                    p.grad = None            # as torch DDP: no rank's gradient, Adam skips it
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            self.optimizer.step()
        else:
            self._compressed_step(flat, self._agreed(mine))
        self.t += 1
        self.buffers.broadcast(self.comm)        # DDP's rule: rank 0's buffers
        return loss

    @torch.no_grad()
    def _compressed_step(self, grads: torch.Tensor, present: list[bool]) -> None:
        u = torch.zeros(self.D, dtype=self.dtype, device=grads.device)
        off, frozen = 0, self._frozen_denominators()
        for (_, p, g), (denom, moved), here in zip(self._params, frozen, present):    # steps 1-3
            n = p.numel()
            if not here:                     # no rank's gradient: left alone, as torch Adam
                off += n
                continue
            st = self._state(p)
            grad = grads[off:off + n].view_as(p)
            if g["weight_decay"] and not self.decoupled:     # Adam: L2 term in the gradient
                grad = grad.add(p, alpha=g["weight_decay"])
            beta1, beta2 = g["betas"]
            bound = max(1.0, (1 - beta1) / math.sqrt(1 - beta2)) * (1 - beta1 ** (float(st["step"]) + 1))
            m = st["exp_avg"].mul(beta1).add_(grad, alpha=1 - beta1)
            u[off:off + n].view_as(p).copy_(m.div_(denom).clamp_(-bound, bound).mul_(moved))
            off += n
        avg = self.compressed_allreduce(u)               # steps 4-5
        off = 0
        for (_, p, g), (denom, moved), here in zip(self._params, frozen, present):    # step 6
            n = p.numel()
            if not here:
                off += n
                continue
            st = self.optimizer.state[p]
            step = avg[off:off + n].view_as(p).mul(moved)
            torch.mul(step, denom, out=st["exp_avg"])
            st["step"] += 1
            if g["weight_decay"] and self.decoupled:         # AdamW: x ← x(1 − lr·λ) first
                p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(step, alpha=-g["lr"] / (1 - g["betas"][0] ** float(st["step"])))
            off += n

    def _state(self, p: torch.Tensor) -> dict:
        return adam_state(self.optimizer, p)

    def _frozen_denominators(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter, step 1's δ and the mask of the coordinates that ever moved
        (``v > 0``): v is frozen from ``freeze_step`` on, so both are computed once (and again
        after :meth:`load_state_dict`)."""
        if self._frozen is None:
            self._frozen = []
            for _, p, g in self._params:
                v = self._state(p)["exp_avg_sq"]     # none: no gradient in the warm-up, v = 0
                denom = (v.sqrt() / math.sqrt(1 - g["betas"][1] ** self.warmup)).add_(g["eps"])
                self._frozen.append((denom, v > 0))
        return self._frozen

    def compressed_allreduce(self, u: torch.Tensor) -> torch.Tensor:
        """The error-compensated 1-bit average of ``u`` (D elements) over all ranks: steps 3–5
        above. Every rank returns the same tensor. Updates both error buffers. On one rank
        there is nothing to exchange: ``u`` itself, uncompressed (DeepSpeed's ``size > 1``)."""
        return self.onebit_average(self.exchange, u, "momentum")

    def onebit_average(self, exchange: Compressor, x: torch.Tensor, key: str) -> torch.Tensor:
        """``exchange``'s 1-bit average of ``x`` over the ranks, or ``x`` on one rank."""
        if self._comm.size == 1:
            return x
        return exchange.reduce(x, key, self._comm, self._segments)

    @property
    def worker_error(self) -> torch.Tensor:
        """This rank's worker error ``δ_k`` as one flat tensor of D elements (zero in the
        padding)."""
        e = torch.zeros(self.D, dtype=self.dtype, device=self._params[0][1].device)
        residuals = self.exchange.encoder.residuals
        for s in self._segments:
            if s.name in residuals:
                e[s.start:s.stop] = residuals[s.name]
        return e

    @property
    def server_error(self) -> torch.Tensor:
        """This rank's server error ``δ̄_j`` of its chunk (D/K elements)."""
        e = self.exchange.exchange.server_error.get("momentum")
        return e.clone() if e is not None else \
            torch.zeros(self.chunk, dtype=self.dtype, device=self._params[0][1].device)

    def _load_errors(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        self.exchange.load_state_dict({
            "encoder": {"residuals": {s.name: worker[s.start:s.stop].clone() for s in self._segments}},
            "exchange": {"server_error": {"momentum": server.clone()}}})

    # state ------------------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t,
                "worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def _regroup(self) -> None:
        """Point every parameter at its group dict again: the wrapped optimizer's
        ``load_state_dict`` replaces the dicts, and an LR schedule writes the new ones."""
        group = {p: g for g in self.optimizer.param_groups for p in g["params"]}
        self._params = [(n, p, group[p]) for n, p, _ in self._params]

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self._regroup()
        self._frozen = None
        self.t = int(state["t"])
        if state["worker_error"].shape != self.worker_error.shape or \
                state["server_error"].shape != self.server_error.shape:
            raise ValueError(f"1-bit Adam state is for another model or rank count (error buffers "
                             f"{tuple(state['worker_error'].shape)}/{tuple(state['server_error'].shape)}, "
                             f"here {tuple(self.worker_error.shape)}/{tuple(self.server_error.shape)})")
        self._load_errors(state["worker_error"], state["server_error"])

    def reshard(self, old: list[dict]) -> dict:
        """Model, Adam's moments (the agreed momentum, the frozen variance) and ``t`` are
        replicas: rank 0's (checked equal). The error buffers ``δ_k`` and ``δ̄_j`` are per rank
        and sized by the rank count (the server chunks are 1/K of the model): reset to zero,
        with a warning when they held anything (only after ``freeze_step``)."""
        from ..reshard import log, replicated
        merged = replicated(old, self.name)
        held = any(bool(s["strategy"][k].any()) for s in old for k in ("worker_error", "server_error"))
        if held:
            log.warning(
                "onebit-adam: the worker and server error-feedback buffers of the %d old ranks "
                "are reset to zero (not summed into the merged replica)", len(old))
        merged["strategy"] = dict(merged["strategy"], worker_error=torch.zeros_like(self.worker_error),
                                  server_error=torch.zeros_like(self.server_error))
        return merged

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return {}
        return {"freeze_step": self.freeze_step, "compressed_steps": max(0, self.t - self.warmup)}

