"""CommBase: the half of :class:`~lowcomm.comm.comm.Comm` that needs no MPI call of its own —
its settings, the agreement check on a collective's arguments, staging, the ledger it charges,
and the bookkeeping of the node's shared memory.

Each MPI call it relies on is one of the abstract methods :class:`~lowcomm.comm.comm.Comm`
implements in :mod:`lowcomm.comm.comm`, the only module that uses mpi4py.
"""
from __future__ import annotations

import os
import zlib
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import CommError
from .idle import IdleWait
from .ledger import Ledger
from .tensors import host_only, mismatch, nbytes, shape_meta, staged
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .comm import SharedWindow


#: the launchers' count of the job's ranks on this node (Open MPI, MPICH/Hydra)
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


class CommBase(ABC):
    """A communicator's ``rank``, ``size``, ``level``, ``ledger`` and the checks and staging
    around its calls (see :class:`~lowcomm.comm.comm.Comm` for the arguments)."""

    # as a :class:`~lowcomm.comm.roles.Peers` and :class:`~lowcomm.comm.roles.Whole`: MPI's ranks
    rounds = per_rank = late_rounds = arrivals = False
    channel = dcs = None

    def __init__(self, rank: int, size: int, level: str, ledger: Ledger | None, validate: bool,
                 watchdog: Watchdog):
        self.rank, self.size, self.level = rank, size, level
        self.ledger = ledger if ledger is not None else Ledger()
        self.validate = validate
        self.watchdog = watchdog
        #: α–β model (:class:`~lowcomm.comm.topology.LinkModel`) of the links this communicator's
        #: traffic crosses, where a topology says (:meth:`lowcomm.comm.topology.Topology.comms`
        #: sets it); None: unknown. Duplicates keep it.
        self.link = None
        self._pinned: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._node_ranks: int | None = None         # _on_my_node()'s cached answer
        self._window: SharedWindow | None = None     # shared_window()'s window, kept
        self._registered: list[SharedWindow] = []    # shared_tensor()'s windows, kept
        self.auto_policy = None   # lowcomm.comm.collectives' auto choice, agreed once per Comm
        #: how a call waits (:class:`~lowcomm.comm.idle.IdleWait`: tests between sleeps); None:
        #: the vendor's blocking call, which polls the network on the calling core. A
        #: communicator driven by a background thread sets it, so that its waits leave the core
        #: to the computation (see :meth:`lowcomm.comm.comm.Comm._call`).
        self.idle: IdleWait | None = None

    def __repr__(self) -> str:
        return f"Comm(level={self.level!r}, rank={self.rank}, size={self.size})"

    # what the MPI side provides ---------------------------------------------------------------
    @abstractmethod
    def _gather_meta(self, op: str, meta: np.ndarray) -> np.ndarray:
        """Every rank's ``meta`` as rows of a table (one all-gather), charged as ``check``."""

    @abstractmethod
    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Gather ``t`` from every rank: a tensor of shape ``(size, *t.shape)``."""

    @abstractmethod
    def _count_node_ranks(self) -> int:
        """How many ranks of this communicator share this rank's node (collective)."""

    @abstractmethod
    def _new_window(self, slot_bytes: int) -> "SharedWindow":
        """A new shared-memory window of ``slot_bytes`` per rank (collective)."""

    # checks -----------------------------------------------------------------------------------
    def check(self, op: str, t: torch.Tensor, root: int = -1) -> None:
        """Raise :class:`CommError` on every rank unless all ranks pass the same dtype and shape
        to the same ``op``. Costs one small all-gather; skipped when ``validate`` is off."""
        if not self.validate or self.size == 1:
            return
        meta = shape_meta(op, t, root)
        wrong = mismatch(self._gather_meta(op, meta), meta)
        if wrong is not None:
            raise CommError(op, self.rank, wrong, nbytes(t))

    def _host_only(self, op: str, *ts: torch.Tensor) -> None:
        """Point-to-point and non-blocking calls take contiguous CPU tensors as they are."""
        host_only(op, self.rank, *ts)

    def disagreeing(self, signature: str, count: int) -> list[int]:
        """The ranks whose ``(signature, count)`` differ from rank 0's (a crc32 of ``signature``,
        one all-gather): e.g. a bucket or fragment layout that every rank must share."""
        crc = torch.tensor([zlib.crc32(signature.encode()), count], dtype=torch.int64)
        seen = self.allgather(crc)
        return [r for r in range(self.size) if not torch.equal(seen[r], seen[0])]

    # staging and charging ---------------------------------------------------------------------
    def staged(self, t: torch.Tensor, read: bool = True, write: bool = True):
        """Yield a contiguous 1-D CPU tensor holding ``t``'s values; copy it back on exit.

        A contiguous CPU tensor is used in place. A CUDA tensor goes through a pinned host
        buffer reused across calls, after synchronising the current stream.
        """
        return staged(t, self._pinned, read, write)

    @contextmanager
    def charged_to(self, ledger: Ledger):
        """Inside, this communicator's traffic is recorded in ``ledger`` (a request posted
        inside is charged to it whenever it completes). One thread's use: not for a
        communicator another thread is using."""
        old, self.ledger = self.ledger, ledger
        try:
            yield self
        finally:
            self.ledger = old

    # the node ---------------------------------------------------------------------------------
    def node_local(self) -> bool:
        """True when every rank of this communicator can share memory with every other (one
        node): ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` keeps all of them. Collective the
        first time (the answer is cached; every rank gets the same one)."""
        return self._on_my_node() == self.size

    def _on_my_node(self) -> int:
        """How many ranks of this communicator share this rank's node (collective the first
        time; cached)."""
        if self._node_ranks is None:
            self._node_ranks = 1 if self.size == 1 else self._count_node_ranks()
        return self._node_ranks

    def cores_per_rank(self) -> float:
        """The CPU cores this rank can count on: those it may run on (its affinity), at most
        the node's cores shared out among the job's ranks on the node, as the launcher tells
        (``OMPI_COMM_WORLD_LOCAL_SIZE``, ``MPI_LOCALNRANKS``; else this communicator's ranks on
        the node, collectively): one core each for 2 ranks on 2 cores, bound or not; 0.5 for 4."""
        local = next((int(os.environ[v]) for v in _LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()),
                     None) or self._on_my_node()
        mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return min(mine or 1, (os.cpu_count() or 1) / local)

    def _need_node(self, op: str, nbytes: int, why: str) -> None:
        """Raise :class:`CommError` naming the level unless its ranks share one node."""
        if not self.node_local():
            raise CommError(op, self.rank, f"the {self.size} ranks of level {self.level!r} do "
                            f"not share one node (MPI_COMM_TYPE_SHARED split them); {why}", nbytes)

    def shared_window(self, slot_bytes: int) -> "SharedWindow":
        """This communicator's :class:`~lowcomm.comm.comm.SharedWindow` of ``slot_bytes`` bytes per
        rank (allocated collectively on first use and kept; a later call asking for more
        reallocates, so every rank must ask for the same size in the same order). Raises
        :class:`CommError` naming the level when the ranks do not share one node."""
        w = self._window
        if w is not None and w.slot_bytes >= slot_bytes:
            return w
        self._need_node("shared_window", slot_bytes,
                        "a shared-memory collective needs a node-local communicator")
        if w is not None:
            w.free()
        self._window = self._new_window(slot_bytes)
        return self._window

    def shared_tensor(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D tensor of ``numel`` elements that lives in a shared-memory window of
        this node-local communicator (collective: every rank asks for the same ``numel`` and
        ``dtype`` in the same order), *registered* with it: an all-reduce of this tensor (or of
        a contiguous slice of it, every rank passing the same slice) with algorithm ``shm`` or
        ``auto`` reads the other ranks' tensors where they lie, with no copy into a staging
        buffer (:func:`lowcomm.comm.collectives.shm`; NCCL's user-buffer registration,
        ``ncclMemAlloc`` + ``ncclCommRegister``, is the same idea). The window is kept for the
        communicator's life. Raises :class:`CommError` naming the level off one node."""
        es = torch.empty(0, dtype=dtype).element_size()
        self._need_node("shared_tensor", numel * es, "a registered buffer needs a node-local "
                        "communicator")
        win = self._new_window(max(1, numel) * es)
        self._registered.append(win)
        return win.slot(self.rank, dtype)[:numel].zero_()

    def registered(self, t: torch.Tensor) -> "tuple[SharedWindow, list[torch.Tensor]] | None":
        """For a contiguous CPU tensor inside one of :meth:`shared_tensor`'s windows: the window
        and every rank's tensor at the same place (``[j]`` is rank j's, ``[self.rank]`` is
        ``t``'s memory); else None."""
        if not self._registered or t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr, size = t.data_ptr(), nbytes(t)
        for win in self._registered:
            base = win.base
            if base <= ptr and ptr + size <= base + win.slot_bytes and \
                    (ptr - base) % t.element_size() == 0:
                at = (ptr - base) // t.element_size()
                return win, [win.slot(j, t.dtype)[at:at + t.numel()] for j in range(self.size)]
        return None


class WindowBase:
    """Every rank's slot of a shared-memory window as tensors over the shared pages (no copy):
    a :attr:`HEADER` holding the rank's sync counter, then ``slot_bytes`` of data.
    :class:`~lowcomm.comm.comm.SharedWindow` allocates the window and fences the counters.

    Args:
        comm: the node-local communicator; slot ``j`` is its rank j's.
        slot_bytes: the data bytes per rank.
        mems: each rank's memory of ``HEADER + slot_bytes`` bytes, in rank order.
    """

    HEADER = 64       # bytes before each slot's data: the sync counter, on its own cache line

    def __init__(self, comm: CommBase, slot_bytes: int, mems: list):
        self.comm, self.slot_bytes = comm, int(slot_bytes)
        total = self.HEADER + self.slot_bytes
        self._data = [torch.frombuffer(m, dtype=torch.uint8, count=total)[self.HEADER:] for m in mems]
        self._counters = [np.frombuffer(m, dtype=np.int64, count=1) for m in mems]
        self._slots: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._mine = self._counters[comm.rank]
        self.base = self._data[comm.rank].data_ptr()    # where this rank's slot starts
        self._mine[0] = 0
        self._seq = 0

    def slot(self, j: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Rank ``j``'s slot viewed as ``dtype`` (whole elements; the views are made once)."""
        key = (j, dtype)
        view = self._slots.get(key)
        if view is None:
            es = torch.empty(0, dtype=dtype).element_size()
            view = self._slots[key] = self._data[j][:self.slot_bytes - self.slot_bytes % es].view(dtype)
        return view

    def _arrive(self):
        """Bump this rank's counter (its stores fenced before); return the test that every
        other rank's counter has reached it."""
        self._seq += 1
        seq = self._seq
        self._mine[0] = seq
        others = [c for j, c in enumerate(self._counters) if j != self.comm.rank]
        return lambda: all(c[0] >= seq for c in others)

    def _forget(self) -> None:
        """Drop every view of the shared pages (before the window is freed)."""
        self._data, self._counters, self._slots = [], [], {}


__all__ = ["CommBase", "SharedWindow"]
