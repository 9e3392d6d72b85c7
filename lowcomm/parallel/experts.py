"""Mixture-of-experts layers (``MoE``) and expert parallelism: the experts spread over the ranks
of a communicator, tokens dispatched to the rank that owns their expert and returned with
all-to-all.

GShard (Lepikhin et al. 2020, arXiv 2006.16668) and Switch Transformer (Fedus et al. 2021,
arXiv 2101.03961). For a group of T tokens (the tokens one rank passes in one call) and E
expert MLPs:

  1. the router (a linear map, no bias) gives each token the probabilities p(x) = softmax(W x)
     over the experts; the token goes to its top-k experts (k = 1: Switch; k = 2: GShard), with
     the gate p_e(x) for k = 1 and the top-k probabilities renormalised to sum to 1 for k ≥ 2;
  2. each expert takes at most C = ⌈cf · T · k / E⌉ assignments (the capacity, cf the capacity
     factor, computed exactly from the decimal cf); the assignments are served choice by choice,
     every token's first choice before any second choice, each choice in token order (GShard's
     priority); an assignment past its expert's capacity is *dropped*: it adds nothing (a
     residual connection around the layer carries the token on);
  3. y(x) = Σ over the token's kept assignments of gate · expert_e(x);
  4. the load-balancing loss (Switch, eq. 4) is E · Σ_i f_i · P_i, with f_i the fraction of the
     T·k assignments routed to expert i (before the capacity: what the router asked for) and
     P_i the mean router probability of expert i over the T tokens (1 when the load is
     uniform; its gradient flows through P only).

Expert parallelism (:meth:`MoE.distribute_`, :func:`expert_parallel`): rank r of R holds the
experts [r·E/R, (r+1)·E/R) (E must be a multiple of R). Per call, on every rank of the
communicator together: the kept assignments' rows are sorted by expert, the per-expert counts
exchanged (``alltoall.counts``, R·E/R int64 each way), the rows sent to their experts' ranks
(``alltoall.dispatch``), each rank runs its experts on the rows it got, and the outputs go back
(``alltoall.combine``); the backward pass sends the gradients the reverse way
(``alltoall.combine.grad``, ``alltoall.dispatch.grad``). Rows for a rank's own experts never
leave it, so a rank's dispatch bytes are (kept assignments to other ranks' experts) × d ×
element size, and its combine bytes (rows other ranks sent it) × d × element size. Each
expert's parameters get the gradient of every rank's tokens routed to it (a sum); the router
and the rest of the model are replicated (their gradients are each rank's own, to be averaged
by a data-parallel method as usual; the ``ep`` method, :mod:`lowcomm.parallel.ep`, does both).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.comm import Comm
from ..errors import ConfigError, LowcommError
from ..settings import Settings


@dataclass
class MoESettings(Settings):
    """The settings of a :class:`MoE` layer (``[task]`` keys of the MoE task)."""
    experts: int = 4                # E, expert MLPs per layer
    top_k: int = 1                  # experts per token: 1 (Switch) or 2 (GShard), at most E
    capacity_factor: float = 1.25   # cf: an expert takes at most ceil(cf * T * k / E) assignments
    hidden: int | None = None       # the experts' hidden width (default 4 x d_model)
    aux_coef: float = 0.01          # alpha: the load-balancing loss's weight in the model's loss

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "experts", 1)
        self.within(prefix, "top_k", 1, self.experts)
        self.within(prefix, "capacity_factor", 0, float("inf"), low_open=True)
        if self.hidden is not None:
            self.at_least(prefix, "hidden", 1)
        self.at_least(prefix, "aux_coef", 0)


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """⌈cf · T · k / E⌉: the assignments one expert takes from a group of ``tokens`` (``factor``
    read as the decimal it prints as, so 1.1 · 10 · 1 / 1 is 11, not 12)."""
    return math.ceil(Fraction(repr(float(factor))) * tokens * top_k / experts)


@dataclass
class Routing:
    """Where the T tokens of a group go: k·T assignments, choice-major (assignment j·T + t is
    token t's (j+1)-th choice)."""
    expert: torch.Tensor    # (k·T,) int64: the expert of each assignment
    gate: torch.Tensor      # (k·T,) float32: its weight (differentiable)
    keep: torch.Tensor      # (k·T,) bool: within its expert's capacity
    probs: torch.Tensor     # (T, E) float32: the router's probabilities
    capacity: int

    @property
    def token(self) -> torch.Tensor:
        """(k·T,) the token of each assignment."""
        return torch.arange(self.expert.numel(), device=self.expert.device) % self.probs.shape[0]


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing of a group's router ``logits`` (T, E) under a capacity (module docstring,
    steps 1–2)."""
    T, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_i = probs.topk(top_k, dim=-1)
    if top_k > 1:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    expert, gate = top_i.T.reshape(-1), top_p.T.reshape(-1)
    onehot = F.one_hot(expert, E)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1      # the assignment's place in its queue
    cap = capacity(T, E, top_k, capacity_factor)
    return Routing(expert, gate, position < cap, probs, cap)


def load_balancing_loss(r: Routing) -> torch.Tensor:
    """Switch's auxiliary loss E · Σ_i f_i · P_i of a routing (module docstring, step 4); 0 for
    an empty group."""
    T, E = r.probs.shape
    if T == 0:
        return r.probs.sum()
    f = torch.bincount(r.expert, minlength=E).float() / r.expert.numel()
    return E * (f * r.probs.mean(0)).sum()


def _expert(d_model: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))


def check_spread(experts: int, comm: Comm, key: str = "experts") -> None:
    """A ConfigError naming ``key`` unless ``experts`` spread evenly over ``comm``'s ranks."""
    if experts % comm.size:
        raise ConfigError(key, f"{experts} experts cannot be spread evenly over the {comm.size} "
                          f"ranks of level {comm.level!r}: give a multiple of {comm.size}")


