"""The world communicator of this process: :func:`init`, and its rank before MPI starts."""
from __future__ import annotations

import os
import sys

from ..ledger import Ledger
from ..watchdog import Watchdog
from .base import _watchdog_abort, mpi
from .core import Comm

_WORLD: Comm | None = None


def init(validate: bool = True, timeout_s: float | None = None) -> Comm:
    """Initialise MPI (if needed) and return the world :class:`Comm` (one per process).

    ``timeout_s``: the floor of the watchdog's limit for one blocking call (0 = off; default
    ``$LOWCOMM_TIMEOUT_S`` or 60 s); the limit scales with the call's α–β prediction where its
    communicator's link is known (:mod:`lowcomm.comm.watchdog`)."""
    global _WORLD
    if _WORLD is None:
        MPI = mpi()
        dog = Watchdog(timeout_s, MPI.COMM_WORLD.Get_rank(),
                       abort=_watchdog_abort)
        _WORLD = Comm(MPI.COMM_WORLD, Ledger(), "world", validate, dog)
    elif timeout_s is not None:
        _WORLD.watchdog.timeout_s = timeout_s
    return _WORLD


def world_rank() -> int:
    """This process's world rank without starting MPI: the world Comm's once :func:`init` ran,
    else MPI's if mpi4py initialised it, else the launcher's (``OMPI_COMM_WORLD_RANK``,
    ``PMI_RANK``, ``PMIX_RANK``, ``SLURM_PROCID``), else 0. For error messages and seeds."""
    if _WORLD is not None:
        return _WORLD.rank
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank()
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def mpi_library() -> tuple[str, int, int]:
    """The MPI library's version text, the thread level granted and ``MPI_THREAD_MULTIPLE``."""
    MPI = mpi()
    return MPI.Get_library_version(), MPI.Query_thread(), MPI.THREAD_MULTIPLE
