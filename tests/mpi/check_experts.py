"""Expert parallelism (a MoE layer's experts spread over the ranks, tokens moved by Comm's
all-to-all) on 2 and 4 ranks.

Reference: the same layer (every expert) on one rank, run on every rank's tokens in turn, each
rank's loss backward: its outputs, input gradients and router gradient are that rank's own;
an expert's gradient is the sum over every rank's tokens. The expert-parallel layer runs each
expert on the rows of every rank at once, so sums differ in order only: TOL = 1e-5 (absolute,
float32; measured differences ~1e-7)."""
import copy

import pytest
import torch

from lowcomm.comm.ledger import Ledger
from lowcomm.errors import ConfigError
from lowcomm.parallel.ep import ExpertParallel
from lowcomm.parallel.experts import MoE, expert_parallel, moe_layers, route
from lowcomm.tasks.tinygpt import TinyGPT
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2, 4))
D, TOL = 8, 1e-5


def tokens(rank):
    """Rank ``rank``'s tokens: a different count on each rank (3 + rank sequences of 4)."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3 + rank, 4, D, generator=g)


def weights(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + rank))


def run(layer, x, rank):
    """Output, input gradient, gradients by name and dropped assignments of ``layer`` on
    ``x``, for rank ``rank``'s loss Σ w·y + aux."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * weights(rank, y.shape)).sum() + layer.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, layer.dropped


def one_rank(full):
    """The reference on every rank's tokens: per rank (output, input grad, router grad,
    dropped) and the experts' gradients summed over the ranks."""
    per, experts = [], {}
    for s in range(SIZE):
        y, gx, grads, dropped = run(full, tokens(s), s)
        per.append((y, gx, grads["router.weight"], dropped))
        for n, g in grads.items():
            if n.startswith("experts."):
                experts[n] = experts.get(n, 0) + g
    return per, experts


CASES = {"top1-cf1.0": dict(top_k=1, capacity_factor=1.0),
         "top2-cf0.75": dict(top_k=2, capacity_factor=0.75),
         "top2-cf4": dict(top_k=2, capacity_factor=4.0)}


def layer_pair(comm, case, per_rank=2):
    torch.manual_seed(0)
    full = MoE(D, experts=per_rank * SIZE, hidden=16, **CASES[case])
    ep = copy.deepcopy(full).distribute_(comm.dup(Ledger()))
    return full, ep


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_equals_one_rank(comm, case):
    full, ep = layer_pair(comm, case)
    per, want_experts = one_rank(full)
    want_y, want_gx, want_router, want_dropped = per[RANK]
    y, gx, grads, dropped = run(ep, tokens(RANK), RANK)
    assert sorted(ep.experts) == [str(2 * RANK), str(2 * RANK + 1)]
    assert dropped == want_dropped and (dropped > 0) == (case != "top2-cf4")
    assert (y - want_y).abs().max() < TOL
    assert (gx - want_gx).abs().max() < TOL
    assert (grads["router.weight"] - want_router).abs().max() < TOL
    mine = {n for n in want_experts if n.split(".")[1] in ep.experts}
    assert mine == {n for n in grads if n.startswith("experts.")}
    for n in mine:
        assert (grads[n] - want_experts[n]).abs().max() < TOL, n


def kept_to(layer, rank, owner):
    """Kept assignments of rank ``rank``'s tokens to the experts of rank ``owner``."""
    x = tokens(rank).reshape(-1, D)
    s = layer.settings
    r = route(layer.router(x), s.top_k, s.capacity_factor)
    owners = r.expert // (s.experts // SIZE)
    return int((r.keep & (owners == owner)).sum())


@pytest.mark.parametrize("case", ["top1-cf1.0", "top2-cf0.75"])
def test_all_to_all_bytes_equal_the_formula(comm, case):
    """Dispatch: this rank's kept assignments to other ranks' experts × d × 4 bytes out, the
    others' to its experts in; combine the reverse; the backward the same again."""
    full, ep = layer_pair(comm, case)
    run(ep, tokens(RANK), RANK)
    out = sum(kept_to(full, RANK, o) for o in range(SIZE) if o != RANK) * D * 4
    into = sum(kept_to(full, s, RANK) for s in range(SIZE) if s != RANK) * D * 4
    ledger, level = ep.comm.ledger, ep.comm.level
    for op, sent, recv in (("alltoall.dispatch", out, into), ("alltoall.combine", into, out),
                           ("alltoall.combine.grad", out, into),
                           ("alltoall.dispatch.grad", into, out)):
        row = ledger.get(op, level)
        assert (row.calls, row.bytes_sent, row.bytes_recv) == (1, sent, recv), op
    assert out > 0 and into > 0
    assert ledger.get("alltoall.counts", level).bytes_sent == (SIZE - 1) * 2 * 8