def _tracked(t: torch.Tensor) -> torch.Tensor:
    """``t``, part of the autograd graph whenever gradients are on: every rank then runs the
    all-to-all's backward, whether or not its own input needs a gradient."""
    return t.detach().requires_grad_() if torch.is_grad_enabled() and not t.requires_grad else t


def exchange_rows(comm: Comm, rows: torch.Tensor, send: list[int], recv: list[int],
                  op: str) -> torch.Tensor:
    """All-to-all of rows: ``send[j]`` rows of ``rows`` (in order) go to rank j, ``recv[j]``
    rows come from rank j; charged to ``comm``'s ledger as ``op``."""
    d, size = rows.shape[1], rows.element_size()
    got = comm.alltoallv(list(rows.detach().split(send)), [n * d * size for n in recv], op=op)
    return torch.cat(got).view(rows.dtype).view(-1, d)


class _Exchange(torch.autograd.Function):
    """:func:`exchange_rows` with its backward: the gradients sent back the way the rows came
    (row ``op + ".grad"``)."""

    @staticmethod
    def forward(ctx, rows, comm, send, recv, op):
        ctx.how = comm, send, recv, op
        return exchange_rows(comm, rows, send, recv, op)

    @staticmethod
    def backward(ctx, grad):
        comm, send, recv, op = ctx.how
        return exchange_rows(comm, grad.contiguous(), recv, send, op + ".grad"), None, None, None, None


def by_expert(counts: torch.Tensor) -> torch.Tensor:
    """The rows of R source blocks, each holding ``counts[s, l]`` rows for local expert l in
    expert order, reordered expert by expert (within an expert: by source)."""
    R, L = counts.shape
    expert = torch.arange(L, device=counts.device).repeat(R).repeat_interleave(counts.reshape(-1))
    return torch.argsort(expert, stable=True)


