"""0/1 Adam: Adam whose variance is updated on ever fewer steps, with 1-bit exchanges between,
then frozen, with local steps between ever rarer 1-bit synchronisations."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.comm import Comm
from ...compress.compressor import Compressor
from ...compress.error_feedback import ErrorFeedback
from ...compress.twophase import TwoPhase
from ...settings import Settings
from ..method import Context, Method
from .onebit_adam import (COUNTERS, SCALES, OneBitAdam, OneBitAdamSettings, adam_only, counter_offset,
                          onebit_codec)
from ..outer.fragment import average_parameters


@dataclass
class ZeroOneAdamSettings(Settings):
    """``[strategy]`` keys of ``zeroone-adam`` (DeepSpeed's names; the spec
    ``zeroone-adam:var_freeze_step=100,local_step_scaler=20``)."""
    var_freeze_step: int = 100       # the last step whose variance may be updated (max T_v)
    var_update_scaler: int = 16      # κ: variance updates per interval before it doubles
    local_step_scaler: int = 32678   # steps per local-step interval before it doubles
    local_step_clipper: int = 16     # H: the longest local-step interval
    # which count the intervals read: "steps" = the steps taken (step 1 first); "deepspeed" =
    # DeepSpeed's counter, one ahead (it counts its initialisation step), as a DeepSpeed run
    counter: str = "steps"
    # the 1-bit compression's scale: "model" = one for all parameters; "tensor" = one per tensor
    scale: str = "model"

    def validate(self, prefix: str = "") -> None:
        for key in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            self.at_least(prefix, key, 1)
        self.one_of(prefix, "counter", COUNTERS)
        self.one_of(prefix, "scale", SCALES)


def build(s: ZeroOneAdamSettings, model, optimizer, comm: Comm, ctx: Context) -> "ZeroOneAdam":
    return ZeroOneAdam(model, optimizer, comm, settings=s)


METHOD = Method("zeroone-adam", ZeroOneAdamSettings, build,
                "0/1 Adam: variance updated on ever fewer steps with 1-bit steps between, then "
                "frozen, with local steps between 1-bit synchronisations",
                check=adam_only("zeroone-adam"), python="ZeroOneAdam", optimizer="adam",
                example="zeroone-adam:var_freeze_step=2,local_step_scaler=1,local_step_clipper=2",
                compare=("strategy.local_step_scaler=20",))


class Schedule:
    """Which step of 0/1 Adam step t is (Lu et al. 2022, Section 4; DeepSpeed's ``ZeroOneAdam``):

    * t ≤ ``var_freeze_step``: ``"dense"`` when t ∈ T_v (the variance is updated: t is a
      multiple of the current interval, which starts at 1 and doubles after every κ =
      ``var_update_scaler`` variance updates), else ``"onebit"``;
    * t > ``var_freeze_step``: ``"sync"`` when t is a multiple of the local-step interval
      (starting at 1, doubling after every ``local_step_scaler`` such steps, at most H =
      ``local_step_clipper``), else ``"local"``.

    "A multiple of the interval" is read on ``t + offset``: ``offset = 1`` is DeepSpeed's
    counter, which counts its initialisation step, so its step s is step t = s − 1 here and
    every interval ≥ 2 falls one step earlier than on t (the variance is frozen after the same
    step t = ``var_freeze_step`` either way). Its counters are all its state (``state_dict``)."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int, offset: int = 0):
        self.freeze, self.kappa = var_freeze_step, var_update_scaler
        self.scaler, self.clipper, self.offset = local_step_scaler, local_step_clipper, offset
        self.var_interval, self.var_counter = 1, 0
        self.local_interval, self.local_counter = 1, 0

    def kind(self, t: int) -> str:
        s = t + self.offset
        if t <= self.freeze:
            return "dense" if s % self.var_interval == 0 else "onebit"
        return "sync" if s % self.local_interval == 0 else "local"

    def advance(self, t: int) -> None:
        """After step t (whatever its kind): the intervals' counters."""
        if t <= self.freeze:
            if (t + self.offset) % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.kappa:
                    self.var_counter, self.var_interval = 0, 2 * self.var_interval
        else:
            self.local_counter += 1
            if self.local_counter == self.scaler:
                self.local_counter = 0
                self.local_interval = min(self.clipper, 2 * self.local_interval)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("var_interval", "var_counter", "local_interval",
                                              "local_counter")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, int(v))


