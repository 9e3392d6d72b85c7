"""Rank 3 (datacenter 1) fails mid-run: launchers/wan.sh must still remove the WAN it made.
(mpi4py alone, no torch: the test is about the launcher, and this keeps its start-up short.)"""
from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 3:
    raise RuntimeError("rank 3 fails on purpose")
comm.Barrier()
