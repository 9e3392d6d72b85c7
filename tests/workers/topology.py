"""Hierarchical all-reduce against vendor MPI_Allreduce over several topologies, on every rank.

For every topology spec that fits the job's size: sizes 0, 1, 7, 1000 and 65539 elements,
float32/float64/bfloat16, integer-valued data (exact in every dtype, so any difference is a
bug) plus random float64 and an average. Ledger bytes per level, summed over all ranks, must be
exactly 2·n·bytes·(U_i − U_{i−1}) for level i with U_i units (each level's ring phases move
(units−1)·n per parent); with equal groups and n divisible, each rank's bytes must match the
closed forms 2(g−1)/g·n inside and 2(G−1)/G·n/g across.
"""
import os

import numpy as np
import torch
from mpi4py import MPI

import lowcomm
from common import Checks
from lowcomm.comm.ledger import Ledger
from lowcomm.comm.topology import Topology

world = lowcomm.init()
K, r = world.size, world.rank
ok = Checks(r)

SPECS = {
    1: ["rank:1", "dc:1,node:1,rank:1"],
    2: ["rank:2", "dc:2,rank:1", "dc:1,rank:2", "dc:2,node:1,rank:1"],
    3: ["dc:2,rank:2+1", "node:2,rank:1+2", "dc:3,rank:1", "dc:1,node:2,rank:2+1"],
    4: ["dc:2,rank:2", "dc:2,node:1,rank:2", "node:2,rank:3+1", "dc:2,node:2+1,rank:1+2+1",
        "dc:2,node:2,rank:1", "rank:4", "dc:4,rank:1"],
}[K]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SIZES = [0, 1, 7, 1000, (1 << 16) + 3]


def vendor_sum(t):
    ref = t.double().numpy().copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    return ref


def world_sum(x: int) -> int:
    return MPI.COMM_WORLD.allreduce(x, op=MPI.SUM)


def by_level(ledger) -> dict:
    """Bytes sent per level, without the shape-agreement checks (filed at the comm's level)."""
    out = {}
    for row in ledger.rows():
        if row["op"] != "check":
            out[row["level"]] = out.get(row["level"], 0) + row["bytes_sent"]
    return out


def units(topo: Topology, i: int) -> int:
    return K if i == len(topo.names) - 1 else len({p[i] for p in topo.paths})


for spec in SPECS:
    topo = Topology.parse(spec)
    comm = world.dup(Ledger())
    levels = topo.comms(comm)
    ok(levels.topology is topo and levels.world is comm, f"{spec}: levels of another topology")
    for i, lvl in enumerate(topo.names):   # each communicator knows the links it crosses
        p = levels.peers(lvl)
        ok(p is None or p.link == topo.link(lvl), f"{spec}: peers({lvl}).link")
        if i < len(topo.names) - 1:
            g = levels.group(lvl)
            ok(g is None or g.link == topo.link(topo.names[i + 1]), f"{spec}: group({lvl}).link")
    ok(comm.link == topo.link(topo.names[0]) and comm.dup().link == comm.link, f"{spec}: world link")
    for n in SIZES:
        for dt in DTYPES:
            g = torch.Generator().manual_seed(100 * r + n)
            t = torch.randint(-4, 5, (n,), generator=g).to(dt)
            ref = vendor_sum(t)
            before = by_level(comm.ledger)
            out = lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
            after = by_level(comm.ledger)
            ok(out is t, "allreduce_ must return its argument")
            ok(np.array_equal(t.double().numpy(), ref), f"{spec} n={n} {dt}: differs from MPI_Allreduce")
            es = t.element_size()
            for i, name in enumerate(topo.names):
                mine = after.get(name, 0) - before.get(name, 0)
                want = 2 * n * es * (units(topo, i) - (units(topo, i - 1) if i else 1))
                ok(world_sum(mine) == want, f"{spec} n={n} {dt}: level {name} moved "
                   f"{world_sum(mine)} bytes in all, expected {want}")
            ok(set(after) <= set(topo.names), f"{spec}: levels {sorted(after)} outside the topology")
    # random data and average
    g = torch.Generator().manual_seed(7 + r)
    t = torch.randn(4099, generator=g, dtype=torch.float64)
    ref = vendor_sum(t)
    lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
    ok(np.allclose(t.numpy(), ref, rtol=1e-12, atol=1e-12), f"{spec}: random float64")
    a = torch.full((3, 5), float(r + 1))
    lowcomm.allreduce_(a, comm, "hierarchical", op="avg", levels=levels)
    ok(torch.allclose(a, torch.full((3, 5), (K + 1) / 2)), f"{spec}: average of a 2-D tensor")
    # non-contiguous view written back in place
    base = torch.zeros(6, 4)
    view = base[:, 1]
    view.fill_(r + 1.0)
    lowcomm.allreduce_(view, comm, "hierarchical", levels=levels)
    ok(torch.equal(base[:, 1], torch.full((6,), K * (K + 1) / 2)) and base[:, 0].eq(0).all(),
       f"{spec}: non-contiguous")

