"""Mixture-of-experts layers and expert parallelism: routing, capacity, dropped assignments and
the load-balancing loss against hand computations (one process); the expert-parallel layer on 2
and 4 ranks under real mpirun against the same layer on one rank (tests/mpi/check_experts.py,
each case asserted on every rank); the MoE task under ``lowcomm train``."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import run_ranks, shared_mpi_suite
from lowcomm.errors import ArgumentError, ConfigError
from lowcomm.parallel.experts import MoE, aux_loss, capacity, load_balancing_loss, route
from lowcomm.parallel.plans import tinygpt_plan
from lowcomm.run.api import load_config
from lowcomm.tasks import load_task

ATOL = 1e-6      # float32 sums in another order than the reference loop's


def test_capacity_is_the_ceiling_of_cf_tokens_k_over_experts():
    assert capacity(6, 2, 1, 1.0) == 3
    assert capacity(6, 4, 2, 1.25) == math.ceil(1.25 * 6 * 2 / 4) == 4
    assert capacity(10, 1, 1, 1.1) == 11            # the decimal 1.1, not 1.1000000000000001
    assert capacity(7, 4, 1, 0.5) == 1


def test_top1_routing_drops_the_assignments_past_capacity_in_token_order():
    """6 tokens, 2 experts, cf = 1: capacity 3; tokens 0, 1, 3, 4 ask for expert 0, so token 4
    (the fourth in line) is dropped; the gate is the router's probability (Switch)."""
    logits = torch.tensor([[2., 0], [1, 0], [0, 1], [3, 0], [1, -1], [0, 2]])
    r = route(logits, 1, 1.0)
    assert r.capacity == 3
    assert r.expert.tolist() == [0, 0, 1, 0, 0, 1]
    assert r.keep.tolist() == [True, True, True, True, False, True]
    p = torch.softmax(logits, -1)
    assert torch.allclose(r.gate, p.max(-1).values)


def test_top2_routing_serves_every_first_choice_before_any_second():
    """4 tokens, 3 experts, k = 2, cf = 0.75: capacity ceil(0.75·4·2/3) = 2. Every token's
    first choice is expert 0: tokens 2 and 3's first choices are dropped (past 2), and the
    second choices are served after all the first: 1, 1, 2, 1 -> token 3's to expert 1 is the
    third in line there, dropped. Gates: the top-2 probabilities renormalised (GShard)."""
    logits = torch.tensor([[3., 1, 0], [3, 2, 0], [3, 0, 1], [3, 1, 0]])
    r = route(logits, 2, 0.75)
    assert r.capacity == 2
    assert r.expert.tolist() == [0, 0, 0, 0, 1, 1, 2, 1]
    assert r.keep.tolist() == [True, True, False, False, True, True, True, False]
    top = torch.softmax(logits, -1).topk(2, -1).values
    assert torch.allclose(r.gate, (top / top.sum(-1, keepdim=True)).T.reshape(-1))
    # 2 experts of capacity 1: token 1's first choice (expert 1) goes before token 0's second
    # (expert 1 too); in token order token 0 would have taken both experts
    r = route(torch.tensor([[1., 0], [0, 1]]), 2, 0.5)
    assert r.capacity == 1 and r.expert.tolist() == [0, 1, 1, 0]
    assert r.keep.tolist() == [True, True, False, False]


def hand_aux(probs, experts, E, k):
    """E · Σ_i f_i · P_i by loops: f_i = assignments to i / (T·k), P_i = mean probability of i."""
    T = len(probs)
    f = [sum(1 for e in experts if e == i) / (T * k) for i in range(E)]
    P = [sum(float(probs[t][i]) for t in range(T)) / T for i in range(E)]
    return E * sum(f[i] * P[i] for i in range(E))


