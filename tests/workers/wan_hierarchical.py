"""Hierarchical all-reduce across 2 emulated datacenters x 2 ranks against MPI_Allreduce, with
exact ledger bytes per level: inside a dc 2(g−1)/g·n = n per rank, across dcs n/2 per rank
(run by tests/test_wan.py under launchers/wan.sh -n 4 --dcs 2)."""
import socket

import numpy as np
import torch
from mpi4py import MPI

import lowcomm
from common import Checks
from lowcomm.ledger import Ledger
from lowcomm.topology import Topology

world = lowcomm.init()
r = world.rank
ok = Checks(r)
hosts = world.allgather_object(socket.gethostname())
ok(hosts == ["lowcomm-dc0"] * 2 + ["lowcomm-dc1"] * 2, f"ranks run on {hosts}")
comm = world.dup(Ledger())
topo = Topology.from_env(comm)     # from $LOWCOMM_TOPOLOGY, set by launchers/wan.sh
levels = topo.comms(comm)
ok(topo.spec() == "dc:2,rank:2", f"topology {topo.spec()}")
for n in (0, 7, 1000, 1 << 18):
    for dt in (torch.float32, torch.bfloat16):
        t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(r + n)).to(dt)
        ref = t.double().numpy().copy()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
        comm.ledger.reset()
        lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
        ok(np.array_equal(t.double().numpy(), ref), f"n={n} {dt}: differs from MPI_Allreduce")
        lv = {k: v for k, v in comm.ledger.by_level().items() if k != "world"}
        es = t.element_size()
        if n % 4 == 0:
            ok(lv.get("rank", 0) == n * es and lv.get("dc", 0) == n * es // 2,
               f"n={n} {dt}: bytes per level {lv}, expected rank {n * es}, dc {n * es // 2}")
        # every byte that crossed between datacenters is filed under "dc"
        crossed = MPI.COMM_WORLD.allreduce(lv.get("dc", 0))
        ok(crossed == 2 * n * es, f"n={n}: {crossed} bytes across dcs in all, expected {2 * n * es}")
ok.report()