# closed forms per rank, equal groups, n divisible by everything
CLOSED = {4: [("dc:2,rank:2", {"rank": lambda n: 2 * (2 - 1) * n // 2, "dc": lambda n: 2 * (2 - 1) * (n // 2) // 2}),
              ("rank:4", {"rank": lambda n: 2 * 3 * n // 4})],
          2: [("dc:2,rank:1", {"dc": lambda n: n})]}.get(K, [])
for spec, forms in CLOSED:
    comm = world.dup(Ledger())
    levels = Topology.parse(spec).comms(comm)
    n = 1 << 14
    lowcomm.allreduce_(torch.ones(n), comm, "hierarchical", levels=levels)
    for level, f in forms.items():
        ok(by_level(comm.ledger).get(level, 0) == 4 * f(n),
           f"{spec}: rank {r} sent {by_level(comm.ledger).get(level, 0)} bytes on {level}, "
           f"expected {4 * f(n)}")

# the run's topology: its communicators over the world, handed to lowcomm.allreduce_ (no comm)
if K == 4:
    topo = Topology.parse("dc:2,rank:2")
    levels = topo.comms(world)
    t = torch.full((1000,), float(r))
    lowcomm.allreduce_(t, algorithm="hierarchical", levels=levels)
    ok(torch.equal(t, torch.full((1000,), 6.0)), "allreduce_(t, algorithm='hierarchical') on the world")
    try:      # nothing is looked up behind the caller's back
        lowcomm.allreduce_(t, world, "hierarchical")
        ok(False, "hierarchical without its communicators accepted")
    except lowcomm.LowcommError as e:
        ok("levels=" in str(e), str(e))
    # per-level communicators for a per-level policy
    inside, across = levels.group("dc"), levels.peers("dc")
    ok(inside.size == 2 and across.size == 2, f"group/peers sizes {inside.size}/{across.size}")
    ok(inside.level == "rank" and across.level == "dc", f"levels {inside.level}/{across.level}")
    x = torch.tensor([float(r)])
    inside.allreduce_(x)
    ok(x.item() == (1.0 if r < 2 else 5.0), f"group('dc') sum {x.item()}")
    y = torch.tensor([float(r)])
    across.allreduce_(y)
    ok(y.item() == (2.0 if r % 2 == 0 else 4.0), f"peers('dc') sum {y.item()}")
    # unequal: peers of node:2,rank:3+1 (the lone rank pairs with local rank 0)
    u = Topology.parse("node:2,rank:3+1")
    c = world.dup(Ledger())
    p = u.comms(c).peers("node")
    ok(p.size == (2 if r in (0, 3) else 1), f"unequal peers size {p.size}")

# discovered: all ranks share memory here, so one node of K ranks
if "LOWCOMM_TOPOLOGY" not in os.environ:
    d = Topology.from_env(world.dup())
    ok(d.spec() == f"node:1,rank:{K}" and d.source == "MPI_COMM_TYPE_SHARED", f"discovered {d.spec()} ({d.source})")
# wrong size: a clear error
try:
    Topology.parse("dc:2,rank:3").comms(world.dup())
    ok(False, "a topology of 6 ranks accepted")
except lowcomm.ConfigError as e:
    ok("topology" in str(e) and str(K) in str(e), str(e))
ok.report()
