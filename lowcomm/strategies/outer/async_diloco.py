"""Asynchronous DiLoCo across a fleet's datacenters: each one's pseudo-gradient is applied by
the fleet's arrival server as it arrives; nobody waits for the slowest."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.comm import Comm
from ...errors import ConfigError
from ..method import Method
from .dylu import DyLUDiLoCo, DyLUSettings
from .fragment import Fragment, InFlight
from .loop import check_run


@dataclass
class AsyncSettings(DyLUSettings):
    """``[strategy]`` keys of ``diloco-async``: those of ``diloco-dylu`` (its dynamic local
    updates; ``tolerance = 1`` − a little turns them off), and the server's delayed Nesterov:
    ``outer_lr`` η, ``outer_momentum`` β, ``nesterov_every`` N arrivals between momentum
    updates (0: as many as the fleet's datacenters, so that N arrivals move θ about as one
    synchronous round). The outer momentum defaults to 0.5, not DiLoCo's 0.9: stale
    pseudo-gradients under 0.9 trained far worse in a fleet of 3 datacenters (bytelm, H = 10,
    160 steps: eval loss 3.45–3.51 against 2.81 at 0.5, 2.83 at 0.3, 2.99 at 0.7). ``delay``
    τ: an arrival travels while the next τ inner steps run, its answer taken after them (for
    links whose round trip is worth steps; 0, the paper's, waits for it)."""
    outer_momentum: float = 0.5
    nesterov_every: int = 0
    delay: int = 0                 # τ inner steps an arrival is in flight (0: it blocks)
    least_every = 0
    aggregate_refusal = ("diloco-async applies each datacenter's pseudo-gradient at the "
                         "coordinator's server as it arrives: no round gathers the members' "
                         "together to compare; use diloco")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.at_least(prefix, "delay", 0)
        if self.delay >= self.period:
            raise ConfigError.at(prefix, "delay", f"must be < period={self.period} (an arrival's "
                                 f"answer is taken before the next arrival), got {self.delay}")
        if self.outer_optimizer != "delayed-nesterov":
            raise ConfigError.at(prefix, "outer_optimizer", "the arrival server's optimizer is "
                                 f"delayed Nesterov; got {self.outer_optimizer!r}")
        if self.warmup_steps:
            raise ConfigError.at(prefix, "warmup_steps", "a dense warm-up synchronises every "
                                 "step across the datacenters, which asynchronous DiLoCo never "
                                 f"does; use 0 (got {self.warmup_steps})")
        if self.bn_recompute:
            raise ConfigError.at(prefix, "bn_recompute", "recomputing BatchNorm's statistics "
                                 "averages them in a round; asynchronous DiLoCo sends the buffers "
                                 "with each arrival instead: use 0")


def check(s: AsyncSettings, cfg, prefix: str) -> None:
    """Only across a fleet's datacenters (its coordinator holds the outer state)."""
    check_run(s, cfg, prefix)
    if not cfg.fleet.dcs or prefix not in ("strategy.", "policy.dc."):
        where = "strategy.name" if prefix == "strategy." else prefix.rstrip(".")
        raise ConfigError(where, "diloco-async applies each datacenter's pseudo-gradient as it "
                          "arrives at the fleet coordinator's server: run it across a fleet's "
                          "datacenters (lowcomm train --dcs D, or the dc level of a fleet's "
                          "policy); within one MPI job use diloco-dylu, whose rounds are "
                          "synchronous")


class AsyncDiLoCo(DyLUDiLoCo):
    """Asynchronous DiLoCo (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
    Modeling", arXiv 2401.09135): the outer state lives in one place, the fleet coordinator's
    arrival server (:mod:`lowcomm.run.fleet.server`), which applies each datacenter's
    pseudo-gradient when it arrives, with delayed Nesterov momentum (§3.2); dynamic local
    updates (§3.3) size each member's share of a period by its speed.

    Update, for member k (a datacenter; its ranks keep in step inside), H = ``period``, h_k the
    inner steps it computes this period (H at first), θ^(k) the outer parameters it took last:

      1. θ^(k) ← the server's θ (the first arrival of a run sets the server's θ from the
         member's: every member starts from the same parameters);
      2. h_k inner steps of the inner optimizer (AdamW) from θ^(k) on its own data; the other
         H − h_k steps of the period are passed over (:meth:`takes_step`), so every member's
         step counter reaches the period's end at about the same time;
      3. at the period's end, member k sends Δ_k = θ^(k) − θ_k, its floating-point buffers and
         its smoothed speed v̄_k (steps per second) to the server, which at once applies
         θ ← DelayedNesterov(θ, Δ_k) (momentum every N arrivals; N = ``nesterov_every``, the
         fleet's datacenters by default) and answers with θ, the mean of the members' latest
         buffers, and every member's latest speed — nobody waits for another member;
      4. θ^(k) ← θ, θ_k ← θ (the inner optimizer's state is kept) — with τ = ``delay`` > 0
         the arrival travels on a thread while the next τ inner steps run, and their local
         progress is kept: θ_k ← θ + (θ_k − θ_k at the send), so that the next Δ_k carries
         it; h_k for the next period
         from the speeds as in ``diloco-dylu`` (step 5 there), less what brings this member
         back to within one period of the first to reach this step:
         h_k ← max(min_steps, round(h_k − v̄_k·(b_k − H/v_max))) where b_k, the seconds it came
         after that one less the lag it started with, exceeds the fastest member's period
         H/v_max (without rounds nothing else would: a member that fell behind in its first
         periods, when its speed was not yet known, would stay behind and the others would
         wait for it at the end); go to 2.
      5. at the end (:meth:`finish`) every member sends its last pseudo-gradient (none when
         it ended on a period's end); the server answers once every member's is in, so all
         deliver the same θ.

    Stale pseudo-gradients are applied as they are (the paper's setting). Only across a
    fleet's datacenters (``lowcomm train --dcs D``), over ``syncdp`` inside each, with no
    warm-up; a relaunched datacenter takes the live state from the next member to arrive;
    a stop (SIGTERM) ends every member at the first period boundary each can still reach (τ
    steps after it with a delay).
    """

    name = "diloco-async"
    Settings = AsyncSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, **arguments):
        super().__init__(model, optimizer, comm, **arguments)
        if not self.route.whole.arrivals:
            raise ConfigError("strategy.name", "diloco-async runs across a fleet's datacenters "
                              "only (lowcomm train --dcs D): its outer state is the fleet "
                              "coordinator's arrival server")
        self.arrivals = 0                       # this member's, answered
        self._unlanded: list[InFlight] = []    # in flight when the loop closed (:meth:`_close`)

    def _init_outer(self, outer_optimizer: str, outer_lr: float, outer_momentum: float,
                    every: int = 1) -> None:
        """θ^(k) only: the outer optimizer is the server's (a placeholder, never stepped, keeps
        the outer loop's state layout)."""
        super()._init_outer("sgd", 1.0, 0.0)

    def _in_turn(self, fn) -> None:
        """Nothing: the buffers travel with each arrival (step 3)."""

    def _start(self, f: Fragment, s: int) -> None:
        """Steps 3–4 at the period's end: the arrival at once, or on the thread (τ > 0), its
        answer taken τ steps later (:meth:`_land`)."""
        local = f.local()
        delta, mine, speed = self._outgoing(f, local), self.buffers.flat_floating(), self._measure()
        if self._thread.pool is None:
            packed, rows, speeds = self._send(f, delta, mine, speed, False, self.t, self.h_local)
            self._take(f, packed, speeds, mine, final=False)
            self._charge(InFlight(f.index, s, s, None), rows)
            return
        future = self._thread.pool.submit(self._send, f, delta, mine, speed, False, self.t, self.h_local)
        f.fly(InFlight(f.index, s, s + self.delay, future, local))

    def _send(self, f: Fragment, delta: torch.Tensor | None, mine: torch.Tensor,
              speed: float | None, final: bool, step: int, steps: int
              ) -> tuple[torch.Tensor, list[dict], tuple | None]:
        """Step 3 by the leader (``delta`` None: no pseudo-gradient to send), sent at inner step
        ``step`` after ``steps`` computed (taken by the caller: on the thread the loop has moved
        on): the server's θ and buffers in one tensor (what a checkpoint keeps of an arrival in
        flight), the arrival's ledger rows, and the speeds; nothing on the datacenter's other
        ranks."""
        self.route.red.ledger.reset()
        if self.route.leaders is None:
            return torch.empty(0), self.route.red.ledger.rows(), None
        theta, buffers, answer = self.route.leaders.arrive(
            delta, self.outer_params[f.index].detach(), mine, step=step, period=self.period,
            steps=steps, speed=speed, final=final)
        return torch.cat([theta, buffers]), self.route.red.ledger.rows(), \
            (answer["speeds"], answer["behind_s"])

    def _land(self, item: InFlight) -> None:
        """Step 4 for an arrival sent τ steps ago: its answer, the local progress since kept."""
        packed, rows, *speeds = self._result(item)   # from a checkpoint: no speeds
        self._charge(item, rows)
        self._take(self.fragments[item.fragment], packed, speeds[0] if speeds else None,
                   self.buffers.flat_floating(), final=False, base=item.base, sent=item.start)

    def _take(self, f: Fragment, packed: torch.Tensor, speeds: tuple | None, mine: torch.Tensor,
              final: bool, base: torch.Tensor | None = None, sent: int | None = None) -> None:
        """Step 4: the server's θ and buffers (``packed``, the leader's) handed on to the
        datacenter's ranks and taken; with ``base`` (the fragment when sent, at inner step
        ``sent``) the progress since kept. Without ``speeds`` (an arrival in flight when a
        checkpoint was written) h_k stays."""
        outer = self.outer_params[f.index]
        theta, buffers = packed[:outer.numel()], packed[outer.numel():]
        inside = self.route.inside
        if inside is not None and inside.size > 1:
            theta = theta.to(outer.dtype).contiguous() if inside.rank == 0 else \
                torch.empty_like(outer.detach())
            inside.bcast_(theta, root=0)
            if mine.numel():
                buffers = (buffers if buffers.numel() == mine.numel() else mine).clone() \
                    if inside.rank == 0 else torch.empty_like(mine)
                inside.bcast_(buffers, root=0)
            speeds = inside.bcast_object(speeds)
        elif self.route.leaders is None:              # no leader above: the run's θ is its own
            theta, buffers = outer.detach().clone(), mine.clone()
        with torch.no_grad():
            outer.copy_(theta.to(outer.dtype))
        if base is None:
            f.unpack_(outer.detach())
            f.dirty = False
        else:                                    # θ_k ← θ + (θ_k − θ_k at the send)
            f.add_(outer.detach() - base)
            if sent == self.t - self.warmup_steps:   # no step since: θ_k = θ
                f.dirty = False
        if buffers.numel() == mine.numel() and mine.numel():
            self.buffers.set_floating(buffers)
        if self._inner is not None:
            self._inner.parameters_changed()
        if not final and speeds is not None:
            self._next_h(torch.tensor(speeds[0], dtype=torch.float64))
            self._catch_up(speeds[1], max(speeds[0]))
        self.arrivals += 1

    def _catch_up(self, behind_s: float, fastest: float) -> None:
        """Step 4's catching up: h_k ← max(min_steps, round(h_k − v̄_k·(b − H/v_max))), b the
        seconds this member reached the period's end after the first member did, less the lag
        it started with (the server's ``behind_s``), H/v_max the fastest member's period: a
        member more than a period behind the others (its first periods ran all H steps before
        its speed was known) comes back to within one. The start-up skew (the members' jobs
        start up to a second apart) is left alone: catching it up would cost the late
        starters' steps for nothing but the last wait."""
        if not self.speed or fastest <= 0:
            return
        late = behind_s - self.period / fastest
        if late > 0:
            self.h_local = min(self.h_local,
                               max(self.min_steps, round(self.h_local - self.speed * late)))

    def _close(self) -> None:
        """An arrival still in flight is kept for :meth:`_finish` to take (its pseudo-gradient
        is in the server's θ already: dropped, the last arrival would send it again)."""
        self.drain()
        self._unlanded = [self.fragments[i.fragment].land() for i in self._in_flight]
        super()._close()

    def _finish(self) -> None:
        """Step 5: the arrivals in flight taken, then the last arrival, answered once every
        member's is in."""
        for item in self._unlanded:
            self._land(item)
        self._unlanded = []
        f = self.fragments[0]
        delta = self._outgoing(f, f.local()) if f.dirty else None
        mine = self.buffers.flat_floating()
        packed, rows, speeds = self._send(f, delta, mine, self.speed, True, self.t, self.h_local)
        self._take(f, packed, speeds, mine, final=True)
        self._charge(InFlight(f.index, self.t, self.t, None), rows)
        for g in self.fragments:
            g.dirty = False

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """DyLU's, and ``arrivals``: this member's arrivals at the periods' ends (the run's
        summary is made before the last arrival; the fleet's counts every one)."""
        out = super().metrics(ctl, final)
        if final:
            out["arrivals"] = self.arrivals
        return out


METHOD = Method("diloco-async", AsyncSettings, AsyncDiLoCo.from_settings, "Asynchronous DiLoCo across a fleet: each "
                "datacenter's pseudo-gradient applied by the coordinator's server as it arrives "
                "(delayed Nesterov), with dynamic local updates", check=check, outer=True,
                level=True, fleet=True, python="AsyncDiLoCo",
                example="diloco-async:period=3,tolerance=0.99")

__all__ = ["AsyncDiLoCo", "AsyncSettings", "METHOD"]
