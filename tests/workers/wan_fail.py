"""Rank 3 (datacenter 1) fails mid-run: launchers/wan.sh must still remove the WAN it made."""
from lowcomm.comm.comm import init

comm = init()
comm.barrier()
if comm.rank == 3:
    raise RuntimeError("rank 3 fails on purpose")
comm.barrier()
