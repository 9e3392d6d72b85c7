"""Rank K-1 raises while the others wait in an all-reduce: the whole job must end at once."""
import torch

import lowcomm

comm = lowcomm.init()
if comm.rank == comm.size - 1:
    raise RuntimeError("injected failure on the last rank")
lowcomm.allreduce_(torch.ones(1000), comm, "ring")   # would wait forever for the last rank
