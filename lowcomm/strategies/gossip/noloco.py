"""NoLoCo: local steps, then an outer step that averages with one random peer through a modified
Nesterov momentum; no collective during training."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...settings import Settings
from ..base import LocalSteps
from ..layout import agreed_dup
from ..method import Context, Method, refuse_gradient_compressor
from ..buffers import Buffers, persistent_buffers
from .message import Layout, consensus_distance
from .graphs import random_pairs
from ..outer.fragment import average_parameters

TAG = 91_000                 # on the strategy's own duplicated communicator


@dataclass
class NoLoCoSettings(Settings):
    """``[strategy]`` keys of ``noloco`` (the spec ``noloco:period=50,outer_lr=0.7``; the
    reference's configurations: H = 50, outer lr 0.7, outer momentum 0.5)."""
    period: int = 50               # H: inner steps between outer steps
    outer_lr: float = 0.7          # β: weight of the pair's mean pseudo-gradient
    outer_momentum: float = 0.5    # α: the outer momentum's decay
    gamma: float | None = None     # γ: pull towards the pair's mean outer weights (None: β)
    seed: int = 0                  # the pairings' shared seed

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "period", 1)
        self.within(prefix, "outer_lr", 0, float("inf"), low_open=True)
        self.within(prefix, "outer_momentum", 0, 1, high_open=True)
        if self.gamma is not None:
            self.within(prefix, "gamma", 0, float("inf"), low_open=True)
        self.at_least(prefix, "seed", 0)


def check_run(s: NoLoCoSettings, cfg, prefix: str) -> None:
    refuse_gradient_compressor(cfg, "noloco exchanges parameters with one peer, not gradients")


def build(s: NoLoCoSettings, model, optimizer, comm: Comm, ctx: Context) -> "NoLoCo":
    return NoLoCo(model, optimizer, comm, settings=s)


