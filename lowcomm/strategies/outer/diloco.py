"""DiLoCo and streaming DiLoCo: an inner optimizer for H local steps, then an outer optimizer
step on the averaged pseudo-gradient."""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from ...comm.comm import Comm
from ...comm.round_tag import RoundTag
from ...compress.compressor import Compressor
from ...compress.error_feedback import ErrorFeedback
from ...compress.quantize import StatQuant
from ...compress.twophase import COLLECTIVES
from ...errors import ArgumentError, ConfigError
from ..method import Context, Method
from .fragment import Fragment, InFlight, done
from .loop import OuterLoop, OuterSettings, check_merge, check_run
from .route import hand_on

OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed-nesterov")


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov momentum (Liu et al. 2024, arXiv 2401.09135, §3.2): the outer optimizer
    of asynchronous DiLoCo, whose momentum moves only every N outer gradients.

    Update, for outer gradient g_t (the t-th, from 1), learning rate η, momentum β, a buffer d
    and the momentum m (both 0 at first):

      1. d ← d + g_t;
      2. where t mod N = 0: m ← β·m + d/N, θ ← θ − η·β·m − η·g_t/N, d ← 0;
      3. else: θ ← θ − η·g_t/N.

    With N = 1 this is SGD with Nesterov momentum (torch's ``nesterov=True``: m ← β·m + g,
    θ ← θ − η·(g + β·m)).
    """

    def __init__(self, params, lr: float, momentum: float, every: int):
        if every < 1:
            raise ArgumentError("nesterov_every", f"must be >= 1 outer steps, got {every}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "every": every})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["every"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["buffer"] = torch.zeros_like(p)
                    st["momentum_buffer"] = torch.zeros_like(p)
                st["t"] += 1
                st["buffer"].add_(p.grad)
                update = p.grad * (1.0 / n)
                if st["t"] % n == 0:
                    st["momentum_buffer"].mul_(beta).add_(st["buffer"], alpha=1.0 / n)
                    update.add_(st["momentum_buffer"], alpha=beta)
                    st["buffer"].zero_()
                p.add_(update, alpha=-lr)
        return None


@dataclass
class DiLoCoSettings(OuterSettings):
    """``[strategy]`` keys of ``diloco``: the outer loop's keys and the outer optimizer."""
    outer_optimizer: str = "nesterov"   # "nesterov" | "sgd"
    outer_lr: float = 0.7          # the outer SGD's learning rate (the paper: 0.7)
    outer_momentum: float = 0.9    # the outer SGD's momentum (the paper: 0.9, Nesterov)
    nesterov_every: int = 1        # N: outer steps between momentum updates ("delayed-nesterov")
    least_every = 1                # the smallest N (not a key)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.one_of(prefix, "outer_optimizer", OUTER_OPTIMIZERS)
        self.at_least(prefix, "nesterov_every", self.least_every)
        if self.nesterov_every > 1 and self.outer_optimizer != "delayed-nesterov":
            raise ConfigError.at(prefix, "nesterov_every", "delays the momentum of "
                                 "outer_optimizer = \"delayed-nesterov\"; set it, or leave "
                                 f"nesterov_every = 1 (got {self.nesterov_every})")
        self.within(prefix, "outer_lr", 0, float("inf"), low_open=True)
        self.within(prefix, "outer_momentum", 0, 1, high_open=True)
        if self.outer_optimizer != "sgd" and self.outer_momentum == 0:
            raise ConfigError.at(prefix, "outer_momentum", "Nesterov needs a momentum > 0; for "
                                 "none use outer_optimizer=\"sgd\"")

    def kwargs(self, ctx: Context) -> dict:
        return dict(super().kwargs(ctx), compressor=ctx.gradient_compressor(self.compressor))


