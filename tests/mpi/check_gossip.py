"""Gossip SGD on K ranks against trusted references, every rank asserting.

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
import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import assert_models_close, control, random_batch, seeded_mlp
from lowcomm.compress import COMPRESSORS, Compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies.gossip.gossip import Gossip
from lowcomm.strategies.gossip.graphs import GRAPHS, EdgeGraph, build_graph, second_eigenvalue
from under_mpi import SIZE

K = SIZE
B, STEPS, LR = 6, 5, 0.1
N = 300                     # elements of the averaged vector
PARAM_BYTES = N * 8


def fits(name: str) -> bool:
    try:
        build_graph(name, K)
        return True
    except ValueError:
        return False


BUILDABLE = [name for name in GRAPHS if fits(name)]
LOSSY = ["tophalf", *[name for name in COMPRESSORS if name != "none"]]


def make():
    return seeded_mlp(10, 32, 3)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def batch(step, k):
    x, y = random_batch(step, K * B)
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def train(opt, model, rank, steps=STEPS):
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    return model


def ring_chord():
    """A ring plus one chord: in-degrees 1 or 2, so only push-sum can average it."""
    return EdgeGraph(K, [(i, (i + 1) % K) for i in range(K)] + [(0, 2)], name="ring+chord")


@pytest.fixture(scope="module")
def ctl(comm):
    return control(comm)


# 1. complete graph, adapt-then-combine, SGD (+momentum) == SyncDP -------------------------------
@pytest.mark.parametrize("mode", ["dpsgd", "push-sum"])
def test_complete_graph_adapt_then_combine_equals_syncdp(mode, comm):
    m = make()
    ref = train(lowcomm.SyncDP(m, sgd(m), comm), m, comm.rank)
    m = make()
    got = train(Gossip(m, sgd(m), comm, graph="complete", mode=mode, order="atc"), m, comm.rank)
    assert_models_close(got, ref, f"complete/{mode}/atc vs SyncDP")


# 2. D-PSGD (cta) and push-sum (atc) vs a dense single-process simulation ------------------------
def simulate(graph, order, rank):
    """K workers in one process: D-PSGD combine-then-adapt with W_t, or push-sum
    adapt-then-combine with column-stochastic P_t; worker ``rank``'s model and the weights."""
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
            for m, row in zip(models, W @ X):
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
    return models[rank], w


@pytest.mark.parametrize("name", ["ring", "one-peer-exponential"])
def test_dpsgd_combine_then_adapt_equals_the_dense_simulation(name, comm):
    g = build_graph(name, K)
    m = make()
    got = train(Gossip(m, sgd(m), comm, graph=g), m, comm.rank)
    assert_models_close(got, simulate(g, "cta", comm.rank)[0], f"D-PSGD cta on {name} vs dense simulation")


@pytest.mark.mpi(min_size=3)
def test_push_sum_on_an_irregular_digraph_equals_the_dense_simulation(comm, ctl):
    m = make()
    opt = Gossip(m, sgd(m), comm, graph=ring_chord(), mode="push-sum", order="atc")
    train(opt, m, comm.rank)
    ref_model, w = simulate(ring_chord(), "atc", comm.rank)
    ws = ctl.allgather(torch.tensor([opt.w], dtype=torch.float64))
    assert_models_close(m, ref_model, "push-sum on an irregular digraph vs dense simulation",
                        rtol=1e-4, atol=1e-5)
    assert abs(opt.w - w[comm.rank]) < 1e-12, f"push-sum weight {opt.w} vs simulated {w[comm.rank]}"
    assert abs(float(ws.sum()) - K) < 1e-12 and float(ws.std()) > 0.01, \
        f"push-sum weights must sum to K and not all be 1: {ws.tolist()}"


# 3. pure averaging: exact trajectory, spectral rate, bytes ---------------------------------------
class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))


