"""DES-LOC: Local Adam whose parameters, first moments and second moments are averaged over the
ranks on periods of their own."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...errors import ConfigError
from ...settings import Settings
from ..base import LocalSteps
from ..layout import agreed_dup
from ..method import Context, Method, refuse_gradient_compressor
from ..buffers import Buffers
from ..adam import adam_state, torch_adam
from .fragment import average_parameters

#: what each period synchronises: the parameters x, Adam's first moment u, its second moment v
STATES = ("x", "u", "v")
_KEYS = {"u": "exp_avg", "v": "exp_avg_sq"}


@dataclass
class DesLocSettings(Settings):
    """``[strategy]`` keys of ``desloc`` (the spec ``desloc:period=16,period_u=48,period_v=96``;
    the paper's recommendation is K_u = 3 K_x, K_v = 6 K_x)."""
    period: int = 16               # K_x: steps between averagings of the parameters
    period_u: int = 48             # K_u: steps between averagings of Adam's first moment
    period_v: int = 96             # K_v: steps between averagings of Adam's second moment

    def validate(self, prefix: str = "") -> None:
        for key in ("period", "period_u", "period_v"):
            self.at_least(prefix, key, 1)

    def periods(self) -> dict[str, int]:
        return {"x": self.period, "u": self.period_u, "v": self.period_v}


def due(t: int, periods: dict[str, int]) -> list[str]:
    """The states averaged after step ``t`` (counted from 1): those whose period divides t."""
    return [k for k in STATES if t % periods[k] == 0]


def check_run(s: DesLocSettings, cfg, prefix: str) -> None:
    """DES-LOC averages torch Adam's own moments, uncompressed."""
    if cfg.optimizer.name not in ("adam", "adamw"):
        raise ConfigError("optimizer.name", "desloc averages torch Adam's moments; use "
                          f"optimizer.name = \"adam\" or \"adamw\", got {cfg.optimizer.name!r}")
    refuse_gradient_compressor(cfg, "desloc sends no gradients (it averages parameters and moments)")


def build(s: DesLocSettings, model, optimizer, comm: Comm, ctx: Context) -> "DesLoc":
    return DesLoc(model, optimizer, comm, settings=s)


class DesLoc(LocalSteps):
    """DES-LOC, desynced low-communication adaptive optimizers (Iacob, Sani, Safaryan,
    Giampouras, Horváth, Jovanović, Kurmanji, Aleksandrov, Shen, Qiu & Lane 2025,
    arXiv 2505.22549): every rank runs Adam on its own gradients; the parameters x, Adam's first
    moment u and its second moment v are each averaged over the ranks on a period of their own,
    K_x, K_u and K_v.

    Update on each of K ranks, step t (counted from 1), with torch Adam/AdamW's state
    ``exp_avg`` = u and ``exp_avg_sq`` = v:

      1. ranks start from rank 0's parameters and buffers (broadcast at construction);
      2. the wrapped Adam steps on the local gradient: ``u ← β1 u + (1−β1) g``,
         ``v ← β2 v + (1−β2) g²``, ``x ← x − lr · û/(√v̂ + ε)`` (torch's bias corrections,
         decoupled weight decay for AdamW), so a step without synchronisation is torch Adam's;
      3. if K_x divides t: ``x ← (1/K) Σ_k x_k`` (floating buffers averaged too, integer
         ones rank 0's);
      4. if K_u divides t: ``u ← (1/K) Σ_k u_k``;
      5. if K_v divides t: ``v ← (1/K) Σ_k v_k``.

    The states due at one step travel in one all-reduce. With K_x = K_u = K_v = K this is Local
    Adam (every state averaged every K steps); with K_x = K and K_u = K_v = ∞ Local SGD's
    averaging around a local Adam (DiLoCo's outer SGD at lr 1).

    Choices the paper leaves open: the paper writes the averaging of a state as taking the
    average of the previous step's value before it is used; here it happens right after step
    t, so the gradient of step t + 1 is taken at the averaged parameters and a run whose length
    is a multiple of K_x ends on one model (as Local SGD). Adam's per-parameter step counters
    (bias corrections) are local and equal on every rank that stepped alike. A parameter that
    has no Adam state yet on a rank (no gradient there so far) takes part with zero moments,
    the state torch Adam starts from. The paper clips gradients per worker (radius ρ): here that
    is the training loop's clipping, which sees the local gradients. ``finish()`` averages the
    parameters once more when local steps followed the last averaging (one dense all-reduce),
    so every run delivers one model; the moments stay per rank. Resumed on another number of
    ranks, the parameters, buffers and moments are averaged over the old ranks.

    Bytes per rank: an all-reduce of ``n·d`` values at every step where n of the three periods
    divide t (d trainable elements), i.e. about ``2(K−1)/K · B·d · T · (1/K_x + 1/K_u + 1/K_v)``
    over T steps (B bytes per element) against DDP's ``2(K−1)/K · B·d · T``: the paper's
    ``1/(1/K_x + 1/K_u + 1/K_v)`` times less (K_x = 256, K_u = 768, K_v = 1536: 170×).

    Args:
        model, optimizer: the user's model and a ``torch.optim.Adam`` or ``AdamW`` over its
            parameters (no amsgrad, no maximize).
        comm: communicator (default: world).
        period, period_u, period_v: K_x, K_u, K_v ≥ 1.

    Example::

        opt = DesLoc(model, torch.optim.AdamW(model.parameters(), lr=1e-3), period=16,
                     period_u=48, period_v=96)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "desloc"
    Settings = DesLocSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: DesLocSettings | None = None, **options):
        torch_adam(optimizer, "DES-LOC")
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s = self.settings
        self.periods = s.periods()
        names = {p: n for n, p in model.named_parameters()}
        self._named = [(names[p], p) for g in optimizer.param_groups for p in g["params"]
                       if p.requires_grad]
        self.dtype = torch.float32
        for _, p in self._named:
            self.dtype = torch.promote_types(self.dtype, p.dtype)
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        # a rank with other periods would send all-reduces of other sizes, or none: refused
        sig = repr((s.periods(), [(n, str(p.dtype), tuple(p.shape)) for n, p in self._named]))
        self._comm = agreed_dup(self.comm, "desloc.layout", sig, len(self._named),
                                what="parameters or periods", mine=f"periods {s.periods()}")
        self.buffers = Buffers(model)
        self.t = 0
        self.syncs = {k: 0 for k in STATES}      # averagings of each state so far
        self._dirty = False                       # local steps since the parameters' last average

    def _tensors(self, key: str) -> list[torch.Tensor]:
        if key == "x":
            return [p.detach() for _, p in self._named]
        return [adam_state(self.optimizer, p)[_KEYS[key]] for _, p in self._named]

    @torch.no_grad()
    def _average(self, keys: list[str]) -> None:
        """Steps 3–5: the states ``keys`` averaged over the ranks in one all-reduce."""
        tensors = [t for k in keys for t in self._tensors(k)]
        flat = torch.cat([t.reshape(-1).to(self.dtype) for t in tensors])
        self._comm.allreduce_(flat, "avg")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
        for k in keys:
            self.syncs[k] += 1
        if "x" in keys:
            self.buffers.average(self.comm)
            self._dirty = False

    def _advance(self) -> None:
        self.t += 1
        self._dirty = True
        keys = due(self.t, self.periods)
        if keys and self.comm.size > 1:
            self._average(keys)
        elif "x" in keys:
            self._dirty = False

    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t, "syncs": dict(self.syncs),
                "dirty": self._dirty}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.t = int(state["t"])
        self.syncs = dict(state["syncs"])
        self._dirty = bool(state["dirty"])

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return {}
        return {"period_x": self.periods["x"], "period_u": self.periods["u"],
                "period_v": self.periods["v"], **{f"syncs_{k}": n for k, n in self.syncs.items()}}

    def _finish(self) -> None:
        """After local steps since the last averaging of the parameters, one more (a dense
        all-reduce); buffers averaged (integer ones rank 0's)."""
        if self._dirty:
            average_parameters(self._named, self.comm)
            self._dirty = False
        self.buffers.average(self.comm)


METHOD = Method("desloc", DesLocSettings, build, "DES-LOC: local Adam, the parameters and each "
                "Adam moment averaged on periods of their own", check=check_run,
                python="DesLoc", optimizer="adam", example="desloc:period=2,period_u=3,period_v=4",
                # the paper's recommendation: K_u = 3 K_x, K_v = 6 K_x
                compare=("strategy.period=16", "strategy.period_u=48", "strategy.period_v=96"))
