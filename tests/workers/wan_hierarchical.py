"""Over 2 emulated datacenters x 2 ranks (run by tests/test_wan.py under launchers/wan.sh -n 4
--dcs 2), one WAN and one mpirun for two checks:
  1. a 16 MiB message from datacenter 0 (rank 0) to datacenter 1 (rank 2), timed against the α–β
     model of the link the WAN was brought up with: T = send 16 MiB + 1-byte reply, model
     2α + n/β, within 0.8–1.5x;
  2. the hierarchical all-reduce against MPI_Allreduce, with exact ledger bytes per level: inside
     a dc 2(g−1)/g·n = n per rank, across dcs n/2 per rank."""
import json
import os
import socket
import statistics
import time

import numpy as np
import torch

import lowcomm
from common import Checks
from lowcomm.comm.ledger import Ledger
from lowcomm.comm.topology import LinkModel, Topology
from lowcomm.tools.wan import state

world = lowcomm.init()
r = world.rank
ok = Checks(r)
hosts = world.allgather_object(socket.gethostname())
ok(hosts == ["lowcomm-dc0"] * 2 + ["lowcomm-dc1"] * 2, f"ranks run on {hosts}")

# 1. a 16 MiB transfer between the datacenters (ranks 1 and 3 wait at the barrier)
st = state()
link = LinkModel(st["delay_ms"] / 1e3, st["rate_mbit"] * 1e6 / 8, "wan")
n = 16 << 20
buf, one = torch.zeros(n, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)


def trip() -> float:
    t0 = time.perf_counter()
    if r == 0:
        world.send(buf, 2)
        world.recv_(one, 2)
    else:
        world.recv_(buf, 0)
        world.send(one, 0)
    return time.perf_counter() - t0


if r in (0, 2):
    world.send(one, 2) if r == 0 else world.recv_(one, 0)   # connect first: not part of a transfer
    times = [trip() for _ in range(3)]
measured = world.bcast_object(statistics.median(times) if r == 0 else None)
model = link.seconds(n) + link.seconds(1)
ratio = measured / model
ok(0.8 <= ratio <= 1.5, f"16 MiB took {measured:.3f} s, α–β model {model:.3f} s: ratio {ratio:.2f}")
if r == 0 and os.environ.get("LOWCOMM_WAN_RESULT"):
    with open(os.environ["LOWCOMM_WAN_RESULT"], "w") as f:
        json.dump({"measured_s": measured, "model_s": model, "ratio": ratio, "times": times}, f)
world.barrier()

# 2. the hierarchical all-reduce
comm = world.dup(Ledger())
reference = world.dup(Ledger(), "reference")   # the vendor's MPI_Allreduce, charged apart
topo = Topology.from_env(comm)     # from $LOWCOMM_TOPOLOGY, set by launchers/wan.sh
levels = topo.comms(comm)
ok(topo.spec() == "dc:2,rank:2", f"topology {topo.spec()}")
for n in (0, 7, 1000, 1 << 18):
    for dt in (torch.float32, torch.bfloat16):
        t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(r + n)).to(dt)
        ref = reference.allreduce_(t.double()).numpy()
        comm.ledger.reset()
        lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
        ok(np.array_equal(t.double().numpy(), ref), f"n={n} {dt}: differs from MPI_Allreduce")
        lv = {k: v for k, v in comm.ledger.by_level().items() if k != "world"}
        es = t.element_size()
        if n % 4 == 0:
            ok(lv.get("rank", 0) == n * es and lv.get("dc", 0) == n * es // 2,
               f"n={n} {dt}: bytes per level {lv}, expected rank {n * es}, dc {n * es // 2}")
        # every byte that crossed between datacenters is filed under "dc"
        crossed = sum(world.allgather_object(lv.get("dc", 0)))
        ok(crossed == 2 * n * es, f"n={n}: {crossed} bytes across dcs in all, expected {2 * n * es}")
ok.report()