def test_a_gpt_with_moe_blocks_equals_one_rank(comm):
    """Two MoE blocks of the built-in GPT, experts spread over the ranks: each rank's loss
    and its gradient of the replicated parameters as on one rank; an expert's gradient the sum
    of every rank's."""
    torch.manual_seed(0)
    full = TinyGPT(8, D, 2, 2, mlp=lambda d: MoE(d, experts=SIZE, top_k=2, hidden=16))
    ep = copy.deepcopy(full)
    expert_parallel(ep, comm.dup(Ledger()))
    batch = [torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(s))
             for s in range(SIZE)]
    want = {}
    for s in range(SIZE):
        full.zero_grad()
        loss = full.loss(batch[s], batch[s])
        loss.backward()
        for n, p in full.named_parameters():
            if s == RANK or ".experts." in n:
                want[n] = want.get(n, 0) + p.grad
        if s == RANK:
            want_loss = float(loss.detach())
    got = ep.loss(batch[RANK], batch[RANK])
    got.backward()
    assert abs(float(got.detach()) - want_loss) < TOL
    for n, p in ep.named_parameters():
        assert (p.grad - want[n]).abs().max() < TOL, n


def test_experts_that_do_not_divide_over_the_ranks_are_an_error(comm):
    with pytest.raises(ConfigError, match=f"{SIZE + 1} experts cannot be spread evenly over "
                       f"the {SIZE} ranks") as e:
        MoE(D, experts=SIZE + 1).distribute_(comm)
    assert e.value.key == "experts"


# the ep method: a step of ExpertParallel against data parallelism of the whole model ----------

def moe_gpt(experts):
    torch.manual_seed(0)
    return TinyGPT(8, D, 2, 2, mlp=lambda d: MoE(d, experts=experts, top_k=2, hidden=16,
                                                 capacity_factor=1.0))


def gpt_batch(s):
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(s))


def test_an_ep_step_equals_data_parallelism_of_the_whole_model(comm):
    """ExpertParallel over the world, one AdamW step (clipped to a norm it reaches): the
    clipping norm, and every parameter after the step, as one process computes them with the
    gradient (1/K) Σ_r ∇L_r of every rank's batch; ``finish()`` leaves that whole model on every
    rank."""
    full, model = moe_gpt(2 * SIZE), moe_gpt(2 * SIZE)
    ref_opt = torch.optim.AdamW(full.parameters(), lr=0.01)
    (sum(full.loss(gpt_batch(s), gpt_batch(s)) for s in range(SIZE)) / SIZE).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), 0.5)
    ref_opt.step()
    opt = ExpertParallel(model, torch.optim.AdamW(model.parameters(), lr=0.01), comm.dup(Ledger()))
    assert opt.batch_place() == (RANK, SIZE)
    opt.forward_backward(lambda m, b: m.loss(b, b), gpt_batch(RANK))
    norm = opt.clip_grad_norm_(0.5)
    assert abs(float(norm) - float(want_norm)) < TOL and float(norm) > 0.5
    opt.step()
    want = full.state_dict()
    mine = opt.model_state_dict()
    assert {k.split(".experts.")[1].split(".")[0] for k in mine if ".experts." in k} == \
        {str(2 * RANK), str(2 * RANK + 1)}
    for k, v in mine.items():
        assert (v - want[k]).abs().max() < TOL, k
    opt.finish()
    whole = model.state_dict()
    assert set(whole) == set(want)
    for k, v in whole.items():
        assert not v.is_meta and (v - want[k]).abs().max() < TOL, k
    assert all(m.comm is None for m in moe_layers(model))


def test_ep_refuses_experts_that_do_not_divide_naming_the_setting(comm):
    from lowcomm.parallel.ep import METHOD, ExpertSettings
    from lowcomm.strategies.method import Context
    model = moe_gpt(2 * SIZE + 1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=f"{2 * SIZE + 1} experts cannot be spread evenly") as e:
        METHOD.build(ExpertSettings(), model, opt, comm.dup(Ledger()), Context())
    assert e.value.key == "task.experts"
    assert all(len(m.experts) == 2 * SIZE + 1 and m.comm is None for m in moe_layers(model))
