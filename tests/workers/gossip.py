"""Gossip SGD on K ranks against trusted references, every rank asserting:

* complete graph, adapt-then-combine, SGD with momentum == SyncDP (D-PSGD and push-sum);
* D-PSGD (combine-then-adapt, overlapped) == a single-process simulation with the dense mixing
  matrix W_t, on ring and one-peer-exponential; push-sum on an irregular digraph == its dense
  simulation (column-stochastic P, weights w);
* pure averaging (no gradients) on every graph the rank count allows: the consensus distance
  follows W_t … W_1 X_0 exactly and shrinks per round at |λ2| of W (numpy eigenvalues);
* ledger: gossip bytes per rank per round == out-degree × parameter bytes (+8 for push-sum);
* CHOCO with the identity compressor and γ = 1 == D-PSGD; with a lossy top-k the network
  average is preserved and the distance shrinks;
* async: the push-sum mass is conserved and ranks reach consensus;
* bad arguments raise before any communication.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, seeded_mlp, random_batch
from lowcomm.compress import COMPRESSORS, Compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.comm.ledger import Ledger
from lowcomm.strategies.gossip import Gossip
from lowcomm.strategies.graphs import GRAPHS, EdgeGraph, build_graph, second_eigenvalue

comm = lowcomm.init()
K, r = comm.size, comm.rank
ctl = comm.dup(Ledger(), "control")
ctl.validate = False
ok = Checks(r)
B, STEPS, LR = 6, 5, 0.1


def make():
    return seeded_mlp(10, 32, 3)


def batch(step, k):
    x, y = random_batch(step, K * B)
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def train(opt, model, steps=STEPS):
    for step in range(steps):
        x, y = batch(step, r)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    return model


def buildable():
    out = []
    for name in GRAPHS:
        try:
            out.append(build_graph(name, K))
        except ValueError:
            ok(name == "torus" and (K < 4 or all(K % d for d in range(2, K))), f"{name} on {K}")
    return out


# 1. complete graph, adapt-then-combine, SGD (+momentum) == SyncDP -------------------------------
def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


m = make()
ref = train(lowcomm.SyncDP(m, sgd(m), comm), m)
for mode in ("dpsgd", "push-sum"):
    m = make()
    ok.models_close(train(Gossip(m, sgd(m), comm, graph="complete", mode=mode, order="atc"), m), ref,
         f"complete/{mode}/atc vs SyncDP")


# 2. D-PSGD (cta) and push-sum (atc) vs a dense single-process simulation ------------------------
def simulate(graph, mode, order):
    models = [make() for _ in range(K)]
    opts = [sgd(m) for m in models]
    w = np.ones(K)
    for step in range(STEPS):
        for k, m in enumerate(models):
            m.zero_grad()
            x, y = batch(step, k)
            F.cross_entropy(m(x), y).backward()
        X = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
        if order == "cta":
            X = torch.stack(X)
            W = torch.tensor(graph.mixing_matrix(step), dtype=X.dtype)
            mixed = W @ X
            for m, row in zip(models, mixed):
                torch.nn.utils.vector_to_parameters(row, m.parameters())
            for o in opts:
                o.step()
        else:   # push-sum, adapt then combine: numerators w·z, column-stochastic P
            for o in opts:
                o.step()
            Z = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models])
            P = graph.push_sum_matrix(step)
            num = torch.tensor(P, dtype=torch.float64) @ (torch.tensor(w)[:, None] * Z.double())
            w = P @ w
            for k, m in enumerate(models):
                torch.nn.utils.vector_to_parameters((num[k] / w[k]).float(), m.parameters())
    return models[r], w


for name in ("ring", "one-peer-exponential"):
    g = build_graph(name, K)
    m = make()
    got = train(Gossip(m, sgd(m), comm, graph=g), m)
    ok.models_close(got, simulate(g, "dpsgd", "cta")[0], f"D-PSGD cta on {name} vs dense simulation")
if K >= 3:   # a ring plus one chord: in-degrees 1 or 2, so only push-sum can average it
    digraph = EdgeGraph(K, [(i, (i + 1) % K) for i in range(K)] + [(0, 2)], name="ring+chord")
    m = make()
    opt = Gossip(m, sgd(m), comm, graph=digraph, mode="push-sum", order="atc")
    train(opt, m)
    ref_model, w = simulate(digraph, "push-sum", "atc")
    ok.models_close(m, ref_model, "push-sum on an irregular digraph vs dense simulation", rtol=1e-4, atol=1e-5)
    ok(abs(opt.w - w[r]) < 1e-12, f"push-sum weight {opt.w} vs simulated {w[r]}")
    ws = ctl.allgather(torch.tensor([opt.w], dtype=torch.float64))
    ok(abs(float(ws.sum()) - K) < 1e-12 and float(ws.std()) > 0.01,
       f"push-sum weights sum to K and are not all 1: {ws.tolist()}")


# 3. pure averaging: exact trajectory, spectral rate, bytes ---------------------------------------
N = 300


class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))


def averaging(graph, mode="dpsgd", rounds=10, compressor=None, gamma=1.0, barrier=False):
    """Run ``rounds`` of gossip with no gradients from rank-dependent starts; returns the
    strategy, X_0 (K×N), the distances d_0..d_T and the gossip bytes sent/received per round."""
    m = Vec()
    opt = Gossip(m, torch.optim.SGD(m.parameters(), lr=1.0), comm, graph=graph, mode=mode,
                 compressor=compressor, consensus_step=gamma)
    with torch.no_grad():
        m.v.copy_(torch.randn(N, generator=torch.Generator().manual_seed(1000 + r), dtype=torch.float64))
    X0 = ctl.allgather(m.v.detach().clone()).numpy()
    before = comm.ledger.get(opt.op)
    d = [opt.consensus_distance(ctl)]
    for _ in range(rounds):
        opt.zero_grad()
        opt.step()
        if barrier:
            ctl.barrier()
        d.append(opt.consensus_distance(ctl))
    after = comm.ledger.get(opt.op)
    return opt, m, X0, np.array(d), ((after.bytes_sent - before.bytes_sent) / rounds,
                                    (after.bytes_recv - before.bytes_recv) / rounds)


def distances(X):
    return np.linalg.norm(X - X.mean(0), axis=1).mean()


param_bytes = N * 8
for g in buildable():
    period = g.period
    Ws = [g.mixing_matrix(t) for t in range(period)]
    rho = second_eigenvalue(Ws)
    # enough rounds to fall ~1e-7 (float64 keeps the tail accurate), a whole number of periods
    T = 2 * period if rho < 1e-9 else min(60, 2 * period * math.ceil(math.log(1e-7) / math.log(rho) / (2 * period)))
    opt, m, X0, d, (sent, recv) = averaging(g, rounds=T)
    X, pred = X0.copy(), [distances(X0)]
    for t in range(T):
        X = Ws[t % period] @ X
        pred.append(distances(X))
    pred = np.array(pred)
    ok(np.all(np.abs(d - pred) <= 1e-9 * d[0]), f"{g.name}: distances {d} vs W^t X0 {pred}")
    if rho < 1e-9:
        ok(d[period] <= 1e-12 * d[0], f"{g.name}: |λ2| = 0 must average exactly in {period} rounds: {d}")
    else:
        w = T // 2 // period * period
        rate = (d[T] / d[T - w]) ** (1 / w)
        ok(abs(rate - rho) <= 0.02 * rho, f"{g.name}: measured rate {rate:.4f} vs |λ2| {rho:.4f}")
        ok(d[T] < d[0], f"{g.name}: consensus distance must shrink")
    degrees = {len(g.out_peers(r, t)) for t in range(period)}
    ok(len(degrees) == 1, f"{g.name}: one out-degree per round")
    deg = degrees.pop()
    ok(sent == deg * param_bytes and recv == deg * param_bytes,
       f"{g.name}: {sent}/{recv} bytes per round, expected {deg} × {param_bytes}")
    if g.name == "one-peer-exponential":   # the same on any number of ranks
        ok(sent == (param_bytes if K > 1 else 0), f"one peer: {sent} bytes")
    # push-sum on the same regular graph: weights stay 1, the messages carry 8 more bytes
    opt, m, X0, d_ps, (sent, _) = averaging(g, mode="push-sum", rounds=min(T, 6))
    ok(sent == deg * (param_bytes + 8), f"{g.name} push-sum: {sent} bytes per round")
    ok(opt.w == 1.0, f"{g.name} push-sum weight {opt.w} on a regular graph")
    ok(np.allclose(d_ps, d[:len(d_ps)], rtol=1e-9, atol=1e-12 * d[0]), f"{g.name}: push-sum == D-PSGD")


# 4. CHOCO ---------------------------------------------------------------------------------------
m = make()
plain = train(Gossip(m, sgd(m), comm, graph="ring"), m)
m = make()
ok.models_close(train(Gossip(m, sgd(m), comm, graph="ring", compressor=Compressor()), m), plain,
     "CHOCO(identity, γ=1) vs D-PSGD")


class TopHalf(Compressor):
    """Keep the larger-magnitude half of the entries (fixed payload size), no memory."""
    name, summable = "tophalf", False

    def compress(self, x, key, segments):
        idx = x.abs().topk(max(1, x.numel() // 2)).indices
        return [x[idx].contiguous(), idx], x.numel()

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx, dtype=payload[0].dtype)
        out[payload[1]] = payload[0]
        return out


lossy = [("tophalf", TopHalf())]
# sparsifiers at half density: CHOCO with γ = 0.4 contracts only if Q keeps enough of x − x̂
# (Koloskova et al. 2019 need γ of order δ, the compressor's quality; 1% top-k would need γ ≈ 0.01)
lossy += [(name, COMPRESSORS[name](CompressorConfig(name=name, ratio=0.5))) for name in COMPRESSORS
          if name != "none"]
for cname, comp in lossy:
    g = build_graph("ring", K)
    opt, m, X0, d, (sent, _) = averaging(g, rounds=40, compressor=comp, gamma=0.4)
    mean = ctl.allreduce_(m.v.detach().clone()).div_(K).numpy()
    ok(np.allclose(mean, X0.mean(0), rtol=0, atol=1e-10), f"CHOCO {cname}: the average moved")
    if K > 1:
        ok(d[-1] < 0.5 * d[0], f"CHOCO {cname}: distance {d[0]:.3g} -> {d[-1]:.3g}")
    if cname == "tophalf":
        payload = (N // 2) * 8 + (N // 2) * 8     # float64 values + int64 indices
        ok(sent == len(g.out_peers(r)) * payload, f"CHOCO top-half: {sent} bytes per round")


# 5. async: mass conserved, consensus reached ------------------------------------------------------
for name in ("ring", "one-peer-exponential"):
    opt, m, X0, d, _ = averaging(build_graph(name, K), mode="async", rounds=40, barrier=True)
    opt.close()
    num = ctl.allreduce_((m.v.detach() * opt.w).clone()).numpy()
    ws = float(ctl.allreduce_(torch.tensor([opt.w], dtype=torch.float64)))
    ok(np.allclose(num, X0.sum(0), rtol=1e-10, atol=1e-10) and abs(ws - K) < 1e-10,
       f"async {name}: push-sum mass not conserved (Σw = {ws})")
    final = opt.consensus_distance(ctl)
    ok(final <= 0.05 * d[0] if K > 1 else final == 0, f"async {name}: distance {d[0]:.3g} -> {final:.3g}")


# 6. bad arguments fail before any communication ---------------------------------------------------
def raises(fn, text):
    try:
        fn()
    except (ValueError, TypeError) as e:
        ok(text in str(e), f"expected {text!r} in {e}")
        return
    ok(False, f"no error; expected {text!r}")


m = make()
raises(lambda: Gossip(m, sgd(m), comm, mode="gossipy"), "unknown gossip mode")
raises(lambda: Gossip(m, sgd(m), comm, order="later"), "unknown gossip order")
raises(lambda: Gossip(m, sgd(m), comm, graph="star"), "unknown graph")
raises(lambda: Gossip(m, sgd(m), comm, graph=build_graph("ring", K + 1)), "communicator has")
raises(lambda: Gossip(m, sgd(m), comm, consensus_step=0.5), "needs a compressor")
raises(lambda: Gossip(m, sgd(m), comm, compressor=Compressor(), consensus_step=0.0), "(0, 1]")
if build_graph("one-peer-exponential", K).period > 1:   # K ≤ 2: one offset, a static graph
    raises(lambda: Gossip(m, sgd(m), comm, graph="one-peer-exponential", compressor=Compressor()),
           "static graph")
raises(lambda: Gossip(m, sgd(m), comm, mode="async", compressor=Compressor()), "mode='dpsgd'")
if K in (2, 3):
    raises(lambda: Gossip(m, sgd(m), comm, graph="torus"), "torus needs")
if K >= 3:
    raises(lambda: Gossip(m, sgd(m), comm, graph=digraph), "not regular")
ok.report()
