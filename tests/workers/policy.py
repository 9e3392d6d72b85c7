"""Per-level policies (lowcomm/strategies/policy.py) against single-process references.

argv: a topology spec with two levels (outer, inner). Every rank trains the same small MLP on its
own slice of a global batch with plain SGD under several policies, and its parameters must
equal a single-process simulation of the same schedule: units (e.g. datacenters) each running
minibatch SGD or local SGD, averaged across units (each unit counting once) every period.
Inter-unit bytes must come from the units' leaders only.
"""
import sys

import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, random_batch, seeded_mlp
from lowcomm.run.registry import build_strategy, load_config
from lowcomm.errors import ConfigError
from lowcomm.comm.topology import Topology

comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)
SPEC = sys.argv[1]
topo = Topology.parse(SPEC)
levels = topo.comms(comm)
OUTER, INNER = topo.names
UNITS = topo.units(OUTER)                 # world ranks of each outer unit
B, STEPS, LR = 4, 12, 0.1


def batch(step, k):
    x, y = random_batch(step, K * B)
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def mean_(tensors):
    return torch.stack(tensors).mean(0)


def reference(outer_period=None, inner_period=None, inner_dense=True, units=UNITS):
    """Parameters of every rank after STEPS steps of the schedule, simulated in one process."""
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
                    for ps in zip(*(models[k].parameters() for k in unit)):
                        avg = mean_(list(ps))
                        for p in ps:
                            p.copy_(avg)
            if outer_period and t % outer_period == 0:      # units averaged, each counts once
                for ps in zip(*(m.parameters() for m in models)):
                    avg = mean_([mean_([ps[k] for k in unit]) for unit in units])
                    for p in ps:
                        p.copy_(avg)
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


def run(policy: dict, extra=()):
    cfg = load_config(None, [f"topology={SPEC}", "optimizer.name=sgd", f"lr={LR}", *extra,
                             *[f"policy.{k}={v}" for k, v in policy.items()]])
    model = seeded_mlp(10, 32, 3)
    with torch.no_grad():                     # ranks start apart: the policy must broadcast
        for p in model.parameters():
            p.add_(0.01 * r)
    comm.ledger.reset()
    st = build_strategy(cfg, model, torch.optim.SGD(model.parameters(), lr=LR), comm, levels)
    for step in range(STEPS):
        st.zero_grad()
        x, y = batch(step, r)
        F.cross_entropy(model(x), y).backward()
        st.step()
    st.close()
    summary = st.metrics(comm.dup(), final=True)
    level_bytes = {}
    for row in comm.ledger.rows():
        level_bytes[row["level"]] = level_bytes.get(row["level"], 0) + row["bytes_sent"]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), level_bytes, summary


def close(a, b, what):
    err = (a - b).abs().max().item()
    ok(err < 2e-5, f"{what}: max |difference| {err:.3g} from the single-process reference")


N = sum(p.numel() for p in seeded_mlp(10, 32, 3).parameters())
leader = any(unit[0] == r for unit in UNITS)

# 1. every level per-step: one hierarchical SyncDP = minibatch SGD on all K·B samples
mine, level_bytes, _ = run({INNER: "syncdp"})
close(mine, reference(units=[list(range(K))])[r], "syncdp at every level (minibatch SGD)")

# 2. SyncDP inside, local SGD across every 3 steps; DiLoCo with outer SGD lr 1 equals it
expected = reference(outer_period=3)[r]
mine, level_bytes, summary = run({OUTER: "localsgd:period=3"})
close(mine, expected, f"{INNER}=syncdp, {OUTER}=localsgd:period=3")
syncs = STEPS // 3
ok(summary["syncs"] == syncs and summary["inner"]["strategy"] == "syncdp", str(summary))
across = level_bytes.get(OUTER, 0)
dense_across = syncs * N * 4 * 2 * (len(UNITS) - 1) // len(UNITS)   # ring volume among leaders
ok(across == (dense_across if leader else 0),
   f"{OUTER} bytes {across}, expected {dense_across if leader else 0} (leaders only)")
mine, _, _ = run({OUTER: "diloco:period=3,outer_optimizer=sgd,outer_lr=1,outer_momentum=0"})
close(mine, expected, "diloco with outer SGD lr 1 = localsgd")
mine, _, _ = run({OUTER: "streaming-diloco:period=3,outer_optimizer=sgd,outer_lr=1,"
                         "outer_momentum=0,fragments=1,delay=0"})
close(mine, expected, "streaming-diloco, 1 fragment, delay 0 = diloco")

# 3. local SGD inside (every 2) and across (every 4): the inside average comes first
mine, _, _ = run({INNER: "localsgd:period=2", OUTER: "localsgd:period=4"})
close(mine, reference(outer_period=4, inner_period=2, inner_dense=False)[r],
      f"{INNER}=localsgd:period=2, {OUTER}=localsgd:period=4")

# 4. compressed pseudo-gradients across: fewer bytes, leaders only, ranks agree after a sync
mine, level_bytes, _ = run({OUTER: "diloco:period=3,compressor=int8"})
across = level_bytes.get(OUTER, 0)
ok(0 < across < 0.3 * dense_across if leader else across == 0,
   f"int8 {OUTER} bytes {across} vs dense {dense_across} (leader={leader})")
every = comm.allgather(mine)
ok(all(torch.equal(every[0], every[k]) for k in range(K)), "ranks differ after the last sync")
ok(bool(torch.isfinite(mine).all()), "non-finite parameters")

# 5. bad policies: clear errors naming the key, before any communication
for bad, key in [({INNER: "localsgd:period=2"}, f"policy.{OUTER}"),
                 ({OUTER: "diloco:period=0"}, f"policy.{OUTER}.period"),
                 ({"nowhere": "syncdp"}, "policy.nowhere"),
                 ({OUTER: "diloco:algorithm=hierarchical"}, f"policy.{OUTER}.algorithm")]:
    try:
        run(bad)
        ok(False, f"{bad} raised nothing")
    except ConfigError as e:
        ok(e.key == key, f"{bad}: {e}")

ok.report()
