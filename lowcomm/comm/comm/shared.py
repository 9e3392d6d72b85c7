"""Shared memory of :class:`~lowcomm.comm.comm.Comm`: MPI-3 shared windows over a node-local
communicator, registered buffers, and the cores a rank can count on."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import CommError
from .base import mpi

if TYPE_CHECKING:
    from .core import Comm

#: the launchers' count of the job's ranks on this node (Open MPI, MPICH/Hydra)
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
#: SharedWindow.sync: seconds a waiting rank polls (yielding its core between polls to any
#: thread that wants it) before it naps; a rank with a core of its own sees its peers arrive at
#: once, and an oversubscribed one hands the core over at every poll
_SHM_YIELD_S = 0.002


class SharedMemory:
    """The shared-memory part of :class:`~lowcomm.comm.comm.Comm` (a mixin: it calls the
    communicator's ``_guard`` and keeps ``_node_ranks``, ``_window`` and ``_registered``)."""

    # shared memory (MPI-3 shared windows) --------------------------------------------------------
    def node_local(self) -> bool:
        """True when every rank of this communicator can share memory with every other (one
        node): ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`` keeps all of them. Collective the
        first time (the answer is cached; every rank gets the same one)."""
        return self._on_my_node() == self.size

    def _on_my_node(self) -> int:
        """How many ranks of this communicator share this rank's node (collective the first
        time; cached)."""
        if self._node_ranks is None:
            if self.size == 1:
                self._node_ranks = 1
            else:
                sub = self._guard("split_shared", 0, self.mpi.Split_type, mpi().COMM_TYPE_SHARED,
                                  self.rank)
                self._node_ranks = sub.Get_size()
                sub.Free()
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

    def shared_window(self, slot_bytes: int) -> "SharedWindow":
        """This communicator's :class:`SharedWindow` of ``slot_bytes`` bytes per rank (allocated
        collectively on first use and kept; a later call asking for more reallocates, so every
        rank must ask for the same size in the same order). Raises :class:`CommError` naming the
        level when the ranks do not share one node."""
        w = self._window
        if w is not None and w.slot_bytes >= slot_bytes:
            return w
        if not self.node_local():
            raise CommError("shared_window", self.rank, f"the {self.size} ranks of level "
                            f"{self.level!r} do not share one node (MPI_COMM_TYPE_SHARED split "
                            f"them); a shared-memory collective needs a node-local communicator",
                            slot_bytes)
        if w is not None:
            w.free()
        self._window = SharedWindow(self, slot_bytes)
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
        if not self.node_local():
            raise CommError("shared_tensor", self.rank, f"the {self.size} ranks of level "
                            f"{self.level!r} do not share one node; a registered buffer needs "
                            f"a node-local communicator", numel * es)
        win = SharedWindow(self, max(1, numel) * es)
        self._registered.append(win)
        return win.slot(self.rank, dtype)[:numel].zero_()

    def registered(self, t: torch.Tensor) -> "tuple[SharedWindow, list[torch.Tensor]] | None":
        """For a contiguous CPU tensor inside one of :meth:`shared_tensor`'s windows: the window
        and every rank's tensor at the same place (``[j]`` is rank j's, ``[self.rank]`` is
        ``t``'s memory); else None."""
        if not self._registered or t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for win in self._registered:
            base = win.base
            if base <= ptr and ptr + nbytes <= base + win.slot_bytes and \
                    (ptr - base) % t.element_size() == 0:
                at = (ptr - base) // t.element_size()
                return win, [win.slot(j, t.dtype)[at:at + t.numel()] for j in range(self.size)]
        return None


class SharedWindow:
    """An MPI-3 shared-memory window (``MPI_Win_allocate_shared``) over a node-local Comm:
    ``slot_bytes`` bytes of data per rank, every rank's slot mapped into every process.

    ``slot(j)`` is rank j's data as a tensor (no copy: loads and stores go straight to the
    shared pages). :meth:`sync` is a barrier through the window itself: each rank bumps a
    counter in its slot's header and waits until every counter has reached it, with
    ``MPI_Win_sync`` fences on both sides (MPI-3.1 §11.5.5's recipe for load/store access).
    A waiting rank polls with ``sched_yield`` between polls for up to ``_SHM_YIELD_S``, then
    sleeps in short naps: with a core of its own it sees its peers arrive at once, and on an
    oversubscribed node it hands its core to the ranks still working at every poll (an
    ``MPI_Barrier`` spins, stealing the core from them). The wait runs under the communicator's watchdog,
    so a rank that never arrives ends the job with a message naming the op, not a hang.
    """

    HEADER = 64       # bytes before each slot's data: the sync counter, on its own cache line

    def __init__(self, comm: Comm, slot_bytes: int):
        MPI = mpi()
        self.comm, self.slot_bytes = comm, int(slot_bytes)
        total = self.HEADER + self.slot_bytes
        self.win = comm._guard("shared_window", total, MPI.Win.Allocate_shared,
                               total, 1, MPI.INFO_NULL, comm.mpi)
        self.win.Lock_all(MPI.MODE_NOCHECK)     # one passive epoch for the window's life
        self._raw, self._data = [], []
        self._slots: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        for j in range(comm.size):
            mem, _ = self.win.Shared_query(j)
            raw = torch.frombuffer(mem, dtype=torch.uint8, count=total)
            self._raw.append(raw)
            self._data.append(raw[self.HEADER:])
        self._counters = [np.frombuffer(mem, dtype=np.int64, count=1)
                          for mem in (self.win.Shared_query(j)[0] for j in range(comm.size))]
        self._mine = self._counters[comm.rank]
        self.base = self._data[comm.rank].data_ptr()    # where this rank's slot starts
        self._mine[0] = 0
        self._seq = 0
        self.comm._guard("shared_window", 0, self.comm.mpi.Barrier)   # counters zeroed

    def slot(self, j: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Rank ``j``'s slot viewed as ``dtype`` (whole elements; the views are made once)."""
        key = (j, dtype)
        view = self._slots.get(key)
        if view is None:
            es = torch.empty(0, dtype=dtype).element_size()
            view = self._slots[key] = self._data[j][:self.slot_bytes - self.slot_bytes % es].view(dtype)
        return view

    def sync(self, op: str = "shm.sync") -> None:
        """Make this rank's stores visible to every rank and wait until all have arrived."""
        self._seq += 1
        seq = self._seq
        self.win.Sync()              # my data stores before my counter store
        self._mine[0] = seq
        others = [c for j, c in enumerate(self._counters) if j != self.comm.rank]

        def wait():
            until = None
            while not all(c[0] >= seq for c in others):
                now = time.perf_counter()
                until = until or now + _SHM_YIELD_S
                if now < until:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)
        self.comm._guard(op, 0, wait)
        self.win.Sync()              # their data loads after their counters

    def free(self) -> None:
        """Release the window (collective)."""
        self._raw, self._data, self._counters, self._slots = [], [], [], {}
        self.win.Unlock_all()
        self.win.Free()
