"""Per-level policies (lowcomm/strategies/policy.py) against single-process references.

Over topologies with two levels (outer, inner) that fit the job's size, every rank trains the
same small MLP on its own slice of a global batch with plain SGD under several policies, and its
parameters must equal a single-process simulation of the same schedule: units (e.g.
datacenters) each running minibatch SGD or local SGD, averaged across units (each unit counting
once) every period. Inter-unit bytes must come from the units' leaders only.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers import random_batch, seeded_mlp
from lowcomm.comm.topology import Topology
from lowcomm.errors import ConfigError
from lowcomm.run.api import load_config
from lowcomm.run.registry import build_strategy
from lowcomm.strategies.method import Context
from under_mpi import RANK, SIZE

SPECS = {3: ["dc:2,rank:2+1"], 4: ["dc:2,rank:2", "node:2,rank:2"]}.get(SIZE, [])
pytestmark = pytest.mark.mpi(sizes=(3, 4))
K, B, STEPS, LR = SIZE, 4, 12, 0.1
N = sum(p.numel() for p in seeded_mlp(10, 32, 3).parameters())


def batch(step, k):
    x, y = random_batch(step, K * B)
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def mean_(tensors):
    return torch.stack(tensors).mean(0)


def average_(groups):
    """Each group of parameters (one per rank) set to the mean of the group."""
    for ps in groups:
        avg = mean_(list(ps))
        for p in ps:
            p.copy_(avg)


@functools.lru_cache(maxsize=None)
def reference(spec, outer_period=None, inner_period=None, inner_dense=True, one_unit=False):
    """Parameters of every rank after STEPS steps of the schedule, simulated in one process;
    ``one_unit``: every rank in one unit."""
    units = [list(range(K))] if one_unit else Topology.parse(spec).units(Topology.parse(spec).names[0])
    models = [seeded_mlp(10, 32, 3) for _ in range(K)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for step in range(STEPS):
        for k, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            F.cross_entropy(m(batch(step, k)[0]), batch(step, k)[1]).backward()
        if inner_dense:                       # SyncDP inside each unit
            for unit in units:
                for ps in zip(*(models[k].parameters() for k in unit)):
                    g = mean_([p.grad for p in ps])
                    for p in ps:
                        p.grad = g.clone()
        for o in opts:
            o.step()
        t = step + 1
        with torch.no_grad():
            if inner_period and t % inner_period == 0:      # local SGD inside each unit
                for unit in units:
                    average_(zip(*(models[k].parameters() for k in unit)))
            if outer_period and t % outer_period == 0:      # units averaged, each counts once
                for ps in zip(*(m.parameters() for m in models)):
                    avg = mean_([mean_([ps[k] for k in unit]) for unit in units])
                    for p in ps:
                        p.copy_(avg)
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


@pytest.fixture(scope="module")
def levels(comm):
    """``levels(spec)``: the topology's communicators over the world (made once per spec)."""
    cache = {}

    def get(spec):
        if spec not in cache:
            cache[spec] = Topology.parse(spec).comms(comm)
        return cache[spec]
    return get


def run(comm, levels, spec: str, policy: dict, extra=()):
    """STEPS steps under ``policy``: this rank's parameters, its bytes per level, the summary."""
    cfg = load_config(None, [f"topology={spec}", "optimizer.name=sgd", f"lr={LR}", *extra,
                             *[f"policy.{k}={v}" for k, v in policy.items()]])
    model = seeded_mlp(10, 32, 3)
    with torch.no_grad():                     # ranks start apart: the policy must broadcast
        for p in model.parameters():
            p.add_(0.01 * RANK)
    comm.ledger.reset()
    st = build_strategy(cfg, model, torch.optim.SGD(model.parameters(), lr=LR), comm,
                        Context(levels=levels(spec)))
    for step in range(STEPS):
        st.zero_grad()
        x, y = batch(step, RANK)
        F.cross_entropy(model(x), y).backward()
        st.step()
    st.close()
    summary = st.metrics(comm.dup(), final=True)
    level_bytes = {}
    for row in comm.ledger.rows():
        level_bytes[row["level"]] = level_bytes.get(row["level"], 0) + row["bytes_sent"]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), level_bytes, summary


def assert_close(a, b):
    err = (a - b).abs().max().item()
    assert err < 2e-5, f"max |difference| {err:.3g} from the single-process reference"


def names(spec):
    return Topology.parse(spec).names            # (outer, inner)


