"""Gossip SGD: graphs and config in-process; the strategy under real mpirun (tests/mpi/check_gossip.py,
each case asserted on every rank); the CLI on 2 and 4 ranks for the summary and the per-rank bytes."""
import json
import math

import numpy as np
import pytest

from conftest import run_ranks, shared_mpi_suite
from lowcomm.compress import COMPRESSORS
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError
from lowcomm.strategies.gossip.graphs import GRAPHS, EdgeGraph, Torus, build_graph, second_eigenvalue

def graphs_on(K):
    return [build_graph(n, K) for n in GRAPHS if n != "torus" or K in (4, 6, 8, 9, 12, 16)]


@pytest.mark.parametrize("K", range(1, 17))
def test_built_in_graphs_are_consistent_regular_and_doubly_stochastic(K):
    for g in graphs_on(K):
        g.check()
        assert g.regular, g
        for t in range(g.period):
            W = g.mixing_matrix(t)
            assert np.allclose(W.sum(0), 1) and np.allclose(W.sum(1), 1), (g, t)
            assert (W >= 0).all()
            P = g.push_sum_matrix(t)
            assert np.allclose(P, W), (g, t)     # regular: push-sum's weights are D-PSGD's
        if K > 1:   # connected: one period contracts strictly
            assert second_eigenvalue([g.mixing_matrix(t) for t in range(g.period)]) < 1 - 1e-9, g


@pytest.mark.parametrize("K", range(2, 17))
def test_degrees(K):
    tau = math.ceil(math.log2(K))
    assert len(build_graph("ring", K).out_peers(0)) == min(2, K - 1)
    assert len(build_graph("exponential", K).out_peers(0)) == tau
    one = build_graph("one-peer-exponential", K)
    assert one.period == tau and all(len(one.out_peers(i, t)) == 1 for i in range(K) for t in range(tau))
    assert [one.out_peers(0, t)[0] for t in range(tau)] == [2 ** k for k in range(tau)]
    assert len(build_graph("complete", K).out_peers(0)) == K - 1


@pytest.mark.parametrize("K", [2, 4, 8, 16])
def test_one_peer_exponential_averages_exactly_in_log2_rounds_for_powers_of_two(K):
    g = build_graph("one-peer-exponential", K)
    prod = np.eye(K)
    for t in range(g.period):
        prod = g.mixing_matrix(t) @ prod
    assert np.allclose(prod, np.full((K, K), 1 / K), atol=1e-15)


def test_torus_shape_and_errors():
    t = Torus(12)
    assert (t.rows, t.cols) == (3, 4) and t.out_peers(0) == [1, 3, 4, 8]
    for K in (1, 2, 3, 5, 7, 11, 13):
        with pytest.raises(ValueError, match="torus needs the rank count to factor"):
            build_graph("torus", K)


def test_graph_errors():
    with pytest.raises(ValueError, match="unknown graph 'star'; known: ring, torus"):
        build_graph("star", 4)
    with pytest.raises(ValueError, match="positive rank count"):
        build_graph("ring", 0)
    g = EdgeGraph(3, [(0, 1), (1, 2), (2, 0), (0, 2)])
    assert not g.regular
    with pytest.raises(ValueError, match="not regular"):
        g.mixing_matrix()
    P = g.push_sum_matrix()
    assert np.allclose(P.sum(0), 1) and not np.allclose(P.sum(1), 1)
    with pytest.raises(ValueError, match="bad out-peers"):
        EdgeGraph(2, [(0, 0)])


@pytest.mark.parametrize("override,key", [
    ("strategy.graph=star", "strategy.graph"),
    ("strategy.gossip_mode=gossipy", "strategy.gossip_mode"),
    ("strategy.gossip_order=later", "strategy.gossip_order"),
    ("strategy.consensus_step=0", "strategy.consensus_step"),
    ("strategy.consensus_step=0.5", "strategy.consensus_step"),          # without a compressor
    ("strategy.backend=horovod", "strategy.backend"),
    ("compressor.name=none", None),
])
def test_config_errors_name_the_key(override, key):
    if key is None:      # the control case: a valid override passes
        load_config(None, ["strategy.name=gossip", override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, ["strategy.name=gossip", override])
    assert e.value.key == key, e.value


def test_config_accepts_gossip_keys():
    cfg = load_config(None, ["strategy.name=gossip", "strategy.graph=one-peer-exponential",
                             "strategy.gossip_mode=push-sum", "strategy.gossip_order=atc"])
    assert (cfg.strategy["graph"], cfg.strategy["gossip_mode"], cfg.strategy["gossip_order"]) == \
        ("one-peer-exponential", "push-sum", "atc")


@pytest.mark.parametrize("np_", [2, 3, 4])   # 2: both ring neighbours are one rank
@pytest.mark.mpi_checks("check_gossip.py", timeout=200)
def test_gossip_under_mpirun(np_):
    cases = shared_mpi_suite(np_, "check_gossip.py")
    for name in (n for n in COMPRESSORS if n != "none"):      # CHOCO with every lossy one
        assert f"check_gossip.py::test_choco_with_a_lossy_compressor_keeps_the_average_and_contracts[{name}]" \
            in cases, name
    for g in graphs_on(np_):                                  # averaging on every graph that fits
        assert f"check_gossip.py::test_averaging_follows_w_t_x0_and_contracts_at_lambda_2[{g.name}]" in cases


TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=4", "data.seq_len=32",
        "data.max_bytes=300000", "eval_batches=2", "steps=6", "log_every=3", "comm.timeout_s=30",
        "strategy.name=gossip"]


def train(out, np_, *extra):
    args = ["--quiet", "--out", out] + [a for o in (*TINY, *extra) for a in ("--set", o)]
    r = run_ranks(np_, "lowcomm", "train", *args, timeout=120)
    assert r.returncode == 0, r.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), lines


def test_cli_bytes_per_rank_do_not_grow_with_ranks_and_summary_reports_consensus(tmp_path):
    graph = "strategy.graph=one-peer-exponential"
    s2, _ = train(tmp_path / "2", 2, graph)
    s4, lines = train(tmp_path / "4", 4, graph)
    for s in (s2, s4):     # one fp32 model to one peer per step
        assert s["gossip_bytes_per_rank_per_step"] == 4 * s["params"], s
        assert s["degree"] == 1 and s["graph"] == "one-peer-exponential"
    assert [h[0] for h in s4["consensus_distance_by_step"]] == [3, 6]
    assert all(x["consensus_distance"] > 0 for x in lines)
    assert s4["consensus_distance"] > 0


def test_cli_graph_that_does_not_fit_the_rank_count_names_the_key(tmp_path):
    r = run_ranks(3, "lowcomm", "train", "--quiet", "--out", tmp_path,
                  *[a for o in (*TINY, "strategy.graph=torus") for a in ("--set", o)], timeout=60)
    assert r.returncode != 0 and "config key 'strategy.graph': torus needs" in r.stderr, r.output

