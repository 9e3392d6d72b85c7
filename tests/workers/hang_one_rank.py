"""The last rank stops itself (SIGSTOP) while the others wait for it: the watchdog must end
the job after its timeout, naming the waiting rank, the op and whom it waits for."""
import os
import signal
import sys

import torch

import lowcomm

comm = lowcomm.init(timeout_s=float(sys.argv[2]))
comm.validate = False   # go straight to the algorithm's own messages
if comm.rank == comm.size - 1:
    os.kill(os.getpid(), signal.SIGSTOP)
if sys.argv[1] == "ring":
    lowcomm.allreduce_(torch.ones(100), comm, "ring")       # point-to-point with a neighbour
else:
    comm.allreduce_(torch.ones(100))                          # vendor collective