@dataclass
class StreamingDiLoCoSettings(DiLoCoSettings):
    """``[strategy]`` keys of ``streaming-diloco``: DiLoCo's, and the streaming schedule."""
    fragments: int = 1             # P parameter fragments
    delay: int = 0                 # τ inner steps between sending a fragment and applying it
    alpha: float = 0.0             # share of the local parameters kept when merging ("mix")
    merge: str = "mix"             # "mix" (α) | "add-local" (keep the τ steps' local progress)
    #                                | "eager" (restart from an eager outer step, Kale et al. 2025)
    # what falls on a fragment's slot ⌊(p+1)H/P⌋: "send" = it is sent there and merged τ steps
    # later (the paper's figure); "merge" = sent τ steps earlier and merged there (torchft's)
    slot: str = "send"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.at_least(prefix, "fragments", 1)
        self.at_least(prefix, "delay", 0)
        self.within(prefix, "alpha", 0, 1)
        self.one_of(prefix, "slot", ("send", "merge"))
        if self.delay >= self.period:
            raise ConfigError.at(prefix, "delay", f"must be < period={self.period} (a fragment's "
                              f"reduction has to land before its next synchronisation), got {self.delay}")
        check_merge(self.merge, self.alpha, prefix)
        if self.merge == "eager" and self.delay == 0:
            raise ConfigError.at(prefix, "delay", "eager updates stand in for the average during "
                                 "the τ inner steps its reduction is in flight; with delay = 0 "
                                 "there are none (that is DiLoCo): set delay ≥ 1")


@dataclass
class EagerDiLoCoSettings(StreamingDiLoCoSettings):
    """``[strategy]`` keys of ``diloco-eager``: DiLoCo with eager updates (Kale et al. 2025,
    arXiv 2502.12996) as a preset of streaming DiLoCo: the average's reduction overlaps τ =
    ``delay`` inner steps, during which each rank trains from the outer step its own fresh
    pseudo-gradient and the others' last ones give (:class:`StreamingDiLoCo`, merge
    "eager"). One fragment unless ``fragments`` says more."""
    period: int = 50
    delay: int = 5
    merge: str = "eager"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        if self.merge != "eager":
            raise ConfigError.at(prefix, "merge", "diloco-eager is streaming DiLoCo with merge = "
                                 f"\"eager\"; for {self.merge!r} use streaming-diloco")


@dataclass
class MuLoCoEFSettings(DiLoCoSettings):
    """``[strategy]`` keys of ``muloco-ef2bit``: MuLoCo's error-feedback + 2-bit variant (Thérien
    et al. 2025, arXiv 2505.23725) as a preset of DiLoCo: the inner optimizer must be Muon
    (``optimizer.name = "muon"``: :class:`~lowcomm.run.optimizers.MuonAdamW`), the
    pseudo-gradient goes through error feedback around a dense 2-bit statistical quantiser
    (:class:`~lowcomm.compress.quantize.StatQuant`), exchanged by ``exchange``; the outer step
    stays DiLoCo's Nesterov. Bytes per rank and outer step with the all-gather:
    ``(K−1)·(⌈n/4⌉ + 20·⌈n/2048⌉)`` for n parameters."""
    period: int = 50
    exchange: str = "allgather"    # the 2-bit payloads' collective: "allgather" | "two-phase" | "auto"

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.one_of(prefix, "exchange", COLLECTIVES)
        if self.compressor != "none":
            raise ConfigError.at(prefix, "compressor", "muloco-ef2bit's pseudo-gradient compressor "
                                 "is its 2-bit quantiser with error feedback; leave compressor = "
                                 f"\"none\", got {self.compressor!r}")

    def kwargs(self, ctx: Context) -> dict:
        return dict(super().kwargs(ctx), compressor=Compressor(ErrorFeedback(StatQuant(2)), self.exchange))


def check_muloco(s: MuLoCoEFSettings, cfg, prefix: str) -> None:
    check_run(s, cfg, prefix)
    if cfg.optimizer.name != "muon":
        raise ConfigError("optimizer.name", f"muloco-ef2bit is DiLoCo with Muon inside; set "
                          f"optimizer.name = \"muon\", got {cfg.optimizer.name!r}")