def schedule(steps: int, var_freeze_step: int, var_update_scaler: int = 16,
             local_step_scaler: int = 32678, local_step_clipper: int = 16,
             counter: str = "steps") -> list[str]:
    """The kinds of steps 1..``steps`` (:class:`Schedule`; ``counter``: as the setting's)."""
    s = Schedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                 counter_offset(counter))
    out = []
    for t in range(1, steps + 1):
        out.append(s.kind(t))
        s.advance(t)
    return out


class ZeroOneAdam(OneBitAdam):
    """0/1 Adam (Lu, Li, Zhang, De Sa & He 2022, arXiv 2202.06009, Algorithm 1; DeepSpeed's
    ``ZeroOneAdam``): 1-bit Adam without a dense warm-up stage, on a plain ``torch.optim.Adam``
    or ``AdamW``.

    Update at step t on each of K ranks, with Adam's moments m, v, n_v the number of variance
    updates so far, ``δ = √(v / (1 − β2^{n_v})) + ε`` and the kinds of :class:`Schedule`:

      1. ``dense`` (t ∈ T_v, t ≤ ``var_freeze_step``): ``g = (1/K) Σ_k g_k`` (dense all-reduce);
         ``m ← β1 m + (1−β1) g``, ``v ← β2 v + (1−β2) g²``, n_v += 1; Adam's step
         ``x ← x − lr/(1−β1^t) · m/δ``. While every step so far was dense (t ≤ κ) this is
         torch Adam on the averaged gradient, bit for bit;
      2. ``onebit`` (t ∉ T_v, t ≤ ``var_freeze_step``): the preconditioned gradients ``g_k/δ``
         are averaged by the error-compensated 1-bit all-reduce (:class:`~lowcomm.compress.
         twophase.TwoPhase` around :class:`~lowcomm.compress.sign.MomentumSign`, worker and
         server errors, as 1-bit Adam's), ``g = avg · δ``; m updated with g, v kept; Adam's step;
      3. from ``var_freeze_step`` on, v and δ are frozen (the errors start afresh: they now
         carry another quantity); ``local``: ``m ← β1 m + (1−β1) g_k`` from the local gradient,
         ``x ← x − lr/(1−β1^t) · m/δ``, no communication;
      4. ``sync`` (t a multiple of the local-step interval): the local progress since the last
         synchronisation point x̄, ``u_k = x̄·D − x_k`` (D: the decoupled weight decay's factor
         over the interval, 1 for Adam), is averaged by the 1-bit all-reduce: ū; then
         ``x ← x̄·D − ū`` (the same on every rank) and ``m ← ū·δ·(1−β1^t) / Σ lr`` (the
         momentum that, applied with the interval's learning rates, gives ū: the paper's
         ``m = ū / Σγ``); x̄ ← x.

    Where v = 0 (a coordinate that had no gradient on any dense step) nothing is sent or moved:
    1 bit cannot say zero (DeepSpeed's momentum mask). DeepSpeed compresses g and ``u·δ`` and
    divides by δ afterwards; here g/δ and u are compressed (step units), so that a coordinate
    whose gradient was numerically zero (δ ≈ ε) is not moved by the compression error of the
    others (see :class:`~lowcomm.strategies.optimizers.onebit_adam.OneBitAdam`); as δ > 0 the signs on the
    wire are the paper's. Bias corrections are torch Adam's, with n_v for v (DeepSpeed drops
    them; the difference vanishes with t). DeepSpeed also discards the first step's gradient
    (an initialisation step); here step 1 is a dense Adam step. The ranks' parameters are equal
    after every dense, 1-bit and sync step; a run that ends after local steps averages them
    (one dense all-reduce). Buffers are rank 0's after every step (DDP's rule). A parameter
    without a gradient is left alone, as torch Adam leaves it: on a dense or 1-bit step where
    no rank has one (one slot per parameter tensor says so, n tensors), on a local or sync step
    where this rank has none; a sync leaves alone a parameter no rank stepped since the last one
    (the 1-bit average of zeros is not zero).
    Against DeepSpeed's ``ZeroOneAdam`` (``deepspeed/runtime/fp16/onebit/zoadam.py``), beside
    the points above: (a) its step counter includes its initialisation step, so each step's kind
    there is decided one step out of phase with t here (the same steps are dense, 1-bit, local
    or sync with ``counter="deepspeed"``); (b) it runs a compressed all-reduce per parameter
    tensor, each with its own scale, here one exchange with by default one scale ``‖·‖₂/√d``
    over all of the method's parameters (the signs agree, the magnitudes differ where the
    tensors differ in size), or with ``scale="tensor"`` one per tensor (as 1-bit Adam's);
    (c) on one rank neither compresses; DeepSpeed then also skips the momentum
    update of a 1-bit step (it sits inside its ``size > 1`` branch), here the momentum takes
    the exact gradient.
    Bytes per rank: dense steps an all-reduce of 4(d + n), 1-bit and sync steps
    ``2(K−1)·(D/(8K) + 4)`` (D = d rounded up to a multiple of 8K) and an all-reduce of 4n,
    local steps nothing.

    Args:
        model, optimizer: the user's model and a ``torch.optim.Adam`` or ``AdamW`` over its
            parameters (no amsgrad, no maximize).
        comm: communicator (default: world).
        var_freeze_step: the last step whose variance may be updated (DeepSpeed's default
            100000, "usually the end of the learning rate warm-up").
        var_update_scaler: κ, variance updates per interval before the interval doubles.
        local_step_scaler: steps per local-step interval before it doubles (DeepSpeed: 32678).
        local_step_clipper: H, the longest local-step interval.
        counter: "steps" or "deepspeed": the count the intervals read (:class:`Schedule`).
        scale: "model" or "tensor": what one 1-bit compression scale covers.

    Example::

        opt = ZeroOneAdam(model, torch.optim.Adam(model.parameters(), lr=1e-3), var_freeze_step=100)
        opt.zero_grad(); loss.backward(); opt.step()
    """

    name = "zeroone-adam"
    Settings = ZeroOneAdamSettings

    def _onebit(self) -> OneBitAdamSettings:
        """1-bit Adam's part: its warm-up of dense steps ends at ``var_freeze_step``."""
        return OneBitAdamSettings(freeze_step=self.settings.var_freeze_step, scale=self.settings.scale)

    def _setup(self, s: ZeroOneAdamSettings) -> None:
        super()._setup(s)
        self.schedule = Schedule(s.var_freeze_step, s.var_update_scaler, s.local_step_scaler,
                                 s.local_step_clipper, counter_offset(s.counter))
        self.grad_exchange = Compressor(ErrorFeedback(onebit_codec(s.scale)), TwoPhase())
        self.n_v = 0
        self.counts = {"dense": 0, "onebit": 0, "local": 0, "sync": 0}
        self._anchor: list[torch.Tensor] | None = None   # x̄, from the freeze on
        self._decay = [1.0] * len(self.optimizer.param_groups)   # D per group
        self._lrs = [0.0] * len(self.optimizer.param_groups)     # Σ lr per group since x̄
        self._group_of = [i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]
                          if p.requires_grad]     # in the order of self._params
        self._frozen: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._touched = [False] * len(self._params)   # had a gradient here since the last sync

    @property
    def lockstep(self) -> bool:
        """The ranks' gradients meet every step until the variance is frozen."""
        return self.t + 1 <= self.freeze_step

    # Adam's arithmetic ------------------------------------------------------------------------
    def _denom(self, st: dict, g: dict) -> torch.Tensor:
        """δ = √(v / (1 − β2^{n_v})) + ε, as torch Adam computes its denominator."""
        return (st["exp_avg_sq"].sqrt() / (1 - g["betas"][1] ** self.n_v) ** 0.5).add_(g["eps"])

    def _adam_(self, p, g: dict, grad: torch.Tensor, variance: bool, t: int,
               denom: torch.Tensor | None = None) -> None:
        """Steps 1–3's update of one parameter, in torch Adam's order of operations (``denom``:
        the frozen δ)."""
        st = self._state(p)
        st["step"] += 1
        lr, wd = g["lr"], g["weight_decay"]
        if wd:
            if self.decoupled:
                p.mul_(1 - lr * wd)
            else:
                grad = grad.add(p, alpha=wd)
        st["exp_avg"].lerp_(grad, 1 - g["betas"][0])
        if variance:
            st["exp_avg_sq"].mul_(g["betas"][1]).addcmul_(grad, grad, value=1 - g["betas"][1])
        denom = self._denom(st, g) if denom is None else denom
        p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - g["betas"][0] ** t))

    # the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _step(self, closure=None):
        loss = closure() if closure is not None else None
        t = self.t + 1
        kind = self.schedule.kind(t)
        flat, present = self._grads()
        if kind == "dense":
            flat, present = self._dense_average(flat, present)
            self.n_v += 1
        elif kind == "onebit":
            present = self._agreed(present)
            flat = self._onebit_gradient(flat)
        else:
            if self._frozen is None:
                self._freeze()
            self._touched = [a or b for a, b in zip(self._touched, present)]
        for i, (s, (_, p, g)) in enumerate(zip(self._segments, self._params)):
            if not present[i]:     # no gradient (any rank's where they meet): left alone
                continue
            self._adam_(p, g, flat[s.start:s.stop].view_as(p), kind == "dense", t,
                        self._frozen[i][0] if self._frozen else None)
        if kind in ("local", "sync"):
            self._local()
        self._advance(t, kind)
        return loss

    def _advance(self, t: int, kind: str) -> None:
        if kind == "sync":
            self._sync(t)
        self.counts[kind] += 1
        self.schedule.advance(t)
        self.t = t
        self.buffers.broadcast(self.comm)        # DDP's rule: rank 0's buffers

    def _onebit_gradient(self, flat: torch.Tensor) -> torch.Tensor:
        """Step 2: the 1-bit average of g/δ, times δ (0 where v = 0)."""
        x = torch.zeros(self.D, dtype=self.dtype, device=flat.device)
        masks = []
        for s, (_, p, g) in zip(self._segments, self._params):
            st = self._state(p)
            denom, moved = self._denom(st, g), st["exp_avg_sq"] > 0
            x[s.start:s.stop].view_as(p).copy_(flat[s.start:s.stop].view_as(p) / denom * moved)
            masks.append((denom, moved))
        avg = self.onebit_average(self.grad_exchange, x, "gradient")
        out = torch.empty_like(flat)
        for s, (_, p, _), (denom, moved) in zip(self._segments, self._params, masks):
            out[s.start:s.stop].view_as(p).copy_(avg[s.start:s.stop].view_as(p) * denom * moved)
        return out

    def _freeze(self) -> None:
        """The first step after ``var_freeze_step`` (or after a resume past it): δ and the mask
        are fixed, x̄ = x."""
        self._frozen = [(self._denom(self._state(p), g), self._state(p)["exp_avg_sq"] > 0)
                        for _, p, g in self._params]
        if self._anchor is None:
            self._anchor = [p.detach().clone() for _, p, _ in self._params]

    def _local(self) -> None:
        """After a local or sync step's update: the interval's decay factor and learning rates."""
        for i, g in enumerate(self.optimizer.param_groups):
            if g["weight_decay"] and self.decoupled:
                self._decay[i] *= 1 - g["lr"] * g["weight_decay"]
            self._lrs[i] += g["lr"]

    def _sync(self, t: int) -> None:
        """Step 4."""
        u = torch.zeros(self.D, dtype=self.dtype, device=self._anchor[0].device)
        for s, (_, p, _), x, (_, moved), i in zip(self._segments, self._params, self._anchor,
                                                  self._frozen, self._group_of):
            u[s.start:s.stop].view_as(p).copy_((x * self._decay[i] - p) * moved)
        avg = self.compressed_allreduce(u)
        touched, self._touched = self._agreed(self._touched), [False] * len(self._params)
        for s, (_, p, g), x, (denom, moved), i, here in zip(self._segments, self._params, self._anchor,
                                                           self._frozen, self._group_of, touched):
            if not here:       # no rank stepped it since the last sync: the 1-bit noise would move it
                continue
            ub = avg[s.start:s.stop].view_as(p) * moved
            p.copy_(x * self._decay[i] - ub)
            x.copy_(p)
            if self._lrs[i] > 0:
                self.optimizer.state[p]["exp_avg"].copy_(
                    ub * denom * ((1 - g["betas"][0] ** t) / self._lrs[i]))
        self._decay = [1.0] * len(self._decay)
        self._lrs = [0.0] * len(self._lrs)

    def _skip_step(self) -> None:
        """AMP: before the freeze every rank skips together (:meth:`skip`); after it this rank
        alone keeps its parameters and momentum, and synchronises with the others when due."""
        if self.lockstep:
            self.skip()
            return
        self.zero_grad()
        t = self.t + 1
        if self._frozen is None:
            self._freeze()
        for _, p, g in self._params:           # the decay every rank applies, so x̄·D agrees
            if g["weight_decay"] and self.decoupled:
                p.mul_(1 - g["lr"] * g["weight_decay"])
        self._local()
        self._advance(t, self.schedule.kind(t))

    # state ------------------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t, "n_v": self.n_v,
                "schedule": self.schedule.state_dict(), "counts": dict(self.counts),
                "anchor": [x.clone() for x in self._anchor] if self._anchor is not None else None,
                "decay": list(self._decay), "lrs": list(self._lrs), "touched": list(self._touched),
                "grad_exchange": self.grad_exchange.state_dict(),
                "exchange": self.exchange.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self._regroup()
        self.t, self.n_v = int(state["t"]), int(state["n_v"])
        self.schedule.load_state_dict(state["schedule"])
        self.counts = dict(state["counts"])
        self._anchor = [x.clone() for x in state["anchor"]] if state["anchor"] is not None else None
        self._decay, self._lrs = list(state["decay"]), list(state["lrs"])
        self._touched = list(state.get("touched", [True] * len(self._params)))
        self.grad_exchange.load_state_dict(state["grad_exchange"])
        self.exchange.load_state_dict(state["exchange"])
        self._frozen = None                      # recomputed from v and n_v at the next step

    def reshard(self, old: list[dict]) -> dict:
        """Before the freeze every rank holds the same model and moments: rank 0's (checked
        equal). After it, local steps make the ranks differ: the models, the momenta and x̄
        (equal on every rank) are averaged, so ``x̄·D − mean(x_k)``, the mean progress the next
        synchronisation carries, is kept. The 1-bit exchanges' error buffers (per rank, sized
        by the rank count) are reset, with a warning when they held anything."""
        from ..reshard import average, average_dicts, average_optimizer, log, replicated
        first = old[0]["strategy"]
        if any(s["strategy"][k] for s in old for k in ("grad_exchange", "exchange")):
            log.warning("zeroone-adam: the 1-bit exchanges' error buffers of the %d old ranks are "
                        "reset to zero", len(old))
        if first["anchor"] is None:
            merged = replicated(old, self.name)
            return dict(merged, strategy=dict(merged["strategy"], grad_exchange={}, exchange={}))
        state = dict(first, optimizer=average_optimizer([s["strategy"]["optimizer"] for s in old]),
                     grad_exchange={}, exchange={},
                     anchor=[average([s["strategy"]["anchor"][i] for s in old])
                             for i in range(len(first["anchor"]))])
        return {"model": average_dicts([s["model"] for s in old]), "strategy": state}

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return {}
        return {"var_freeze_step": self.freeze_step, "variance_updates": self.n_v,
                **{f"{k}_steps": v for k, v in self.counts.items()}}

    def _finish(self) -> None:
        """After local steps the ranks differ: their parameters are averaged (one dense
        all-reduce per dtype); buffers are rank 0's."""
        if any(self._lrs):                      # local steps since the last synchronisation
            average_parameters([(n, p) for n, p, _ in self._params], self.comm)
        self.buffers.broadcast(self.comm)