class MoE(nn.Module):
    """A mixture-of-experts MLP (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): top-k
    routing under a capacity, expert MLPs, the load-balancing loss (module docstring).

    After each forward pass: ``aux_loss`` (E · Σ f_i P_i, a tensor in the graph),
    ``routed`` (the assignments, k·T), ``dropped`` (assignments over capacity),
    ``dropped_fraction`` (their share) and ``tokens_dropped`` (tokens none of whose
    assignments was kept). :meth:`distribute_` spreads the experts over the ranks of a
    communicator (expert parallelism).

    Args:
        d_model: the width of the tokens.
        settings: a validated :class:`MoESettings`; otherwise its fields as keywords.

    Example::

        moe = MoE(64, experts=8, top_k=2, capacity_factor=1.25)
        y = x + moe(x)                                 # x: (..., 64)
        loss = task_loss(y) + moe.aux_coef * moe.aux_loss
    """

    def __init__(self, d_model: int, *, settings: MoESettings | None = None, **options):
        super().__init__()
        s = settings if settings is not None else MoESettings.from_options(options)
        if settings is not None:
            s.validate()
        self.settings, self.d_model = s, d_model
        self.router = nn.Linear(d_model, s.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): _expert(d_model, s.hidden or 4 * d_model)
                                      for e in range(s.experts)})
        self.comm: Comm | None = None
        self.aux_loss = torch.zeros(())
        self.routed = self.dropped = self.tokens_dropped = 0

    @property
    def aux_coef(self) -> float:
        return self.settings.aux_coef

    @property
    def dropped_fraction(self) -> float:
        """The share of the last call's assignments dropped over capacity."""
        return self.dropped / self.routed if self.routed else 0.0

    def owner(self, expert: int) -> int:
        """The rank of :attr:`comm` that holds ``expert`` (0 when not distributed)."""
        return expert // (self.settings.experts // self.comm.size) if self.comm else 0

    def distribute_(self, comm: Comm, placeholders: bool = False, key: str = "experts") -> "MoE":
        """Keep this rank's experts only (rank r of R: experts [r·E/R, (r+1)·E/R)); from now
        on every call is collective over ``comm``. The layer must be the same on every rank.
        ``placeholders``: the other ranks' experts stay, on the meta device (names and shapes,
        no storage), so every rank's model has the same parameter layout (what a method over
        the ranks checks); :meth:`whole_` gives them storage again. ``key``: the setting a
        ConfigError names when E is no multiple of R."""
        E, R = self.settings.experts, comm.size
        check_spread(E, comm, key)
        if self.comm is not None:
            raise ConfigError(key, "this MoE layer is distributed already")
        L = E // R
        for e in range(E):
            if e // L != comm.rank:
                if placeholders:
                    self.experts[str(e)].to("meta")
                else:
                    del self.experts[str(e)]
        self.comm = comm
        return self

    def whole_(self, device: torch.device) -> "MoE":
        """Undo :meth:`distribute_` with placeholders: the other ranks' experts get storage on
        ``device`` again (uninitialised: load their state next), and calls are local again."""
        if self.comm is None:
            return self
        if len(self.experts) != self.settings.experts:
            raise LowcommError("MoE.whole_(): the other ranks' experts were dropped, not kept "
                               "as placeholders (distribute_(comm, placeholders=True))")
        for e in self.experts.values():
            if any(p.is_meta for p in e.parameters()):
                e.to_empty(device=device)
        self.comm = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE of d_model={self.d_model} got tokens of width {x.shape[-1]}")
        flat = x.reshape(-1, self.d_model)
        r = route(self.router(flat), self.settings.top_k, self.settings.capacity_factor)
        self.aux_loss = load_balancing_loss(r)
        self._count(r)
        kept = r.keep.nonzero().squeeze(1)
        order = kept[torch.argsort(r.expert[kept], stable=True)]
        counts = torch.bincount(r.expert[order], minlength=self.settings.experts)
        rows = flat[r.token[order]]
        out = self._local(rows, counts) if self.comm is None else self._dispatched(rows, counts)
        y = torch.zeros_like(flat).index_add(0, r.token[order],
                                             out * r.gate[order].unsqueeze(1).to(out.dtype))
        return y.reshape(x.shape)

    def _count(self, r: Routing) -> None:
        k = self.settings.top_k
        self.routed, self.dropped = r.keep.numel(), int((~r.keep).sum())
        self.tokens_dropped = int((~r.keep.view(k, -1)).all(0).sum())

    def _local(self, rows: torch.Tensor, counts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """The experts ``first``, ``first + 1``, … on consecutive runs of ``counts`` rows."""
        parts = rows.split(counts.tolist())
        outs = [self.experts[str(first + e)](p) for e, p in enumerate(parts)]
        return torch.cat(outs) if outs else rows

    def _dispatched(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert to the experts' ranks, through them, and back (module
        docstring)."""
        comm, R = self.comm, self.comm.size
        L = self.settings.experts // R
        mine = counts.view(R, L)
        theirs = comm.alltoall(mine.contiguous(), op="alltoall.counts")   # [s, l]: rows from s
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
        got = _Exchange.apply(_tracked(rows), comm, send, recv, "alltoall.dispatch")
        perm = by_expert(theirs.to(got.device))
        out = self._local(got[perm], theirs.sum(0), comm.rank * L)
        back = torch.empty_like(out).index_copy(0, perm, out)      # in the order received
        return _Exchange.apply(_tracked(back), comm, recv, send, "alltoall.combine")


def moe_layers(model: nn.Module) -> list[MoE]:
    """The :class:`MoE` layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's MoE layers of ``aux_coef`` · their last call's load-balancing loss
    (what a task adds to its loss)."""
    layers = moe_layers(model)
    return sum((m.aux_coef * m.aux_loss for m in layers), torch.zeros(()))


def expert_parallel(model: nn.Module, comm: Comm, placeholders: bool = False,
                    key: str = "experts") -> list[MoE]:
    """Spread the experts of every :class:`MoE` layer of ``model`` (built alike on every rank of
    ``comm``) over ``comm``'s ranks (:meth:`MoE.distribute_`, its ``placeholders`` and
    ``key``); returns the layers."""
    layers = moe_layers(model)
    if not layers:
        raise ConfigError("model", f"{type(model).__name__} has no MoE layer to spread over ranks")
    for m in layers:        # every layer checked before any changes: whole on an error
        check_spread(m.settings.experts, comm, key)
    return [m.distribute_(comm, placeholders, key) for m in layers]


__all__ = ["MoE", "MoESettings", "Routing", "aux_loss", "by_expert", "capacity", "check_spread",
           "exchange_rows", "expert_parallel", "load_balancing_loss", "moe_layers", "route"]
