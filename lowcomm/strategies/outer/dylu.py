"""DiLoCo with dynamic local updates: each member takes as many of a period's inner steps as
its measured speed allows, so that members of different speeds arrive at the round together."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ...comm.comm import Comm
from ...errors import ConfigError, LowcommError
from ..method import Method
from .diloco import DiLoCo, DiLoCoSettings
from .fragment import Fragment
from .loop import check_run


@dataclass
class DyLUSettings(DiLoCoSettings):
    """``[strategy]`` keys of ``diloco-dylu``: DiLoCo's, the floor of a member's local steps,
    and the outer optimizer of asynchronous DiLoCo (delayed Nesterov)."""
    aggregate_refusal = ("diloco-dylu weights each member's pseudo-gradient by its steps and "
                         "carries the members' speeds in the same round; a robust rule over "
                         "them is not built: use diloco")
    min_steps: int = 1             # the fewest inner steps a member takes in a period
    tolerance: float = 0.1         # a member this close to the fastest takes the whole period
    smoothing: float = 0.5         # weight of the newest period in each member's speed (EMA)
    outer_optimizer: str = "delayed-nesterov"
    nesterov_every: int = 1        # N: with one outer step per round, 1 is Nesterov's momentum

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.at_least(prefix, "min_steps", 1)
        self.within(prefix, "tolerance", 0, 1, high_open=True)
        self.within(prefix, "smoothing", 0, 1, low_open=True)
        if self.min_steps > self.period:
            raise ConfigError.at(prefix, "min_steps", f"a member takes at most period={self.period} "
                                 f"steps a period; min_steps={self.min_steps} would never be met")
        if self.compressor != "none":
            raise ConfigError.at(prefix, "compressor", "dynamic local updates send each member's "
                                 "weight and speed beside its pseudo-gradient, which a compressor "
                                 "would distort; use compressor = \"none\"")


class DyLUDiLoCo(DiLoCo):
    """DiLoCo with dynamic local updates (Liu et al. 2024, "Asynchronous Local-SGD Training for
    Language Modeling", arXiv 2401.09135, §3.3) and their delayed Nesterov outer optimizer
    (§3.2), in synchronous rounds: a member slower than the others takes fewer inner steps per
    period, so that nobody waits for it, and its pseudo-gradient counts for the tokens it took.

    Update, with H = ``period``, members k (datacenters of a fleet, or the units of the level
    the method runs on), h_k the inner steps member k takes in the current period (h_k = H in
    the first):

      1. as DiLoCo step 1;
      2. member k computes the first h_k inner steps of the period and passes over the other
         H − h_k (:meth:`takes_step` is False: the loop neither draws their batches nor
         computes them); its speed v_k = h_k / (the seconds its steps took: from the end of
         the step or pass before each to its own end — the rounds, the waits for them and the
         steps passed over left out), smoothed over the periods:
         v̄_k ← s·v_k + (1 − s)·v̄_k (s = ``smoothing``; the paper's is 1);
      3. at the period's end, the pseudo-gradients averaged with weights w_k = h_k (the tokens
         each member took): Δ = Σ_k w_k Δ_k / Σ_k w_k; the speeds travel in the same
         all-reduce (one slot per member);
      4. outer step θ ← OuterOpt(θ, Δ) (``outer_optimizer``: delayed Nesterov by default,
         :class:`~lowcomm.strategies.outer.diloco.DelayedNesterov`);
      5. every member sets h_k ← H where v̄_k ≥ (1 − ``tolerance``)·max_j v̄_j (members that
         differ by no more than timing noise, e.g. processes sharing cores, are equals), else
         h_k ← max(``min_steps``, round(H · v̄_k / max_j v̄_j)): a member at half the fastest's
         speed takes about H/2; go to 2. (The paper's rule is ``tolerance`` = 0.)

    The schedule's step counter is the same on every member (passed steps count), so the rounds,
    checkpoints and a fleet's heals fall on the same steps as DiLoCo's. With equal speeds every
    h_k = H and this is DiLoCo (with ``outer_optimizer = "nesterov"``: bit for bit on two
    members). Not over sharded units, not streaming (``fragments`` = 1, ``delay`` = 0), not with
    a compressor.

    In your own loop, ask before computing a step::

        for step, batch in enumerate(batches):
            if not opt.takes_step():
                opt.pass_step()                  # this member's share of the period is done
                continue
            opt.zero_grad(); loss_fn(model(batch)).backward(); opt.step()
    """

    name = "diloco-dylu"
    Settings = DyLUSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, **arguments):
        super().__init__(model, optimizer, comm, **arguments)
        if self.route.sharded or self.route.local is not None:
            raise ConfigError("policy", "diloco-dylu over sharded units (zero1/zero2/fsdp) is not "
                              "supported: each rank would reduce its own range's speeds; use "
                              "syncdp inside the units")
        self.min_steps, self.tolerance = self.settings.min_steps, self.settings.tolerance
        self.smoothing = self.settings.smoothing
        self.speed: float | None = None          # v̄_k, steps per second (smoothed)
        self.h_local = self.period               # inner steps this member takes this period
        self.slot, self.slots = self._place()
        self.clock = time.perf_counter             # seconds, for the speed (a test may set its own)
        self._last_end: float | None = None        # the clock at the end of the last step or pass
        self._busy, self._computed = 0.0, 0        # this period's steps: their seconds, count
        self._advance_s = 0.0                      # seconds of the last step's schedule (rounds)
        self.passed = 0
        self.history: list[int] = []             # h_local of every period, for the summary

    def _place(self) -> tuple[int, int]:
        """This member's slot among the members of the outer level (a fleet's datacenter
        index; a rank of the leaders' communicator; a rank of a flat run), agreed by the
        ranks of its unit."""
        inside, across = self.route.inside, self.route.leaders if self.nest is not None else self.route.red
        mine = None
        if across is not None:                   # a fleet's channel: its datacenter of dcs
            mine = (across.dc, across.dcs) if across.dcs is not None else (across.rank, across.size)
        if inside is not None and inside.size > 1:
            mine = inside.bcast_object(mine)
        return mine

    # the schedule ------------------------------------------------------------------------------
    def _position(self) -> int | None:
        """The next step's place in its period (1..H), None in the warm-up."""
        s = self.t - self.warmup_steps
        return None if s < 0 else s % self.period + 1

    def takes_step(self) -> bool:
        p = self._position()
        if p is None:
            return True
        if self._last_end is None:
            self._last_end = self.clock()
        return p <= self.h_local

    def pass_step(self) -> None:
        if self._closed:
            raise LowcommError("DyLUDiLoCo.pass_step() after finish()/close(): the method has ended")
        if self.takes_step():
            raise LowcommError(f"step {self.t + 1} is this member's to compute (it takes "
                               f"{self.h_local} of every {self.period}): call step() after its "
                               "backward pass, pass_step() only where takes_step() is False")
        self.passed += 1
        self.zero_grad()
        self._advance()
        self._last_end = self.clock()

    def _step(self, closure=None):
        if not self.takes_step():
            raise LowcommError(f"step {self.t + 1} is one this member passes over (it takes "
                               f"{self.h_local} of every {self.period} inner steps, as its speed "
                               "allows): ask takes_step() before computing a step and call "
                               "pass_step() where it is False")
        now = self.clock()                       # the batch, forward and backward so far
        self._busy += now - (self._last_end if self._last_end is not None else now)
        self._computed += 1
        self._advance_s = 0.0
        out = super()._step(closure)
        self._last_end = self.clock()            # and the update, less the round's seconds
        self._busy += self._last_end - now - self._advance_s
        return out

    def _advance(self) -> None:
        """The schedule after a step (rounds, their waits), its seconds kept apart from the
        step's (step 2's speed)."""
        t0 = self.clock()
        super()._advance()
        self._advance_s = self.clock() - t0

    # the round ---------------------------------------------------------------------------------
    def _reduce(self, f: Fragment, flat: torch.Tensor, t: int):
        """DiLoCo's reduction of [w·Δ_k, w, the speeds' slots] (step 3), then the next h_k
        from the speeds every member received alike (step 5)."""
        speed = self._measure()
        extra = torch.zeros(1 + self.slots, dtype=flat.dtype)
        extra[0] = self.h_local
        extra[1 + self.slot] = speed
        out, rows = super()._reduce(f, torch.cat([flat * self.h_local, extra]), t)
        n = flat.numel()
        self._next_h(out[n + 1:])
        return out[:n] / out[n].item(), rows

    def _measure(self) -> float:
        """This member's smoothed speed v̄_k, with the period that ends now (step 2)."""
        measured = self._computed / self._busy if self._busy > 0 else 0.0
        self._busy, self._computed = 0.0, 0
        self.speed = measured if self.speed is None else \
            self.smoothing * measured + (1 - self.smoothing) * self.speed
        return self.speed

    def _next_h(self, speeds: torch.Tensor) -> None:
        """h_k of the next period from every member's speed (step 5)."""
        fastest = speeds.max().item()
        self.history.append(self.h_local)
        if fastest > 0 and math.isfinite(fastest):
            share = speeds[self.slot].item() / fastest
            self.h_local = self.period if share >= 1 - self.tolerance else \
                min(self.period, max(self.min_steps, round(self.period * share)))

    # state --------------------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        """DiLoCo's, the steps this member takes this period, those it passed over, and the
        period's steps so far and their seconds (a resumed period measures its speed on)."""
        return dict(super()._state_dict(), h_local=self.h_local, passed=self.passed,
                    period_s=self._busy, computed=self._computed, history=list(self.history),
                    speed=self.speed)

    def _load_state_dict(self, state: dict) -> None:
        super()._load_state_dict(state)
        self.h_local, self.passed = int(state["h_local"]), int(state["passed"])
        self.history = [int(h) for h in state["history"]]
        self.speed = None if state["speed"] is None else float(state["speed"])
        self._busy, self._computed = float(state["period_s"] or 0.0), int(state["computed"])

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        out = super().metrics(ctl, final)
        if final:
            out["local_steps"] = {"min_steps": self.min_steps, "by_period": list(self.history),
                                  "passed": self.passed}
        return out


METHOD = Method("diloco-dylu", DyLUSettings, DyLUDiLoCo.from_settings, "DiLoCo with dynamic local updates: each "
                "member takes the share of a period its measured speed allows, weighted by its "
                "tokens; delayed Nesterov outside", check=check_run, outer=True, level=True,
                # the example's ranks share cores, so their speeds differ by timing alone: with
                # tolerance 0.99 every rank takes every step and a run is reproducible (resumes
                # bit for bit); check_outer tests the speeds' rule on a loop clock
                python="DyLUDiLoCo", example="diloco-dylu:period=3,tolerance=0.99",
                compare=("strategy.period=50",))

__all__ = ["DyLUDiLoCo", "DyLUSettings", "METHOD"]
