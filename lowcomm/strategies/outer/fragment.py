"""A fragment of an outer loop: parameter tensors synchronised together, packed into one flat
CPU tensor, that owns its reduction in flight and its merge (as torchft's fragment objects do).

Where the level below shards the model inside each unit, rank i of a unit of k ranks keeps
range i of every fragment only (:class:`Shards`): it packs and sends that range, and the unit
all-gathers the k ranges before a merge.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ...comm.collectives import allgather_, allreduce_, chunk_bounds
from ...comm.comm import Comm
from ...compress.base import Segment
from ...errors import ArgumentError, LowcommError
from ..layout import balance


def done(value) -> Future:
    """A Future that holds ``value`` already."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


@dataclass
class InFlight:
    """A fragment's reduction in flight: sent at local step ``start``, applied after step
    ``apply_at``; ``future`` gives (the average, the ledger rows of its traffic); ``base`` is
    what the local progress is added onto when it lands (add-local, eager), else None."""
    fragment: int
    start: int
    apply_at: int
    future: Future
    base: torch.Tensor | None = None

    def saved(self) -> tuple:
        """What a checkpoint keeps of it (its reduction completed)."""
        avg, rows = self.future.result()
        return self.fragment, self.start, self.apply_at, avg.clone(), rows, self.base

    @classmethod
    def restored(cls, saved) -> InFlight:
        f, s, at, avg, rows, *base = saved
        return cls(f, s, at, done((avg.clone(), list(rows))), *base)


