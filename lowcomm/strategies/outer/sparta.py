"""SPARTA: local steps, and every step the ranks average a small random subset of their
parameters, alone or under a DiLoCo outer loop."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...compress.sparsify import distinct_sample
from ...errors import ConfigError
from ...settings import Settings
from ..base import LocalSteps, Strategy
from ..layout import agreed_dup
from ..method import Context, Method, refuse_gradient_compressor
from ..buffers import Buffers
from .diloco import DiLoCo, DiLoCoSettings
from .fragment import average_parameters
from .loop import check_run


def check_fraction(fraction: float, prefix: str = "strategy.") -> float:
    if not 0 < fraction <= 1:
        raise ConfigError(prefix + "fraction", f"must be in (0, 1] (the share of parameters "
                          f"averaged every step), got {fraction}")
    return float(fraction)


class SparseAverage:
    """Every call, the ranks average the same ``k = max(1, round(fraction · n))`` of the n
    elements of ``params`` (a uniformly random k-subset, drawn from a generator seeded alike on
    every rank and advanced alike, so no index is sent), in place: one all-reduce of k values.
    The generator's state is saved with ``state_dict()``."""

    def __init__(self, params: list[torch.Tensor], fraction: float, seed: int = 0):
        self.params = params
        self.fraction = check_fraction(fraction)
        sizes = [p.numel() for p in params]
        self.n = sum(sizes)
        if self.n == 0:
            raise ValueError("SPARTA needs trainable parameters")
        self.k = max(1, round(self.fraction * self.n))
        self.offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        self.dtype = params[0].dtype
        for p in params[1:]:
            self.dtype = torch.promote_types(self.dtype, p.dtype)
        self.seed = int(seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    def indices(self) -> torch.Tensor:
        """The next subset: sorted flat indices into the concatenated parameters (advances the
        generator)."""
        return distinct_sample(self.n, self.k, self.gen, "cpu").sort().values

    @torch.no_grad()
    def average_(self, comm: Comm | None, inside: Comm | None = None) -> torch.Tensor:
        """Average the next subset over ``comm`` in place; returns its indices. Under a
        per-level policy whose units hold equal parameters, ``comm`` is the units' leaders
        (None off a leader) and ``inside`` the unit: the leader's average is handed on inside."""
        idx = self.indices()
        cuts = torch.searchsorted(idx, self.offsets).tolist()
        device = self.params[0].device
        values = torch.empty(self.k, dtype=self.dtype, device=device)
        pieces = []
        for i, p in enumerate(self.params):
            lo, hi = cuts[i], cuts[i + 1]
            if hi > lo:
                local = (idx[lo:hi] - self.offsets[i]).to(p.device)
                values[lo:hi] = p.detach().view(-1).index_select(0, local).to(device, self.dtype)
                pieces.append((p, local, lo, hi))
        if comm is not None and comm.size > 1:
            comm.allreduce_(values, "avg")
        if inside is not None and inside.size > 1:
            inside.bcast_(values, root=0)
        for p, local, lo, hi in pieces:
            p.detach().view(-1).index_copy_(0, local, values[lo:hi].to(p.device, p.dtype))
        return idx

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


def _sparse_comm(comm: Comm, params: list[torch.Tensor]) -> Comm:
    """A duplicate of ``comm`` (same ledger) for the subset's all-reduce, its layout agreed."""
    return agreed_dup(comm, "sparta.layout", repr([(str(p.dtype), tuple(p.shape)) for p in params]),
                      len(params))


@dataclass
class SpartaSettings(Settings):
    """``[strategy]`` keys of ``sparta`` (the spec ``sparta:fraction=0.005``)."""
    fraction: float = 0.005        # p: share of the parameters averaged every step
    seed: int = 0                  # the shared generator of the subsets

    def validate(self, prefix: str = "") -> None:
        check_fraction(self.fraction, prefix)


@dataclass
class SpartaDiLoCoSettings(DiLoCoSettings):
    """``[strategy]`` keys of ``sparta-diloco``: DiLoCo's, and SPARTA's ``fraction`` and
    ``seed``."""
    fraction: float = 0.005
    seed: int = 0

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_fraction(self.fraction, prefix)


def build(s, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    if isinstance(s, SpartaDiLoCoSettings):
        return SpartaDiLoCo(model, optimizer, comm, **s.kwargs(ctx))
    return Sparta(model, optimizer, comm, settings=s)


def check_sparta(s: SpartaSettings, cfg, prefix: str) -> None:
    """SPARTA sends parameters, not gradients: the run's gradient compressor would do nothing."""
    refuse_gradient_compressor(cfg, "sparta averages parameters and compresses nothing")


class Sparta(LocalSteps):
    """SPARTA, sparse parameter averaging (as in EXO's gym, ``SPARTAStrategy``): local steps of
    the wrapped optimizer, and after each the ranks average a small random subset of the
    parameters.

    Update, on each of K ranks, step t, with n the number of parameter elements (the frozen
    ones the optimizer holds too: unfrozen later, they are averaged like the others):

      1. ranks start from rank 0's parameters and buffers (broadcast at construction);
      2. the wrapped optimizer steps on the local gradient: θ_k ← InnerOpt(θ_k, g_k);
      3. ``I_t`` = a uniformly random subset of ``k = max(1, round(p·n))`` of the n elements,
         drawn from a generator seeded alike on every rank, so every rank draws the same I_t
         and no index is sent (:class:`SparseAverage`);
      4. ``θ_k[I_t] ← (1/K) Σ_j θ_j[I_t]`` (one all-reduce of k values); the other elements are
         untouched.

    The optimizer's state (momentum, Adam moments) stays local. At the end (:meth:`finish`) the
    parameters are averaged in full and floating-point buffers averaged (integer ones rank
    0's): one dense all-reduce. Gym draws a Bernoulli(p) mask per element and broadcasts it
    from rank 0; here the subset has exactly k elements and costs no broadcast.
    Bytes per rank and step: an all-reduce of k values, i.e. ``p`` × a dense all-reduce of the
    parameters (flat in K).

    Args:
        model, optimizer: the user's torch objects (the optimizer makes the local steps).
        comm: communicator (default: world).
        fraction: p in (0, 1], the share of the elements averaged every step (gym: 0.005).
        seed: the shared generator's seed.

    Example::

        opt = Sparta(model, torch.optim.AdamW(model.parameters(), lr=1e-3), fraction=0.005)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "sparta"
    Settings = SpartaSettings
    unfreezes = True

    def _setup(self, s: SpartaSettings) -> None:
        self._named = self.members()              # frozen ones too: unfrozen later, averaged
        self.sparse = SparseAverage([p for _, p in self._named], s.fraction, s.seed)
        broadcast_(self.comm, list(self.model.state_dict().values()), root=0)
        self._sparse_comm = _sparse_comm(self.comm, self.sparse.params)
        self.buffers = Buffers(self.model)
        self.t = 0

    def _advance(self) -> None:
        self.sparse.average_(self._sparse_comm)
        self.t += 1

    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t,
                "sparse": self.sparse.state_dict()}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.t = int(state["t"])
        self.sparse.load_state_dict(state["sparse"])

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        return {"fraction": self.sparse.fraction, "averaged_per_step": self.sparse.k,
                "steps": self.t} if final else {}

    def _finish(self) -> None:
        """Every parameter averaged over the ranks (one dense all-reduce per dtype), buffers
        averaged (integer ones rank 0's)."""
        average_parameters(self._named, self.comm)
        self.buffers.average(self.comm)


class SpartaDiLoCo(DiLoCo):
    """SPARTA under a DiLoCo outer loop (EXO's gym ``SPARTADiLoCoStrategy``): every inner step
    is followed by :class:`Sparta`'s sparse average, and every H steps by DiLoCo's outer step.

    Update, on each of K ranks, after inner step t (W = ``warmup_steps``, H = ``period``):

      1. t ≤ W: a dense SyncDP step, as DiLoCo's warm-up;
      2. t > W: the wrapped optimizer's local step, then SPARTA's steps 3–4: the ranks average
         the same random ``k = max(1, round(p·n))`` parameter elements;
      3. when (t − W) is a multiple of H: DiLoCo's outer step on the averaged pseudo-gradient
         (steps 3–5 of :class:`~lowcomm.strategies.outer.diloco.DiLoCo`), which sets every rank to
         the same parameters.

    Bytes per rank: an all-reduce of k values every step, plus DiLoCo's pseudo-gradient every H.

    Args:
        fraction, seed: SPARTA's (see :class:`Sparta`); the others as
            :class:`~lowcomm.strategies.outer.diloco.DiLoCo`'s.

    Example::

        opt = SpartaDiLoCo(model, torch.optim.AdamW(model.parameters()), period=100, fraction=0.005)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "sparta-diloco"
    Settings = SpartaDiLoCoSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, **arguments):
        super().__init__(model, optimizer, comm, **arguments)
        s = self.settings
        if self.route.local is not None:
            raise ConfigError("policy", "sparta-diloco over fsdp is not supported (its subsets "
                              "are drawn over whole parameters): use zero1 or zero2 inside")
        self.sparse = SparseAverage([p for _, p in self.members()], s.fraction, s.seed)
        # the subset's average: over every rank, or (a per-level policy, whose level below keeps
        # a unit's ranks equal) through the units' leaders, handed on inside the unit
        below = self.nest is not None and self.nest.inside is not None
        across = self.nest.leaders if below else self.comm
        self._sparse_comm = _sparse_comm(across, self.sparse.params) if across is not None else None

    def _sparse_average(self) -> None:
        self.sparse.average_(self._sparse_comm, self.route.inside)

    def _step(self, closure=None):
        driver = self._driver
        loss = self.optimizer.step(closure) if driver is None else driver.step(closure)
        if self._dense is None:                   # after the warm-up's dense steps
            self._sparse_average()
        self._advance()
        return loss

    def _skip_step(self) -> None:
        if self._dense is None:
            if self._inner is not None:
                self._inner.skip()
            else:
                self.zero_grad()
            self._sparse_average()
            self._advance()
        else:
            super()._skip_step()

    def _state_dict(self) -> dict:
        return dict(super()._state_dict(), sparse=self.sparse.state_dict())

    def _load_state_dict(self, state: dict) -> None:
        super()._load_state_dict(state)
        self.sparse.load_state_dict(state["sparse"])

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        out = super().metrics(ctl, final)
        return dict(out, fraction=self.sparse.fraction, averaged_per_step=self.sparse.k) if final else out


METHOD = Method("sparta", SpartaSettings, build, "SPARTA: local steps, and every step the ranks "
                "average the same small random subset of the parameters", check=check_sparta,
                python="Sparta", example="sparta:fraction=0.05", compare=("strategy.fraction=0.005",))
DILOCO_METHOD = Method("sparta-diloco", SpartaDiLoCoSettings, build, "SPARTA under DiLoCo: a "
                       "sparse average every step and an outer step every H", check=check_run,
                       outer=True, level=True, python="SpartaDiLoCo",
                       example="sparta-diloco:period=3,fraction=0.05",
                       compare=("strategy.period=50", "strategy.fraction=0.005"))
