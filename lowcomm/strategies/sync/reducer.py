"""Reducer: bucketed all-reduce of named tensors, overlapped with the backward pass.

Tensors are packed into flat buckets of about ``bucket_bytes`` (one dtype per bucket), in the
order given (SyncDP gives parameters in reverse, the order autograd produces their gradients).
As soon as every tensor of a bucket is marked ready the bucket is handed to one background
thread that all-reduces it with the chosen algorithm on a duplicate of the communicator, while
the caller goes on computing. Buckets are always launched in index order, so every rank issues
the same collectives in the same sequence even when its gradients arrive in another order.

mpi4py releases the GIL inside MPI calls and torch inside its kernels, so the thread overlaps
for real; this is the design Horovod's background thread and PyTorch DDP's reducer share.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...comm.collectives import allreduce_, get_algorithm
from ...comm.comm import Comm
from ...compress.base import Segment, nonfinite_segments
from ...compress.compressor import Compressor
from ..layout import agreed_dup


@dataclass
class Bucket:
    index: int
    names: list[str]
    offsets: list[int]                    # len(names) + 1 offsets into ``flat``
    shapes: list[torch.Size]
    flat: torch.Tensor
    pending: set[int] = field(default_factory=set)
    future: Future | None = None
    #: one slot per tensor, 1 where this rank gave it a gradient this round (0: none); the
    #: ranks' sum says which tensors no rank gave one (their average is then None, as in DDP).
    #: A dense bucket carries them after its tensors in ``flat`` (no message of their own)
    present: torch.Tensor | None = None
    mine: list[int] = field(default_factory=list)    # this rank's slots, written at the send
    #: a bucket of tensors expected to get no gradient (frozen parameters): reduced only in a
    #: round where some rank gave one of them a gradient (see :class:`Reducer`'s ``idle``)
    idle: bool = False

    def view(self, i: int) -> torch.Tensor:
        return self.views[i]

    @functools.cached_property
    def views(self) -> list[torch.Tensor]:
        """Each tensor's place in ``flat``, shaped (made once: ``flat`` is never replaced)."""
        return [self.flat[self.offsets[i]:self.offsets[i + 1]].view(self.shapes[i])
                for i in range(len(self.names))]

    @functools.cached_property
    def segments(self) -> list[Segment]:
        """Its tensors as named segments of ``flat`` (built once)."""
        return [Segment(n, s, self.offsets[i], self.offsets[i + 1])
                for i, (n, s) in enumerate(zip(self.names, self.shapes))]


@dataclass(frozen=True)
class ReducerSettings:
    """How a :class:`Reducer` reduces: ``algorithm``, an all-reduce algorithm name
    (:data:`lowcomm.comm.collectives.ALGORITHM_NAMES`; "auto" chooses per bucket size);
    ``bucket_bytes``, the target bucket size (a tensor larger than this gets a bucket of its
    own); ``op``, "avg" or "sum"; ``overlap``: reduce buckets on a background thread as they
    fill (else in :meth:`Reducer.flush`)."""
    algorithm: str = "mpi"
    bucket_bytes: int = 4 << 20
    op: str = "avg"
    overlap: bool = True

    def __post_init__(self):
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")


