"""The communication layer, the only user of mpi4py: :class:`~lowcomm.comm.comm.Comm` (tensor
collectives and point-to-point over an MPI communicator), the :class:`~lowcomm.comm.ledger.Ledger`
of bytes and seconds, the watchdog, the topology, the all-reduce algorithms and their tuning.
Nothing here imports a layer above it."""
from .comm import Comm, Request, init

__all__ = ["Comm", "Request", "init"]
