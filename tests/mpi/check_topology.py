"""The hierarchical all-reduce against vendor MPI_Allreduce over several topologies, on every rank.

For every topology spec that fits the job's size: sizes 0, 1, 7, 1000 and 65539 elements,
float32/float64/bfloat16, integer-valued data (exact in every dtype, so any difference is a
bug) plus random float64 and an average. Ledger bytes per level, summed over all ranks, must be
exactly 2·n·bytes·(U_i − U_{i−1}) for level i with U_i units (each level's ring phases move
(units−1)·n per parent); with equal groups and n divisible, each rank's bytes must match the
closed forms 2(g−1)/g·n inside and 2(G−1)/G·n/g across.
"""
import numpy as np
import pytest
import torch

import lowcomm
from helpers import vendor_sum
from lowcomm.comm.ledger import Ledger
from lowcomm.comm.topology import Topology
from under_mpi import SIZE

SPECS = {
    1: ["rank:1", "dc:1,node:1,rank:1"],
    2: ["rank:2", "dc:2,rank:1", "dc:1,rank:2", "dc:2,node:1,rank:1"],
    3: ["dc:2,rank:2+1", "node:2,rank:1+2", "dc:3,rank:1", "dc:1,node:2,rank:2+1"],
    4: ["dc:2,rank:2", "dc:2,node:1,rank:2", "node:2,rank:3+1", "dc:2,node:2+1,rank:1+2+1",
        "dc:2,node:2,rank:1", "rank:4", "dc:4,rank:1"],
}.get(SIZE, [])
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SIZES = [0, 1, 7, 1000, (1 << 16) + 3]
#: closed forms of each level's bytes per rank (equal groups, n divisible by everything)
CLOSED = {4: {"dc:2,rank:2": {"rank": lambda n: 2 * (2 - 1) * n // 2,
                              "dc": lambda n: 2 * (2 - 1) * (n // 2) // 2},
              "rank:4": {"rank": lambda n: 2 * 3 * n // 4}},
          2: {"dc:2,rank:1": {"dc": lambda n: n}}}.get(SIZE, {})
on_four = pytest.mark.mpi(sizes=(4,))


def world_sum(comm, x: int) -> int:
    return sum(comm.allgather_object(x))


def by_level(ledger) -> dict:
    """Bytes sent per level, without the shape-agreement checks (filed at the comm's level)."""
    out = {}
    for row in ledger.rows():
        if row["op"] != "check":
            out[row["level"]] = out.get(row["level"], 0) + row["bytes_sent"]
    return out


def units(topo: Topology, i: int) -> int:
    return SIZE if i == len(topo.names) - 1 else len({p[i] for p in topo.paths})


@pytest.fixture(scope="module")
def built(comm):
    """``built(spec)``: (topology, its own duplicate of the world, the levels), made once per
    spec (communicators are collective to make and few to have)."""
    cache = {}

    def get(spec):
        if spec not in cache:
            topo = Topology.parse(spec)
            c = comm.dup(Ledger())
            cache[spec] = topo, c, topo.comms(c)
        return cache[spec]
    return get


@pytest.mark.parametrize("spec", SPECS)
def test_each_communicator_knows_the_link_it_crosses(spec, built):
    topo, comm, levels = built(spec)
    assert levels.topology is topo and levels.world is comm, "levels of another topology"
    for i, lvl in enumerate(topo.names):
        p = levels.peers(lvl)
        assert p is None or p.link == topo.link(lvl), f"peers({lvl}).link"
        if i < len(topo.names) - 1:
            g = levels.group(lvl)
            assert g is None or g.link == topo.link(topo.names[i + 1]), f"group({lvl}).link"
    assert comm.link == topo.link(topo.names[0]) and comm.dup().link == comm.link, "the world's link"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", SPECS)
def test_equals_vendor_allreduce_with_exact_bytes_per_level(spec, n, dtype, built):
    topo, comm, levels = built(spec)
    r = comm.rank
    t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(100 * r + n)).to(DTYPES[dtype])
    ref = vendor_sum(t)
    before = by_level(comm.ledger)
    out = lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
    after = by_level(comm.ledger)
    es = t.element_size()
    moved = {name: world_sum(comm, after.get(name, 0) - before.get(name, 0)) for name in topo.names}
    assert out is t, "allreduce_ must return its argument"
    assert np.array_equal(t.double().numpy(), ref), "differs from MPI_Allreduce"
    for i, name in enumerate(topo.names):
        want = 2 * n * es * (units(topo, i) - (units(topo, i - 1) if i else 1))
        assert moved[name] == want, f"level {name} moved {moved[name]} bytes in all, expected {want}"
    assert set(after) <= set(topo.names), f"levels {sorted(after)} outside the topology"


@pytest.mark.parametrize("spec", SPECS)
def test_random_float64(spec, built):
    topo, comm, levels = built(spec)
    t = torch.randn(4099, generator=torch.Generator().manual_seed(7 + comm.rank), dtype=torch.float64)
    ref = vendor_sum(t)
    lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
    assert np.allclose(t.numpy(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS)
def test_average_of_a_2d_tensor(spec, built):
    topo, comm, levels = built(spec)
    a = torch.full((3, 5), float(comm.rank + 1))
    lowcomm.allreduce_(a, comm, "hierarchical", op="avg", levels=levels)
    assert torch.allclose(a, torch.full((3, 5), (SIZE + 1) / 2))


@pytest.mark.parametrize("spec", SPECS)
def test_a_non_contiguous_view_is_written_back_in_place(spec, built):
    topo, comm, levels = built(spec)
    base = torch.zeros(6, 4)
    view = base[:, 1]
    view.fill_(comm.rank + 1.0)
    lowcomm.allreduce_(view, comm, "hierarchical", levels=levels)
    assert torch.equal(base[:, 1], torch.full((6,), SIZE * (SIZE + 1) / 2)) and base[:, 0].eq(0).all()


@pytest.mark.mpi(sizes=(2, 4))
@pytest.mark.parametrize("spec", CLOSED)
def test_bytes_per_rank_equal_the_closed_forms(spec, comm):
    c = comm.dup(Ledger())
    levels = Topology.parse(spec).comms(c)
    n = 1 << 14
    lowcomm.allreduce_(torch.ones(n), c, "hierarchical", levels=levels)
    got = by_level(c.ledger)
    for level, f in CLOSED[spec].items():
        assert got.get(level, 0) == 4 * f(n), \
            f"rank {comm.rank} sent {got.get(level, 0)} bytes on {level}, expected {4 * f(n)}"


@pytest.fixture(scope="module")
def dc2(comm):
    """The run's topology dc:2,rank:2: its communicators over the world itself."""
    return Topology.parse("dc:2,rank:2").comms(comm)


@on_four
def test_allreduce_without_a_comm_runs_on_the_levels_world(dc2, comm):
    t = torch.full((1000,), float(comm.rank))
    lowcomm.allreduce_(t, algorithm="hierarchical", levels=dc2)
    assert torch.equal(t, torch.full((1000,), 6.0))


@on_four
def test_hierarchical_without_its_communicators_is_refused(comm):
    """Nothing is looked up behind the caller's back."""
    with pytest.raises(lowcomm.LowcommError, match="levels="):
        lowcomm.allreduce_(torch.ones(4), comm, "hierarchical")


@on_four
def test_group_and_peers_of_a_level(dc2, comm):
    """The per-level communicators a per-level policy uses."""
    r = comm.rank
    inside, across = dc2.group("dc"), dc2.peers("dc")
    x, y = torch.tensor([float(r)]), torch.tensor([float(r)])
    inside.allreduce_(x)
    across.allreduce_(y)
    assert inside.size == 2 and across.size == 2, f"sizes {inside.size}/{across.size}"
    assert inside.level == "rank" and across.level == "dc", f"levels {inside.level}/{across.level}"
    assert x.item() == (1.0 if r < 2 else 5.0), f"group('dc') sum {x.item()}"
    assert y.item() == (2.0 if r % 2 == 0 else 4.0), f"peers('dc') sum {y.item()}"


@on_four
def test_peers_of_unequal_groups(comm):
    """node:2,rank:3+1: the lone rank pairs with local rank 0."""
    p = Topology.parse("node:2,rank:3+1").comms(comm.dup(Ledger())).peers("node")
    assert p.size == (2 if comm.rank in (0, 3) else 1)


def test_discovered_topology_is_one_node_of_every_rank(comm, monkeypatch):
    """All ranks share memory here."""
    for name in ("LOWCOMM_TOPOLOGY", "SLURM_NODEID", "LOWCOMM_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    d = Topology.from_env(comm.dup())
    assert d.spec() == f"node:1,rank:{SIZE}" and d.source == "MPI_COMM_TYPE_SHARED", \
        f"discovered {d.spec()} ({d.source})"


def test_a_topology_of_another_size_is_a_config_error(comm):
    with pytest.raises(lowcomm.ConfigError) as e:
        Topology.parse("dc:2,rank:3").comms(comm.dup())
    assert "topology" in str(e.value) and str(SIZE) in str(e.value), str(e.value)