@pytest.mark.parametrize("k", [1, 2])
def test_load_balancing_loss_is_switchs_formula(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(10, 4, generator=g)
    r = route(logits, k, 1.0)
    want = hand_aux(torch.softmax(logits, -1).tolist(), r.expert.tolist(), 4, k)
    assert abs(float(load_balancing_loss(r)) - want) < 1e-6
    uniform = route(torch.zeros(8, 4), 1, 1.0)
    assert abs(float(load_balancing_loss(uniform)) - 1.0) < 1e-6    # a uniform router: 1


def reference(moe, x):
    """The layer's output token by token (Σ over the kept assignments of gate · expert(x)), its
    dropped assignments and its load-balancing loss."""
    flat = x.reshape(-1, moe.d_model)
    r = route(moe.router(flat), moe.settings.top_k, moe.settings.capacity_factor)
    rows = []
    for t in range(flat.shape[0]):
        y = torch.zeros(moe.d_model)
        for a in range(t, r.expert.numel(), flat.shape[0]):
            if r.keep[a]:
                y = y + r.gate[a] * moe.experts[str(int(r.expert[a]))](flat[t])
        rows.append(y)
    return torch.stack(rows).reshape(x.shape), int((~r.keep).sum()), load_balancing_loss(r)


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 0.75)])
def test_layer_output_gradients_and_dropped_count_equal_the_token_by_token_sum(k, cf):
    torch.manual_seed(0)
    moe = MoE(8, experts=4, top_k=k, capacity_factor=cf, hidden=16)
    x = torch.randn(3, 5, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = moe(a)
    assert moe.routed == 15 * k and moe.dropped > 0
    assert moe.dropped_fraction == moe.dropped / moe.routed
    (y.square().sum() + moe.aux_loss).backward()
    got = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad()
    want, dropped, aux = reference(moe, b)
    (want.square().sum() + aux).backward()
    assert dropped == moe.dropped
    assert torch.allclose(y, want, atol=ATOL)
    assert torch.allclose(a.grad, b.grad, atol=ATOL)
    for n, p in moe.named_parameters():
        assert (p.grad is None) == (n not in got), n
        assert p.grad is None or torch.allclose(got[n], p.grad, atol=ATOL), n


def test_bad_settings_are_errors_naming_the_setting():
    for options, key in (({"top_k": 0}, "top_k"), ({"top_k": 3, "experts": 2}, "top_k"),
                         ({"experts": 0}, "experts"), ({"capacity_factor": 0.0}, "capacity_factor"),
                         ({"hidden": 0}, "hidden"), ({"aux_coef": -1.0}, "aux_coef")):
        with pytest.raises(ArgumentError) as e:
            MoE(8, **options)
        assert e.value.key == key
    with pytest.raises(ArgumentError, match="not an option"):
        MoE(8, expert=4)


def test_the_moe_task_adds_the_load_balancing_loss_with_its_coefficient():
    sets = ["task=lowcomm.tasks.moe", "task.experts=4", "task.top_k=2", "task.aux_coef=0.5",
            "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "data.seq_len=8"]
    cfg = load_config(None, sets)
    task = load_task(cfg.task.name)
    torch.manual_seed(0)
    model = task.model(cfg)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2 and all(m.settings.top_k == 2 for m in layers)
    x = torch.randint(0, 256, (2, 8))
    total = task.loss(model, (x, x))
    lm = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    assert torch.allclose(total, lm + 0.5 * sum(m.aux_loss for m in layers), atol=1e-6)
    assert torch.allclose(aux_loss(model), 0.5 * sum(m.aux_loss for m in layers))
    assert task.criterion_fn is None           # pp would leave the aux loss out: it refuses
    with pytest.raises(ConfigError) as e:
        task.model(load_config(None, [*sets, "task.top_k=5"]))
    assert e.value.key == "task.top_k"
    with pytest.raises(ConfigError, match="have a MoE") as e:       # tp's GPT plan: dense MLPs
        tinygpt_plan(model, sequence=False)
    assert e.value.key == "plan"


@pytest.mark.mpi_checks("check_experts.py", np=2, timeout=120)
def test_expert_parallel_on_two_ranks():
    cases = shared_mpi_suite(2, "check_experts.py")
    assert any("test_expert_parallel_equals_one_rank" in c for c in cases)
    assert any("test_all_to_all_bytes_equal_the_formula" in c for c in cases)
    assert any("test_an_ep_step_equals_data_parallelism_of_the_whole_model" in c for c in cases)
    assert any("test_ep_refuses_experts_that_do_not_divide_naming_the_setting" in c for c in cases)


@pytest.mark.mpi_checks("check_experts.py", np=4, timeout=120)
def test_expert_parallel_on_four_ranks():
    cases = shared_mpi_suite(4, "check_experts.py")
    assert any("test_expert_parallel_equals_one_rank" in c for c in cases)
    assert any("test_an_ep_step_equals_data_parallelism_of_the_whole_model" in c for c in cases)


def test_lowcomm_train_runs_the_moe_task(tmp_path):
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--out", tmp_path / "run",
                  *[a for s in ("task=lowcomm.tasks.moe", "task.experts=4", "task.top_k=2",
                                "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                                "data.seq_len=8", "batch_size=2", "steps=4", "eval_batches=1",
                                "data.path=/usr/share/common-licenses")
                    for a in ("--set", s)], timeout=120)
    assert r.returncode == 0, r.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "lowcomm.tasks.moe" and summary["steps"] == 4
    assert summary["ranks_agree"] is True and math.isfinite(summary["final_loss"])