def build(s: DiLoCoSettings, model, optimizer, comm: Comm, ctx: Context) -> "DiLoCo":
    if isinstance(s, MuLoCoEFSettings) and not any(g.get("algorithm") == "muon"
                                                   for g in optimizer.param_groups):
        raise ArgumentError("optimizer", "muloco-ef2bit is DiLoCo with Muon inside: pass a "
                            "lowcomm.MuonAdamW (with a Muon group: the model's matrices), got "
                            f"{type(optimizer).__name__}")
    cls = StreamingDiLoCo if isinstance(s, StreamingDiLoCoSettings) else DiLoCo   # presets too
    return cls(model, optimizer, comm, **s.kwargs(ctx))


class DiLoCo(OuterLoop):
    """DiLoCo: distributed low-communication training (Douillard et al. 2023, arXiv 2311.08105).

    Update, with K ranks, H = ``period``, θ the outer parameters (a float32 copy on the CPU,
    shared by all ranks) and θ_k rank k's model:

      1. θ ← rank 0's parameters, broadcast; every θ_k ← θ (after W = ``warmup_steps`` dense
         SyncDP steps, if any);
      2. each rank takes H inner steps of the wrapped optimizer (AdamW in the paper) on its own
         data: θ_k ← InnerOpt(θ_k, g_k); the inner optimizer's state is kept across rounds;
      3. pseudo-gradient Δ_k = θ − θ_k, averaged over the ranks: Δ = (1/K) Σ_k Δ_k (dense
         all-reduce, or ``compressor.reduce`` — its error-feedback memory carries over rounds);
      4. outer step θ ← OuterOpt(θ, Δ): SGD with Nesterov momentum (``outer_lr`` 0.7,
         ``outer_momentum`` 0.9 in the paper), SGD with heavy-ball momentum, or delayed
         Nesterov (:class:`DelayedNesterov`: the momentum moves every ``nesterov_every``
         outer steps);
      5. θ_k ← θ on every rank; go to 2.

    With ``outer_optimizer="sgd"``, ``outer_lr=1``, ``outer_momentum=0`` step 4 gives
    θ = (1/K) Σ_k θ_k, i.e. :class:`~lowcomm.strategies.outer.localsgd.LocalSGD`. The outer state
    (θ, momentum) lives on the CPU whatever the model's device.

    Args:
        model, optimizer: the user's torch objects (``optimizer`` is the inner optimizer).
        comm: communicator (default: world).
        settings: a validated :class:`DiLoCoSettings` (what the registry passes); otherwise the
            keyword arguments are its fields — ``period``, ``outer_*``, ``warmup_steps``,
            ``algorithm`` (default "mpi"), ... —, checked once by its ``validate`` (a wrong one
            raises :class:`~lowcomm.errors.ArgumentError` naming it):
        period: H ≥ 1 inner steps per outer step.
        outer_optimizer: "nesterov", "sgd" or "delayed-nesterov".
        nesterov_every: N ≥ 1, outer steps between momentum updates of "delayed-nesterov".
        outer_lr, outer_momentum: the outer SGD's learning rate and momentum.
        warmup_steps: W ≥ 0 dense SyncDP steps before the first round.
        algorithm: all-reduce algorithm of the pseudo-gradient (and the warm-up).
        compressor: a :class:`~lowcomm.compress.Compressor` for the pseudo-gradient
            (None: dense fp32 average).
        context: the run's objects (:class:`~lowcomm.strategies.method.Context`): ``levels``
            for ``algorithm = "hierarchical"``, the warm-up's gradient compressor and NaN
            policy, ``batches`` and ``forward`` for ``bn_recompute``.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        opt = DiLoCo(model, inner, period=500)      # Nesterov outer, lr 0.7, momentum 0.9
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "diloco"
    Settings = DiLoCoSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, **arguments):
        super().__init__(model, optimizer, comm, **arguments)
        s = self.settings
        self._init_outer(s.outer_optimizer, s.outer_lr, s.outer_momentum,
                         s.nesterov_every)
        self._eager = self._init_eager() if self.merge == "eager" else None
        # a fleet whose rounds may go ahead without a late datacenter (fleet.quorum)
        self._late = {"carried": 0, "last_step": [torch.zeros_like(p) for p in self.outer_params]} \
            if self.route.whole.late_rounds else None

    def _init_outer(self, outer_optimizer: str, outer_lr: float, outer_momentum: float,
                    every: int = 1) -> None:
        """Step 1: θ, a CPU copy of every fragment (of this rank's range where sharded), and
        the outer optimizer on it."""
        self.outer_params = [torch.nn.Parameter(f.local(), requires_grad=False)
                             for f in self.fragments]
        if outer_optimizer == "delayed-nesterov":
            self.outer_optimizer = DelayedNesterov(self.outer_params, outer_lr, outer_momentum,
                                                   every)
            return
        self.outer_optimizer = torch.optim.SGD(self.outer_params, lr=outer_lr,
                                               momentum=outer_momentum,
                                               nesterov=outer_optimizer == "nesterov")

    def _warmup_done(self) -> None:
        for f, outer in zip(self.fragments, self.outer_params):
            outer.data.copy_(f.local())

    def _outgoing(self, f: Fragment, local: torch.Tensor) -> torch.Tensor:
        """Step 3: the pseudo-gradient Δ_k = θ − θ_k (the route averages it over the ranks)."""
        return self.outer_params[f.index].detach() - local

    def _apply(self, f: Fragment, avg: torch.Tensor, record: bool = True) -> torch.Tensor:
        """Step 4: θ ← OuterOpt(θ, Δ); returned, the fragment merges it (step 5: θ_k ← θ)."""
        if record and self._eager is not None:      # the next eager proxy's Δ̄
            self._eager[f.index][0].copy_(avg)
        outer = self.outer_params[f.index]
        outer.grad = avg.to(outer.dtype)
        self.outer_optimizer.step()             # only parameters with a gradient move
        outer.grad = None
        return outer.detach()

    def _unapplied(self, f: Fragment) -> torch.Tensor:
        """No outer step on an average that is not finite: θ stays, every rank returns to it."""
        return self.outer_params[f.index].detach()

    # eager updates (merge = "eager", Kale et al. 2025) ------------------------------------------
    def _init_eager(self) -> list[list[torch.Tensor]]:
        """Eager updates' memory per fragment: [the last average Δ̄, this rank's last Δ_k]."""
        nest = self.nest
        if nest is not None and nest.average_inside:
            raise ConfigError("policy", f"{self.name} with merge = \"eager\": the ranks of a unit "
                              "differ (the level below does not keep them in step), so a rank's "
                              "own pseudo-gradient is not its unit's; keep them in step (syncdp, "
                              "zero, fsdp inside) or use merge = \"add-local\"")
        inside = nest.inside.size if nest is not None and nest.inside is not None else 1
        self._contributors = self.route.whole.size // inside     # K: one pseudo-gradient per unit
        return [[torch.zeros_like(p), torch.zeros_like(p)] for p in self.outer_params]

    def _base(self, f: Fragment, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """``merge = "eager"`` (Kale et al. 2025): the model restarts from the outer step taken
        with the eager proxy (see :class:`StreamingDiLoCo`), which is returned; otherwise as
        the outer loop."""
        if self._eager is None:
            return super()._base(f, local, out)
        last_avg, last_mine = self._eager[f.index]
        proxy = last_avg + (out - last_mine) / self._contributors
        last_mine.copy_(out)
        eager = self._trial_step(f.index, proxy)
        f.unpack_(f.whole(eager))
        if self._inner is not None:
            self._inner.parameters_changed()
        return eager

    @torch.no_grad()
    def _trial_step(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """θ_i after an outer step on ``grad``, the outer parameters and optimizer state left
        as they were."""
        outer = self.outer_params[i]
        state = self.outer_optimizer.state.get(outer, {})
        saved = ({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()},
                 outer.detach().clone())
        after = self._apply(self.fragments[i], grad, record=False).clone()
        self.outer_optimizer.state[outer] = saved[0]
        if not saved[0]:
            del self.outer_optimizer.state[outer]
        outer.copy_(saved[1])
        return after

    # a fleet whose rounds may go ahead without a late datacenter (fleet.quorum) -------------
    def _start(self, f: Fragment, s: int) -> None:
        """In a fleet with a quorum (``fleet.quorum``), the round of
        :meth:`~lowcomm.run.fleet.channel.Channel.contribute` (below); else the outer loop's.

        Each member adds w·Δ_k and w, w its steps since its θ (H, or 2H for a member that was
        late for the last round and kept training from the θ it had), so the average is the
        steps-weighted Σ w_k Δ_k / Σ w_k. A late member's Δ is taken from the older θ_{r−1};
        the round's donor adds, per member catching up, w·(θ_r − θ_{r−1}) (the step the last
        round made), which puts its contribution on θ_r, and hands it θ_r and the outer
        optimizer's state, so that every member then takes the same outer step. A member the
        round went without keeps its local model and θ and carries its steps to the next."""
        late = self._late
        if late is None:
            return super()._start(f, s)
        self.route.red.ledger.reset()
        delta = self._outgoing(f, f.local())
        steps = self.period * (1 + late["carried"])
        kind, avg, state = self._late_round(f, delta, steps)
        self._charge(InFlight(f.index, s, s, None), self.route.red.ledger.rows())
        if kind == "late":
            late["carried"] += 1
            return
        late["carried"] = 0
        outer = self.outer_params[f.index]
        if state is not None:                        # catching up: θ_r and the momentum
            got = torch.load(io.BytesIO(state), weights_only=True)
            with torch.no_grad():
                outer.copy_(got["outer"])
            self.outer_optimizer.load_state_dict(got["optimizer"])
        before = outer.detach().clone()
        synced = self._apply(f, avg)
        late["last_step"][f.index].copy_(synced - before)
        f.unpack_(synced)
        f.dirty = False
        if self._inner is not None:
            self._inner.parameters_changed()

    def _late_round(self, f: Fragment, delta: torch.Tensor, steps: int):
        """(kind, the steps-weighted average, the donor's state or None) of this round, on
        every rank of the datacenter (the leader's, handed on)."""
        inside, msg, mean = self.route.inside, None, delta
        if inside is None or inside.rank == 0:
            last = self._late["last_step"][f.index]

            def payload(catching: dict, corrector: bool) -> torch.Tensor:
                x = delta * float(steps)
                if corrector and catching:
                    x = x + float(sum(catching.values())) * last
                return torch.cat([x, x.new_tensor([float(steps)])])

            def state() -> bytes:
                buf = io.BytesIO()
                torch.save({"outer": self.outer_params[f.index].detach(),
                            "optimizer": self.outer_optimizer.state_dict()}, buf)
                return buf.getvalue()
            kind, avg, got = self.route.leaders.contribute(payload, RoundTag.sync(self.t, f.index), steps,
                                                      state, self.algorithm, self.route.levels,
                                                      carried=self._late["carried"] > 0)
            msg = (kind, got)
            if avg is not None:
                mean = avg[:-1] / avg[-1]
        if inside is not None and inside.size > 1:
            msg = inside.bcast_object(msg)
        if msg[0] == "late":
            return "late", None, None
        return msg[0], hand_on(inside, mean, delta), msg[1]

    # a rejoining member ------------------------------------------------------------------------
    @torch.no_grad()
    def outer_to_model(self) -> None:
        """Set the model to the outer parameters θ (where they are sharded over the unit's
        ranks, each rank's range put together: collective over the unit)."""
        for f, outer in zip(self.fragments, self.outer_params):
            f.unpack_(f.whole(outer.detach()))

    def joined(self) -> None:
        """Start from a donor's state taken as a rejoining member: the model set to θ
        (:meth:`outer_to_model`); a round (an arrival) still in flight, the donor's, then keeps
        this member's progress from here when it lands — θ_k ← θ' + (θ_k − θ), its base this
        fragment now, not the donor's at the send (whose progress is in θ' already) — and is not
        charged again (its traffic was the donor's)."""
        self.outer_to_model()
        for item in self._in_flight:
            item.future = done((item.future.result()[0], []))
            if item.base is not None:
                item.base = self.fragments[item.fragment].local()

    # state -------------------------------------------------------------------------------------
    def _outer_state(self) -> list[torch.Tensor]:
        return [*self.outer_params, *(v for s in self.outer_optimizer.state.values()
                                      for v in s.values() if torch.is_tensor(v))]

    def _state_dict(self) -> dict:
        state = super()._state_dict()
        state["outer_params"] = [p.detach().clone() for p in self.outer_params]
        state["outer_optimizer"] = self.outer_optimizer.state_dict()
        if self._eager is not None:
            state["eager"] = [[t.clone() for t in pair] for pair in self._eager]
        if self._late is not None:
            state["late"] = {"carried": self._late["carried"],
                             "last_step": [t.clone() for t in self._late["last_step"]]}
        return state

    def _reshard_extra(self, old: list[dict]) -> dict:
        """The outer parameters θ and the outer optimizer's momentum, averaged over the old
        ranks (they are equal on every rank of a DiLoCo run; the average is then exact)."""
        from ..reshard import average, average_optimizer
        return {"outer_params": [average([s["outer_params"][i] for s in old])
                                 for i in range(len(self.outer_params))],
                "outer_optimizer": average_optimizer([s["outer_optimizer"] for s in old]),
                **({"eager": [[average([s["eager"][i][j] for s in old]) for j in range(2)]
                              for i in range(len(self._eager))]} if self._eager is not None else {})}

    def _load_state_dict(self, state: dict) -> None:
        super()._load_state_dict(state)
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"], strict=True):
                p.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        if self._eager is not None:
            for pair, saved in zip(self._eager, state["eager"], strict=True):
                for t, v in zip(pair, saved, strict=True):
                    t.copy_(v)
        if self._late is not None and "late" in state:
            self._late["carried"] = int(state["late"]["carried"])
            for t, v in zip(self._late["last_step"], state["late"]["last_step"], strict=True):
                t.copy_(v)


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): DiLoCo whose parameters are
    synchronised P fragments at a time, at staggered steps, with the communication overlapped
    with τ inner steps, so the peak bandwidth is about 1/P of DiLoCo's.

    Update, with H = ``period``, P = ``fragments``, τ = ``delay``, α = ``alpha``; parameter
    tensors are split into P fragments of near-equal size, fragment p with outer copy θ_p:

      1. as DiLoCo step 1; every rank takes inner steps all the time;
      2. at local step s with s mod H = ⌊(p+1)H/P⌋ mod H, fragment p's pseudo-gradient
         Δ_p = (1/K) Σ_k (θ_p − θ_{k,p}(s)) starts its (possibly compressed) all-reduce in the
         background;
      3. after step s + τ (τ < H), the outer step θ_p ← OuterOpt(θ_p, Δ_p) and the merge on
         every rank, ``merge = "mix"`` (the paper's): θ_{k,p} ← α θ_{k,p}(s + τ) + (1 − α) θ_p;
         ``merge = "add-local"``: θ_{k,p} ← θ_p + (θ_{k,p}(s + τ) − θ_{k,p}(s)), the local
         progress of the τ steps the reduction was in flight kept on top of the synchronised
         fragment (the delayed-averaging correction of DaSGD, Zhou et al. 2020,
         arXiv 2006.00441). With α = 0, "mix" drops those τ steps: at small H a large share of
         the inner work (τ/H of it); "add-local" keeps it, at one fragment copy per reduction
         in flight; ``merge = "eager"``, eager updates (Kale et al. 2025, arXiv 2502.12996),
         below.

    Eager updates: at step s rank k does not wait for the average: it takes the outer step on
    a proxy in which its own fresh pseudo-gradient stands in for its share and the other
    ranks' shares are last round's, g̃_k = Δ̄_p^{prev} + (Δ_{k,p} − Δ_{k,p}^{prev})/K (K
    contributions: ranks, or units of a per-level policy; both terms 0 before the first
    round), θ̃_p = OuterOpt(θ_p, g̃_k) computed without moving θ_p or the outer optimizer's
    state, and restarts its fragment there: θ_{k,p}(s) ← θ̃_p. When Δ̄_p lands after step s + τ,
    θ_p ← OuterOpt(θ_p, Δ̄_p) as in step 3 (the same on every rank) and the local progress made
    from θ̃_p is kept on top: θ_{k,p} ← θ_p + (θ_{k,p}(s + τ) − θ̃_p). It needs τ ≥ 1 and α = 0
    and keeps two copies of the fragment (Δ̄^{prev}, Δ_k^{prev}). The paper overlaps a whole
    outer step (τ = H); here τ < H, so the average lands before the fragment's next send.

    With P = 1, τ = 0 and α = 0 this is :class:`DiLoCo` (either merge: with τ = 0 the local
    progress is zero). Each fragment is its own outer parameter, so momentum is kept per fragment.

    Against torchft's ``DiLoCo`` (``fragment_sync_delay`` = τ): torchft prepares (sends) a
    fragment τ steps before its slot and performs the sync (outer step and merge) on the slot;
    here, by default (``slot = "send"``), the fragment is sent on its slot and merged τ steps
    later. The two are one schedule shifted by τ steps; ``slot = "merge"`` takes torchft's
    (each fragment sent at s mod H = ⌊(p+1)H/P⌋ − τ, merged on the slot).

    Args:
        fragments: P, at most the number of parameter tensors (a tensor is never split).
        delay: τ in [0, period), inner steps between sending a fragment and applying it.
        alpha: α in [0, 1], the share of the local parameters kept when merging ("mix").
        merge: "mix", "add-local" or "eager" (α must be 0 for the last two), see step 3.
        slot: "send" (sent on the fragment's slot, merged τ steps later) or "merge"
            (torchft's: sent τ steps earlier, merged on the slot).
        others: as :class:`DiLoCo`.

    Example::

        opt = StreamingDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=4e-4),
                              period=100, fragments=4, delay=5, alpha=0.5)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "streaming-diloco"
    Settings = StreamingDiLoCoSettings


METHOD = Method("diloco", DiLoCoSettings, build, "DiLoCo: H inner steps, then an outer "
                "Nesterov step on the averaged pseudo-gradient", check=check_run, outer=True,
                level=True, python="DiLoCo", example="diloco:period=3,compressor=ef-sign",
                compare=("strategy.period=50",))
STREAMING_METHOD = Method("streaming-diloco", StreamingDiLoCoSettings, build, "streaming DiLoCo: "
                          "DiLoCo over P staggered fragments, overlapped with τ inner steps",
                          check=check_run, outer=True, level=True, python="StreamingDiLoCo",
                          example="streaming-diloco:period=4,fragments=2,delay=2",
                          compare=("strategy.period=50", "strategy.fragments=4", "strategy.delay=5"))
EAGER_METHOD = Method("diloco-eager", EagerDiLoCoSettings, build, "DiLoCo with eager updates: "
                      "the outer step taken at once on a proxy (own fresh pseudo-gradient, the "
                      "others' last), corrected when the overlapped average lands",
                      check=check_run, outer=True, level=True, python="EagerDiLoCoSettings",
                      example="diloco-eager:period=4,delay=2",
                      compare=("strategy.period=50", "strategy.delay=5"))
MULOCO_EF_METHOD = Method("muloco-ef2bit", MuLoCoEFSettings, build, "MuLoCo's error-feedback "
                          "2-bit variant (preset of DiLoCo): Muon inside, the pseudo-gradient "
                          "2-bit quantised with error feedback", check=check_muloco, outer=True,
                          python="MuLoCoEFSettings", optimizer="muon",
                          example="muloco-ef2bit:period=3", compare=("optimizer.name=muon",))