class Reducer:
    """Average (or sum) named tensors over ``comm``, bucket by bucket.

    Args:
        comm: the communicator.
        named: ``(name, tensor)`` pairs fixing names, shapes, dtypes and bucket order; the same
            on every rank (checked once, here, so the hot path needs no per-call check).
        settings: the algorithm, bucket size, op and overlap (:class:`ReducerSettings`).
        levels: the topology's communicators (:meth:`lowcomm.comm.topology.Topology.comms`), needed by
            ``algorithm = "hierarchical"`` (the Reducer runs it on a duplicate of them).
        compressor: reduce each bucket with this compressor (its payload on the wire) instead
            of a dense all-reduce; ``op`` must then be "avg".
        idle: names of tensors expected to get no gradient (frozen parameters, which a user may
            unfreeze later). They get buckets of their own, after the others, and such a bucket
            is sent only in a round where some rank gave one of its tensors a gradient: the
            ranks agree on that with one all-reduce of an int32 per idle bucket at the end of
            each round (after the other buckets, not overlapped with backward).

    A tensor no rank marked ready with a gradient in a round (``ready(name, None)`` or never
    marked: a parameter unused on every rank) comes back as None from :meth:`flush`, as torch
    DDP leaves such a ``p.grad`` None, so an optimizer skips it instead of stepping on a zero
    gradient (Adam's momentum would still move it). The ranks agree on it with one slot per
    tensor carried after the tensors in a dense bucket (an all-reduce of a few more bytes), or,
    with a compressor (whose payload must not carry them), one small all-reduce of the slots
    per round.

    Non-finite values are never sent: a tensor holding NaN/Inf is reduced as zeros on this rank
    and after :meth:`flush` its name is in :attr:`withheld` (the names of that round) for the
    caller, who raises or skips the step.

    Example::

        red = Reducer(comm, [(n, p) for n, p in reversed(list(model.named_parameters()))])
        for name, p in ...: red.ready(name, p.grad)
        for name, g in red.flush(): ...   # averaged tensors, views into the buckets
    """

    def __init__(self, comm: Comm, named: list[tuple[str, torch.Tensor]],
                 settings: ReducerSettings = ReducerSettings(), *,
                 compressor: Compressor | None = None, levels=None, idle=()):
        algorithm, bucket_bytes = settings.algorithm, settings.bucket_bytes
        op, overlap = settings.op, settings.overlap
        get_algorithm(algorithm, levels)
        if compressor is not None and op != "avg":
            raise ValueError(f"a compressor averages; op must be 'avg', got {op!r}")
        self.comm, self.algorithm, self.op, self.overlap = comm, algorithm, op, overlap
        self.compressor = compressor
        self.withheld: list[str] = []     # tensors that held NaN/Inf in the last round (zeroed)
        self._withholding: list[str] = []   # ... in the round in progress (the thread appends)
        self.buckets: list[Bucket] = []
        self._where: dict[str, tuple[int, int]] = {}
        idle = set(idle)
        for name, t in [x for x in named if x[0] not in idle] + [x for x in named if x[0] in idle]:
            nbytes = t.numel() * t.element_size()
            b = self.buckets[-1] if self.buckets else None
            fits = b is not None and b.flat.dtype == t.dtype and b.idle == (name in idle) and \
                (b.offsets[-1] * t.element_size() + nbytes <= bucket_bytes or not b.names)
            if not fits:
                b = Bucket(len(self.buckets), [], [0], [], torch.empty(0, dtype=t.dtype),
                           idle=name in idle)
                self.buckets.append(b)
            self._where[name] = (b.index, len(b.names))
            b.names.append(name)
            b.shapes.append(t.shape)
            b.offsets.append(b.offsets[-1] + t.numel())
        # own message space, the layout agreed once (no per-call check)
        sig = repr([(b.names, [tuple(s) for s in b.shapes], str(b.flat.dtype), b.idle)
                    for b in self.buckets])
        self._thread_comm = agreed_dup(comm, "reducer.layout", sig, len(self.buckets), what="tensors",
                                       mine=f"{sum(len(b.names) for b in self.buckets)} tensors in "
                                            f"{len(self.buckets)} buckets")
        device = named[0][1].device
        shared = self.registered_buckets(device)
        slots = 0 if compressor is not None else 1     # the presence slots ride in dense buckets
        for b in self.buckets:
            n = b.offsets[-1] + slots * len(b.names)
            b.flat = self._thread_comm.shared_tensor(n, b.flat.dtype) if shared else \
                torch.zeros(n, dtype=b.flat.dtype, device=device)
            b.present = b.flat[b.offsets[-1]:] if slots else torch.zeros(len(b.names), dtype=torch.int32)
            b.mine = [0] * len(b.names)
        # hierarchical: the topology's communicators, duplicated for the same reason
        self._levels = levels.dup() if levels is not None and algorithm in ("hierarchical", "auto") \
            else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-reducer") if overlap else None
        self._next = 0          # the next bucket to launch; launches happen in index order
        self.reset()

    def registered_buckets(self, device: torch.device) -> bool:
        """Whether the buckets live in the node's shared memory, registered with the reduction
        communicator (:meth:`~lowcomm.comm.comm.Comm.shared_tensor`), so that a dense
        all-reduce (``auto`` or ``shm``) of a bucket reads the other ranks' buckets in place,
        with no staging copy: CPU buckets on a communicator of one node. Collective (every rank
        gets the same answer)."""
        return self.compressor is None and self.algorithm in ("auto", "shm") and \
            device.type == "cpu" and self.comm.size > 1 and self._thread_comm.node_local()

    @property
    def nbytes(self) -> int:
        return sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)

    def reset(self) -> None:
        for b in self.buckets:
            b.pending = set(range(len(b.names)))
            b.future = None
        self._next = 0

    def ready(self, name: str, tensor: torch.Tensor | None) -> None:
        """Copy ``tensor`` (``None``: no gradient here, sent as zeros) into its bucket; launch
        full buckets in order."""
        bi, i = self._where[name]
        b = self.buckets[bi]
        if i not in b.pending:
            return
        view = b.view(i)
        b.mine[i] = 0 if tensor is None else 1
        if tensor is None:
            view.zero_()
        elif tensor.data_ptr() != view.data_ptr():     # not already the bucket's view
            view.copy_(tensor)
        b.pending.discard(i)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].pending and \
                not self.buckets[self._next].idle:      # idle ones: at the flush, if wanted
            b = self.buckets[self._next]
            b.future = self._pool.submit(self._reduce, b)
            self._next += 1

    def _reduce(self, b: Bucket) -> None:
        """Check, then reduce one bucket in place (dense all-reduce or the compressor)."""
        b.present.copy_(torch.tensor(b.mine, dtype=b.present.dtype))
        for s in nonfinite_segments(b.flat, b.segments):
            b.flat[s.start:s.stop].zero_()
            self._withholding.append(s.name)
        if self.compressor is None:
            if self._thread_comm.size > 1:      # one rank: its own sum and average already
                allreduce_(b.flat, self._thread_comm, self.algorithm, self.op, levels=self._levels)
        else:
            b.flat.copy_(self.compressor.reduce(b.flat, f"bucket{b.index}", self._thread_comm, b.segments))

    def is_pending(self, name: str) -> bool:
        bi, i = self._where[name]
        return i in self.buckets[bi].pending

    def flush(self):
        """Wait for all buckets and return ``[(name, reduced view or None)]``: None for a
        tensor that no rank gave a gradient this round; one that some ranks did not is reduced
        with zeros from those (a parameter unused on that rank). :attr:`withheld` then names
        the tensors of this round that were not finite here."""
        for b in self.buckets:
            for i in sorted(b.pending):
                self.ready(b.names[i], None)
        for b in self.buckets:
            if b.future is not None:
                b.future.result()
            elif not b.idle:
                self._reduce(b)
        self._reduce_idle()
        if self.compressor is not None and self._thread_comm.size > 1:
            present = torch.cat([b.present for b in self.buckets])
            self._thread_comm.allreduce_(present, "sum")
            for b, part in zip(self.buckets, present.split([len(b.names) for b in self.buckets])):
                b.present.copy_(part)
        out = [(name, view if float(seen) > 0 else None) for b in self.buckets
               for name, view, seen in zip(b.names, b.views, b.present.tolist())]
        self.withheld, self._withholding = self._withholding, []
        self.reset()
        return out

    def _reduce_idle(self) -> None:
        """Reduce the idle buckets that some rank gave a gradient to this round (agreed by one
        small all-reduce); the others are left out, their tensors None for every rank."""
        idle = [b for b in self.buckets if b.idle]
        if not idle:
            return
        wanted = torch.tensor([int(any(b.mine)) for b in idle], dtype=torch.int32)
        if self._thread_comm.size > 1:
            self._thread_comm.allreduce_(wanted, "sum")
        for b, want in zip(idle, wanted.tolist()):
            if want:
                self._reduce(b)
            else:
                b.present.zero_()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
