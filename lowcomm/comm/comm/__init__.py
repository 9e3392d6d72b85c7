"""Comm: a thin wrapper over an mpi4py intracommunicator that moves torch tensors.

Every call uses mpi4py's buffer (upper-case) interface on the tensor's own memory, so nothing is
pickled on a hot path, and records bytes and seconds in a :class:`~lowcomm.comm.ledger.Ledger` under
the communicator's ``level`` ("world", "node", "dc", ...).

Device handling lives here and nowhere else: a CUDA tensor is staged through a reusable pinned
host buffer (after a stream sync) and copied back after the op. Everything above Comm works on
whatever device the tensor lives on.

mpi4py is imported lazily, so importing lowcomm makes no MPI call.

The class is put together from its parts: :mod:`.core` (collectives, staging, checks,
sub-communicators), :mod:`.p2p` (point-to-point and probes), :mod:`.shared` (shared-memory
windows) and :mod:`.world` (:func:`init`); :mod:`.base` holds what they share. This package is
the only one that imports mpi4py.
"""
from .base import Request, Traffic, abort_world, describe, mpi
from .core import Comm
from .p2p import Message
from .shared import SharedWindow
from .world import init, mpi_library, world_rank

__all__ = ["Comm", "Message", "Request", "SharedWindow", "Traffic", "abort_world", "describe", "init",
           "mpi", "mpi_library", "world_rank"]