def is_leader(spec) -> bool:
    return any(unit[0] == RANK for unit in Topology.parse(spec).units(names(spec)[0]))


def dense_across(spec, syncs) -> int:
    """Ring volume of ``syncs`` dense averages among the units' leaders."""
    units = len(Topology.parse(spec).units(names(spec)[0]))
    return syncs * N * 4 * 2 * (units - 1) // units


@pytest.mark.parametrize("spec", SPECS)
def test_syncdp_at_every_level_is_minibatch_sgd(spec, comm, levels):
    """One hierarchical SyncDP = minibatch SGD on all K·B samples."""
    mine, _, _ = run(comm, levels, spec, {names(spec)[1]: "syncdp"})
    assert_close(mine, reference(spec, one_unit=True)[RANK])


@pytest.mark.parametrize("spec", SPECS)
def test_syncdp_inside_localsgd_across_with_bytes_from_the_leaders_only(spec, comm, levels):
    outer, inner = names(spec)
    mine, level_bytes, summary = run(comm, levels, spec, {outer: "localsgd:period=3"})
    assert_close(mine, reference(spec, outer_period=3)[RANK])
    assert summary["syncs"] == STEPS // 3 and summary["inner"]["strategy"] == "syncdp", str(summary)
    across, want = level_bytes.get(outer, 0), dense_across(spec, STEPS // 3) if is_leader(spec) else 0
    assert across == want, f"{outer} bytes {across}, expected {want} (leaders only)"


@pytest.mark.parametrize("spec", SPECS)
def test_diloco_across_with_outer_sgd_lr_1_equals_localsgd(spec, comm, levels):
    mine, _, _ = run(comm, levels, spec,
                     {names(spec)[0]: "diloco:period=3,outer_optimizer=sgd,outer_lr=1,outer_momentum=0"})
    assert_close(mine, reference(spec, outer_period=3)[RANK])


@pytest.mark.parametrize("spec", SPECS)
def test_streaming_diloco_across_with_one_fragment_and_no_delay_equals_diloco(spec, comm, levels):
    mine, _, _ = run(comm, levels, spec, {names(spec)[0]: "streaming-diloco:period=3,outer_optimizer=sgd,"
                                                          "outer_lr=1,outer_momentum=0,fragments=1,delay=0"})
    assert_close(mine, reference(spec, outer_period=3)[RANK])


@pytest.mark.parametrize("spec", SPECS)
def test_localsgd_inside_and_across_averages_inside_first(spec, comm, levels):
    outer, inner = names(spec)
    mine, _, _ = run(comm, levels, spec, {inner: "localsgd:period=2", outer: "localsgd:period=4"})
    assert_close(mine, reference(spec, outer_period=4, inner_period=2, inner_dense=False)[RANK])


@pytest.mark.parametrize("spec", SPECS)
def test_compressed_pseudo_gradients_across_fewer_bytes_from_the_leaders(spec, comm, levels):
    outer = names(spec)[0]
    mine, level_bytes, _ = run(comm, levels, spec, {outer: "diloco:period=3,compressor=int8"})
    across, dense = level_bytes.get(outer, 0), dense_across(spec, STEPS // 3)
    every = comm.allgather(mine)
    if is_leader(spec):
        assert 0 < across < 0.3 * dense, f"int8 {outer} bytes {across} vs dense {dense}"
    else:
        assert across == 0, f"{outer} bytes {across} from a rank that leads no unit"
    assert all(torch.equal(every[0], every[k]) for k in range(K)), "ranks differ after the last sync"
    assert bool(torch.isfinite(mine).all()), "non-finite parameters"


BAD = {"anchor-inside": lambda o, i: ({i: "localsgd:period=2"}, f"policy.{o}"),
       "period": lambda o, i: ({o: "diloco:period=0"}, f"policy.{o}.period"),
       "level": lambda o, i: ({"nowhere": "syncdp"}, "policy.nowhere"),
       "algorithm": lambda o, i: ({o: "diloco:algorithm=hierarchical"}, f"policy.{o}.algorithm")}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("spec", SPECS)
def test_a_bad_policy_is_a_config_error_naming_the_key(spec, case, comm, levels):
    """Before any communication."""
    bad, key = BAD[case](*names(spec))
    with pytest.raises(ConfigError) as e:
        run(comm, levels, spec, bad)
    assert e.value.key == key, f"{bad}: {e.value}"