class NoLoCo(LocalSteps):
    """NoLoCo, no-all-reduce low-communication training (Kolehmainen, Blagoev, Donaghy, Ersoy &
    Nies 2025, arXiv 2506.10911; the reference code ``jkolehm/noloco``, ``SparseOptimizerC``
    with groups of 2): DiLoCo's inner and outer steps, except that the outer step meets one
    random peer instead of every rank, and its momentum also pulls a rank's outer weights
    towards its peer's.

    Update on rank i, with H = ``period``, α = ``outer_momentum``, β = ``outer_lr``, γ =
    ``gamma`` (default β, as the reference), θ_i the model, φ_i the outer weights, δ_i the
    outer momentum:

      1. every θ_i ← rank 0's parameters and buffers (broadcast at construction), φ_i ← θ_i,
         δ_i ← 0;
      2. H inner steps of the wrapped optimizer on the rank's own data: θ_i ← InnerOpt(θ_i, g_i);
         its state (Adam's moments) stays local;
      3. outer step r: the ranks are paired by a uniformly random permutation drawn from
         (``seed``, r) on every rank alike (:func:`~lowcomm.strategies.gossip.graphs.random_pairs`;
         nothing is sent to agree on it); rank i and its peer j exchange θ (one ``sendrecv``),
         and φ too where γ ≠ β;
      4. with the pair's means θ̄ = (θ_i + θ_j)/2, φ̄ = (φ_i + φ_j)/2:
         ``δ_i ← α δ_i + β (θ̄ − φ̄) + γ (φ̄ − φ_i)`` — the mean pseudo-gradient
         (1/2) Σ (θ − φ) plus the pull of φ_i towards its peer's (with γ = β this is
         ``α δ_i + β (θ̄ − φ_i)``, and only θ is sent);
      5. φ_i ← φ_i + δ_i, θ_i ← φ_i; floating buffers (BatchNorm's statistics) ← the pair's
         mean; go to 2.

    No collective runs during training: a rank sends ``B·d`` bytes (d trainable elements of B
    bytes, plus its floating buffers; twice that where γ ≠ β) once every H steps, whatever the
    number of ranks. With an odd number of ranks the rank the permutation leaves alone takes
    steps 4–5 on its own (θ̄ = θ_i, φ̄ = φ_i): the reference requires the rank count to be a
    multiple of the group size instead.

    The ranks' models differ during training by design (they meet in pairs only; the
    ``consensus_distance`` logged is the mean ‖θ_i − θ̄‖ over the ranks). :meth:`finish`
    delivers their average, θ ← (1/K) Σ_k θ_k with floating buffers averaged and integer ones
    rank 0's (one dense all-reduce at the end, charged to the run, as gossip's): a run's
    ``ranks_agree`` is about that delivered model.

    Args:
        model, optimizer: the user's torch objects (``optimizer`` makes the inner steps; Adam in
            the paper).
        comm: communicator (default: world).
        period: H ≥ 1 inner steps between outer steps.
        outer_lr, outer_momentum, gamma: β > 0, α in [0, 1), γ > 0 (None: β).
        seed: the pairings' seed (≥ 0).

    Example::

        opt = NoLoCo(model, torch.optim.AdamW(model.parameters(), lr=6e-4), period=50)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "noloco"
    Settings = NoLoCoSettings
    #: resized: every new rank starts from the network average of the models, the outer weights
    #: φ and the momenta δ; the pairings go on from the next outer step on the new rank count
    averaged_state = ("phi", "delta")

    def _setup(self, s: NoLoCoSettings) -> None:
        self.period, self.seed = s.period, s.seed
        self.alpha, self.beta = s.outer_momentum, s.outer_lr
        self.gamma = s.outer_lr if s.gamma is None else s.gamma
        self._named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not self._named:
            raise ValueError("NoLoCo needs trainable parameters")
        self._layout = Layout(self._named, weight=False)
        self._buffer_layout = Layout([(n, b) for n, b in persistent_buffers(self.model)
                                       if b.is_floating_point()], weight=False)
        broadcast_(self.comm, list(self.model.state_dict().values()), root=0)
        # a rank with another period or seed would wait for a peer that never comes: refused
        sig = repr((s.period, s.seed, [(n, str(p.dtype), tuple(p.shape)) for n, p in self._named]))
        self._p2p = agreed_dup(self.comm, "noloco.layout", sig, len(self._named),
                               what="parameters or settings (period, seed)",
                               mine=f"period={s.period}, seed={s.seed}")
        self.buffers = Buffers(self.model)
        self.phi = self._layout.flats()                        # φ_i, one flat tensor per dtype
        self.delta = [torch.zeros_like(f) for f in self.phi]   # δ_i
        self.t = 0
        self.rounds = 0                       # outer steps taken
        self.alone = 0                        # of which without a peer (odd rank counts)

    def partner(self, round: int | None = None) -> int | None:
        """This rank's peer in outer step ``round`` (default: the next one); None: alone."""
        r = self.rounds if round is None else round
        return random_pairs(self._p2p.size, self.seed, r)[self._p2p.rank]

    def _exchange(self, layout: Layout, flats: list[torch.Tensor], peer: int) -> list[torch.Tensor]:
        """The pair's mean of ``flats`` (laid out by ``layout``): one ``sendrecv`` with ``peer``."""
        send, recv = layout.new(), layout.new()
        for v, f in zip(layout.views(send), flats):
            v.copy_(f)
        self._p2p.sendrecv_(send, peer, recv, peer, TAG)
        return [(f + v).div_(2) for f, v in zip(flats, layout.views(recv))]

    @torch.no_grad()
    def _outer(self) -> None:
        """Steps 3–5."""
        peer = self.partner()
        theta = self._layout.flats()
        if peer is None:
            self.alone += 1
            pulled = [t - p for t, p in zip(theta, self.phi)]
        else:
            theta_bar = self._exchange(self._layout, theta, peer)
            if self.gamma == self.beta:
                pulled = [t - p for t, p in zip(theta_bar, self.phi)]
            else:
                phi_bar = self._exchange(self._layout, self.phi, peer)
                g = self.gamma / self.beta
                pulled = [(t - q).add_(q - p, alpha=g) for t, q, p in zip(theta_bar, phi_bar, self.phi)]
            if self._buffer_layout.groups:
                self._buffer_layout.unpack(self._exchange(self._buffer_layout,
                                                          self._buffer_layout.flats(), peer))
        for d, p, u in zip(self.delta, self.phi, pulled):
            d.mul_(self.alpha).add_(u, alpha=self.beta)
            p.add_(d)
        self._layout.unpack(self.phi)
        self.rounds += 1

    def _advance(self) -> None:
        self.t += 1
        if self.t % self.period == 0:
            self._outer()

    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t, "rounds": self.rounds,
                "alone": self.alone, "phi": [p.clone() for p in self.phi],
                "delta": [d.clone() for d in self.delta]}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.t, self.rounds, self.alone = int(state["t"]), int(state["rounds"]), int(state["alone"])
        self.phi = [p.clone() for p in state["phi"]]
        self.delta = [d.clone() for d in state["delta"]]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The outer weights φ and momentum δ, as optimizer state."""
        return {"state": [*self.phi, *self.delta]}

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if final:
            return {"period": self.period, "outer_steps": self.rounds, "outer_steps_alone": self.alone}
        return {"consensus_distance": consensus_distance(self._layout, ctl)}

    def _finish(self) -> None:
        """Deliver the average of the ranks' models (one dense all-reduce, charged), floating
        buffers averaged, integer ones rank 0's."""
        average_parameters(self._named, self.comm)
        self.buffers.average(self.comm)


METHOD = Method("noloco", NoLoCoSettings, build, "NoLoCo: local steps, then an outer step "
                "averaging with one random peer through a modified Nesterov momentum (no "
                "collective)", check=check_run, python="NoLoCo",
                example="noloco:period=2", compare=("strategy.period=50",))