class Shards:
    """Sharded outer state: rank ``inside.rank`` of the unit ``inside`` keeps that range of
    every fragment (k near-equal ranges); gathering the unit's ranges is charged to ``ledger``."""

    def __init__(self, inside: Comm, ledger):
        self.inside, self.ledger = inside, ledger

    def bounds(self, numel: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of a fragment of ``numel`` elements."""
        k, i = self.inside.size, self.inside.rank
        return tuple(chunk_bounds(numel, k)[i:i + 2])

    def gather(self, numel: int, part: torch.Tensor) -> torch.Tensor:
        """The unit's ranges put together (this rank's ``part``)."""
        lo, hi = self.bounds(numel)
        bounds = chunk_bounds(numel, self.inside.size)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        full = torch.empty(numel, dtype=part.dtype)
        full[lo:hi] = part
        with self.inside.charged_to(self.ledger):
            return allgather_(full, self.inside, counts, "mpi")


@dataclass
class Fragment:
    """A set of parameter tensors synchronised together, packed into one flat CPU tensor.

    ``members`` are ``(name, parameter, start, stop)`` in model order; ``offset`` is the step
    (modulo the period) at which the fragment is synchronised; ``flight`` its reduction in
    flight (None: none); ``dirty``: stepped locally since its last synchronisation;
    ``shards``: where the outer state is sharded inside the unit (None: whole)."""
    index: int
    members: list[tuple[str, torch.nn.Parameter, int, int]]
    dtype: torch.dtype
    offset: int
    flight: InFlight | None = field(default=None, repr=False)
    dirty: bool = False
    shards: Shards | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return self.members[-1][3] if self.members else 0

    @cached_property
    def segments(self) -> list[Segment]:
        """The members' places in the fragment (built once: the members never change)."""
        return [Segment(n, p.shape, a, b) for n, p, a, b in self.members]

    @torch.no_grad()
    def pack(self) -> torch.Tensor:
        """A fresh flat CPU copy of the fragment's parameters (in ``dtype``; empty where this
        rank holds none of them)."""
        return torch.cat([p.detach().reshape(-1).to("cpu", self.dtype) for _, p, _, _ in self.members]
                         + [torch.empty(0, dtype=self.dtype)])

    @torch.no_grad()
    def pack_range(self, lo: int, hi: int) -> torch.Tensor:
        """A fresh flat CPU copy of elements ``[lo, hi)`` of :meth:`pack`'s vector (only the
        members that overlap it are read)."""
        parts = [p.detach().reshape(-1)[max(a, lo) - a:min(b, hi) - a].to("cpu", self.dtype)
                 for _, p, a, b in self.members if max(a, lo) < min(b, hi)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def local(self) -> torch.Tensor:
        """The parameters as this rank synchronises them: all, or (sharded) its range."""
        return self.pack() if self.shards is None else self.pack_range(*self.shards.bounds(self.numel))

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """A synchronised value of :meth:`local`'s extent as the whole fragment (sharded: the
        unit's ranges gathered, collective over the unit)."""
        return part if self.shards is None else self.shards.gather(self.numel, part)

    def sent_segments(self) -> list[Segment]:
        """The parameters in what this rank sends (sharded: the pieces of its range)."""
        if self.shards is None:
            return self.segments
        lo, hi = self.shards.bounds(self.numel)
        return [Segment(s.name, (min(s.stop, hi) - max(s.start, lo),), max(s.start, lo) - lo,
                        min(s.stop, hi) - lo) for s in self.segments if max(s.start, lo) < min(s.stop, hi)]

    @torch.no_grad()
    def add_(self, flat: torch.Tensor) -> None:
        """Parameters ← parameters + ``flat``."""
        for _, p, a, b in self.members:
            p.add_(flat[a:b].view(p.shape).to(p.device, p.dtype))

    @torch.no_grad()
    def unpack_(self, flat: torch.Tensor, alpha: float = 0.0) -> None:
        """Parameters ← ``flat`` (``alpha == 0``) or ``alpha·parameters + (1 − alpha)·flat``."""
        for _, p, a, b in self.members:
            src = flat[a:b].view(p.shape)
            if alpha == 0:
                p.copy_(src)
            else:
                p.mul_(alpha).add_(src.to(p.device, p.dtype), alpha=1.0 - alpha)

    def fly(self, item: InFlight) -> None:
        """Hold ``item``, this fragment's reduction sent now."""
        if self.flight is not None:
            raise LowcommError(f"fragment {self.index} sent at step {item.start} while its "
                               f"reduction sent at step {self.flight.start} is in flight: the "
                               "delay must be shorter than the period")
        self.flight = item

    def land(self) -> InFlight:
        """Its reduction in flight, handed over to be applied (none in flight afterwards)."""
        item, self.flight = self.flight, None
        return item

    def merge_(self, synced: torch.Tensor, base: torch.Tensor | None, alpha: float) -> None:
        """Merge the synchronised value ``synced`` (of :meth:`local`'s extent) into the model:
        ``mix`` sets the fragment to α·local + (1 − α)·synchronised; with a ``base`` (add-local,
        eager) to synchronised + (local − base), the local progress made since ``base``."""
        if base is not None:
            self.add_(self.whole(synced - base))
            return
        self.unpack_(self.whole(synced), alpha)
        if alpha == 0:                       # every rank now holds the same fragment
            self.dirty = False


def partition(named: list[tuple[str, torch.nn.Parameter]], fragments: int, period: int,
              early: int = 0, local: dict[str, torch.Tensor] | None = None) -> list[Fragment]:
    """Split parameter tensors into ``fragments`` sets of near-equal size.

    ``local``: where a level below splits the model, this rank's part of each parameter it
    keeps, by name: the fragments are still cut from the whole model's tensors ``named`` (so
    they match an unsplit run's, whatever the stage or piece), and hold this rank's parts of
    their members only (a fragment may hold none: another stage's).

    Largest tensor first into the fragment holding the fewest elements so far (ties: the lower
    index), so each fragment's message is close to 1/P of the model; inside a fragment tensors
    keep model order. Fragment p is synchronised at local steps s with
    ``s % period == ((p + 1) * period // P − early) % period``: the P fragments are spread
    evenly over the period and the last one (all of them when P = 1) at its end, as in DiLoCo
    (``early``: sent that many steps before those slots, torchft's convention)."""
    if int(fragments) != fragments or fragments < 1:
        raise ArgumentError("fragments", f"must be an integer >= 1, got {fragments}")
    if fragments > len(named):
        raise ArgumentError("fragments", f"{fragments} fragments (strategy.fragments in a config) "
                            f"but the model has only {len(named)} trainable parameter tensors (a "
                            f"fragment holds whole tensors); use at most {len(named)}")
    owner = balance([p.numel() for _, p in named], fragments)
    if local is not None:
        owner = [o if name in local else -1 for o, (name, _) in zip(owner, named)]
        named = [(name, local.get(name)) for name, _ in named]
    out = []
    for f in range(fragments):
        members, n, dtype = [], 0, torch.float32
        for i, (name, p) in enumerate(named):
            if owner[i] == f:
                members.append((name, p, n, n + p.numel()))
                n += p.numel()
                dtype = torch.promote_types(dtype, p.dtype)
        out.append(Fragment(f, members, dtype, ((f + 1) * period // fragments - early) % period))
    return out


def average_parameters(named: list[tuple[str, torch.nn.Parameter]], comm: Comm) -> None:
    """Every parameter of ``named`` becomes its average over ``comm``,
    θ ← (1/K) Σ_k θ_k: one dense all-reduce (of the parameters packed in their promoted dtype)."""
    for f in partition(named, 1, 1):
        f.unpack_(allreduce_(f.pack(), comm, "mpi", op="avg"))