def averaging(comm, ctl, graph, mode="dpsgd", rounds=10, compressor=None, gamma=1.0, barrier=False):
    """Run ``rounds`` of gossip with no gradients from rank-dependent starts; returns the
    strategy, the vector's module, X_0 (K×N), the distances d_0..d_T and the gossip bytes
    sent/received per round."""
    m = Vec()
    opt = Gossip(m, torch.optim.SGD(m.parameters(), lr=1.0), comm, graph=graph, mode=mode,
                 compressor=compressor, consensus_step=gamma)
    with torch.no_grad():
        m.v.copy_(torch.randn(N, generator=torch.Generator().manual_seed(1000 + comm.rank),
                              dtype=torch.float64))
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


def rounds_for(g) -> int:
    """Enough rounds to fall ~1e-7 (float64 keeps the tail accurate), whole periods."""
    rho = second_eigenvalue([g.mixing_matrix(t) for t in range(g.period)])
    if rho < 1e-9:
        return 2 * g.period
    return min(60, 2 * g.period * math.ceil(math.log(1e-7) / math.log(rho) / (2 * g.period)))


@pytest.fixture(scope="module")
def averaged(comm, ctl):
    """``averaged(name)``: D-PSGD averaging on that graph (run once per graph)."""
    cache = {}

    def get(name):
        if name not in cache:
            g = build_graph(name, K)
            cache[name] = (g, *averaging(comm, ctl, g, rounds=rounds_for(g)))
        return cache[name]
    return get


def test_only_the_torus_is_unbuildable_and_only_where_the_rank_count_does_not_factor():
    for name in set(GRAPHS) - set(BUILDABLE):
        assert name == "torus" and (K < 4 or all(K % d for d in range(2, K))), f"{name} on {K} ranks"


@pytest.mark.parametrize("name", BUILDABLE)
def test_averaging_follows_w_t_x0_and_contracts_at_lambda_2(name, averaged):
    g, opt, m, X0, d, _ = averaged(name)
    Ws = [g.mixing_matrix(t) for t in range(g.period)]
    rho, T = second_eigenvalue(Ws), len(d) - 1
    X, pred = X0.copy(), [distances(X0)]
    for t in range(T):
        X = Ws[t % g.period] @ X
        pred.append(distances(X))
    assert np.all(np.abs(d - np.array(pred)) <= 1e-9 * d[0]), f"distances {d} vs W^t X0 {pred}"
    if rho < 1e-9:
        assert d[g.period] <= 1e-12 * d[0], f"|λ2| = 0 must average exactly in {g.period} rounds: {d}"
    else:
        w = T // 2 // g.period * g.period
        rate = (d[T] / d[T - w]) ** (1 / w)
        assert abs(rate - rho) <= 0.02 * rho, f"measured rate {rate:.4f} vs |λ2| {rho:.4f}"
        assert d[T] < d[0], "the consensus distance must shrink"


def out_degree(g, rank) -> int:
    degrees = {len(g.out_peers(rank, t)) for t in range(g.period)}
    assert len(degrees) == 1, f"{g.name}: one out-degree per round, got {degrees}"
    return degrees.pop()


@pytest.mark.parametrize("name", BUILDABLE)
def test_bytes_per_round_are_out_degree_times_the_parameter_bytes(name, averaged, comm):
    g, opt, m, X0, d, (sent, recv) = averaged(name)
    deg = out_degree(g, comm.rank)
    assert sent == deg * PARAM_BYTES and recv == deg * PARAM_BYTES, \
        f"{sent}/{recv} bytes per round, expected {deg} × {PARAM_BYTES}"
    if name == "one-peer-exponential":   # the same on any number of ranks
        assert sent == (PARAM_BYTES if K > 1 else 0), f"one peer: {sent} bytes"


@pytest.mark.parametrize("name", BUILDABLE)
def test_push_sum_on_a_regular_graph_equals_dpsgd_with_8_more_bytes(name, averaged, comm, ctl):
    """The weights stay 1; the messages carry the weight too."""
    g, _, _, _, d, _ = averaged(name)
    opt, m, X0, d_ps, (sent, _) = averaging(comm, ctl, g, mode="push-sum", rounds=min(len(d) - 1, 6))
    assert sent == out_degree(g, comm.rank) * (PARAM_BYTES + 8), f"push-sum: {sent} bytes per round"
    assert opt.w == 1.0, f"push-sum weight {opt.w} on a regular graph"
    assert np.allclose(d_ps, d[:len(d_ps)], rtol=1e-9, atol=1e-12 * d[0]), "push-sum != D-PSGD"


# 4. CHOCO ---------------------------------------------------------------------------------------
def test_choco_with_the_identity_and_gamma_1_equals_dpsgd(comm):
    m = make()
    plain = train(Gossip(m, sgd(m), comm, graph="ring"), m, comm.rank)
    m = make()
    got = train(Gossip(m, sgd(m), comm, graph="ring", compressor=Compressor()), m, comm.rank)
    assert_models_close(got, plain, "CHOCO(identity, γ=1) vs D-PSGD")


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


@pytest.mark.parametrize("cname", LOSSY)
def test_choco_with_a_lossy_compressor_keeps_the_average_and_contracts(cname, comm, ctl):
    """Sparsifiers at half density: CHOCO with γ = 0.4 contracts only if Q keeps enough of
    x − x̂ (Koloskova et al. 2019 need γ of order δ, the compressor's quality; 1% top-k would
    need γ ≈ 0.01)."""
    comp = TopHalf() if cname == "tophalf" else COMPRESSORS[cname](CompressorConfig(name=cname, ratio=0.5))
    g = build_graph("ring", K)
    opt, m, X0, d, (sent, _) = averaging(comm, ctl, g, rounds=40, compressor=comp, gamma=0.4)
    mean = ctl.allreduce_(m.v.detach().clone()).div_(K).numpy()
    assert np.allclose(mean, X0.mean(0), rtol=0, atol=1e-10), "the average moved"
    if K > 1:
        assert d[-1] < 0.5 * d[0], f"distance {d[0]:.3g} -> {d[-1]:.3g}"
    if cname == "tophalf":
        payload = (N // 2) * 8 + (N // 2) * 8     # float64 values + int64 indices
        assert sent == len(g.out_peers(comm.rank)) * payload, f"{sent} bytes per round"


# 5. async: mass conserved, consensus reached ------------------------------------------------------
@pytest.mark.parametrize("name", ["ring", "one-peer-exponential"])
def test_async_conserves_the_push_sum_mass_and_reaches_consensus(name, comm, ctl):
    opt, m, X0, d, _ = averaging(comm, ctl, build_graph(name, K), mode="async", rounds=40, barrier=True)
    opt.close()
    num = ctl.allreduce_((m.v.detach() * opt.w).clone()).numpy()
    ws = float(ctl.allreduce_(torch.tensor([opt.w], dtype=torch.float64)))
    final = opt.consensus_distance(ctl)
    assert np.allclose(num, X0.sum(0), rtol=1e-10, atol=1e-10) and abs(ws - K) < 1e-10, \
        f"push-sum mass not conserved (Σw = {ws})"
    assert final <= 0.05 * d[0] if K > 1 else final == 0, f"distance {d[0]:.3g} -> {final:.3g}"


# 6. bad arguments fail before any communication ---------------------------------------------------
BAD = {
    "mode": (dict(mode="gossipy"), "unknown gossip mode"),
    "order": (dict(order="later"), "unknown gossip order"),
    "graph": (dict(graph="star"), "unknown graph"),
    "graph-size": (dict(graph=lambda: build_graph("ring", K + 1)), "communicator has"),
    "gamma-without-compressor": (dict(consensus_step=0.5), "needs a compressor"),
    "gamma-zero": (dict(compressor=Compressor, consensus_step=0.0), "(0, 1]"),
    "async-compressed": (dict(mode="async", compressor=Compressor), "mode='dpsgd'"),
}
if build_graph("one-peer-exponential", K).period > 1:   # K ≤ 2: one offset, a static graph
    BAD["time-varying-compressed"] = (dict(graph="one-peer-exponential", compressor=Compressor),
                                      "static graph")
if K in (2, 3):
    BAD["torus"] = (dict(graph="torus"), "torus needs")
if K >= 3:
    BAD["irregular"] = (dict(graph=ring_chord), "not regular")


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_raise_before_any_communication(case, comm):
    kwargs, text = BAD[case]
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    m = make()
    with pytest.raises((ValueError, TypeError)) as e:
        Gossip(m, sgd(m), comm, **kwargs)
    assert text in str(e.value), f"expected {text!r} in {e.value}"
