"""FSDP (torch FSDP2 ``fully_shard`` behind lowcomm's method interface) on 2 ranks.

References: one process training on the whole batch (the ranks' batches together) with the same
torch optimizer. FSDP's reduce-scatter averages the ranks' gradients in another order than the
whole batch's backward sums them, so the match is to float tolerance: LOSS_RTOL on the losses,
PARAM_RTOL/PARAM_ATOL on the parameters (measured: printed as ``max |diff|`` by each case)."""
import io

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import random_batch, seeded_mlp, toy_dataset
from lowcomm.errors import ArgumentError, LowcommError
from lowcomm.run.evaluate import dict_sha256, state_sha256
from lowcomm.strategies.sharded.fsdp import FSDP, ShardOf, join_shards
from lowcomm.tasks import dataset_batches
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2,))
B, STEPS = 4, 5
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 1e-6
transformers = pytest.importorskip("transformers")


def mlp():
    return seeded_mlp(10, 33, 17, 3)       # 33, 17 rows: uneven chunks on 2 ranks


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def mlp_batch(step, part=None):
    x, y = random_batch(step, SIZE * B)
    return (x, y) if part is None else (x[part * B:(part + 1) * B], y[part * B:(part + 1) * B])


def gpt2_batch(step, part=None):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, 64, (SIZE * B, 16), generator=g)
    return x if part is None else x[part * B:(part + 1) * B]


CASES = {   # name: (model, batch(step, part), loss(model, batch), wrap)
    "mlp": (mlp, mlp_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), "Linear"),
    "gpt2": (gpt2, gpt2_batch, lambda m, x: m(input_ids=x, labels=x).loss, "GPT2Block"),
}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(case, model, opt, steps, part, clip=None):
    """Losses of ``steps`` steps (and the gradient norms clip_grad_norm_ returned)."""
    _, batch, loss_of, _ = CASES[case]
    losses, norms = [], []
    for step in steps:
        opt.zero_grad()
        loss = loss_of(model, batch(step, part))
        loss.backward()
        if clip is not None:
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(n.full_tensor() if hasattr(n, "full_tensor") else n))
        opt.step()
        losses.append(loss.detach())
    return losses, norms


def whole_batch(case, steps=range(STEPS), clip=None, optimizer=adamw):
    model = CASES[case][0]()
    losses, norms = train(case, model, optimizer(model), steps, None, clip)
    return model, [float(x) for x in losses], norms


def sharded(case, comm, clip=None, steps=range(STEPS), optimizer=adamw):
    model = CASES[case][0]()
    opt = FSDP(model, optimizer(model), comm, wrap=CASES[case][3])
    losses, norms = train(case, model, opt, steps, comm.rank, clip)
    mean = torch.stack(losses)
    comm.allreduce_(mean)            # the whole batch's loss is the mean of the ranks'
    return model, opt, (mean / comm.size).tolist(), norms


def max_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def assert_close_models(a, b, what):
    off = [n for (n, p), q in zip(a.named_parameters(), b.parameters())
           if not torch.allclose(p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL)]
    assert not off, f"{what}: {off} differ (max |diff| {max_diff(a, b):.3g})"


@pytest.mark.parametrize("case", CASES)
def test_fsdp_trains_as_one_process_on_the_whole_batch(case, comm):
    """SGD with momentum: to float tolerance (the sums' order differs)."""
    ref, ref_losses, _ = whole_batch(case, optimizer=sgd)
    model, opt, losses, _ = sharded(case, comm, optimizer=sgd)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    opt.finish()
    print(f"{case}: max |loss diff| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.3g}, "
          f"max |param diff| {max_diff(model, ref):.3g}")
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), f"{case}: losses differ"
    assert_close_models(model, ref, case)
    assert not any(hasattr(p, "to_local") for p in model.parameters()), "finish left DTensors"
    assert len(set(comm.allgather_object(state_sha256(model)))) == 1, "ranks hold different models"
    if case == "gpt2":     # tied embeddings stay tied
        assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("case", CASES)
def test_fsdp_equals_syncdp_bit_for_bit_at_two_ranks(case, comm):
    """AdamW, whose update divides by the root of the second moment, turns the whole batch's
    other summation order into up to 3e-5 on GPT-2's parameters after 5 steps (SyncDP differs
    from it by as much); against SyncDP at 2 ranks (one addition per element, commutative, then
    a halving) the arithmetic is the same: the parameters must be equal."""
    model, opt, losses, _ = sharded(case, comm)
    opt.finish()
    ref = CASES[case][0]()
    dp = lowcomm.SyncDP(ref, adamw(ref), comm)
    train(case, ref, dp, range(STEPS), comm.rank)
    dp.finish()
    assert state_sha256(model) == state_sha256(ref), \
        f"{case}: FSDP and SyncDP differ (max |diff| {max_diff(model, ref):.3g})"


def test_each_rank_holds_one_kth_of_the_parameters_and_optimizer_state(comm):
    ref, _, _ = whole_batch("gpt2", steps=range(1))
    full = sum(p.numel() for p in ref.parameters())
    model, opt, _, _ = sharded("gpt2", comm, steps=range(1))
    params = sum(p.to_local().numel() for p in model.parameters())
    moments = sum(v.to_local().numel() for s in opt.optimizer.state.values()
                  for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    per_rank = comm.allgather_object((params, moments))
    opt.finish()
    print(f"gpt2: {full} parameters; per rank (params, Adam moments): {per_rank}")
    assert sum(p for p, _ in per_rank) == full, "the shards do not add up to the model"
    assert sum(m for _, m in per_rank) == 2 * full
    # dim-0 chunks: at most one row per tensor above the even split
    rows = sum(p.numel() // p.shape[0] for p in ref.parameters())
    assert params <= full / SIZE + rows and moments <= 2 * (full / SIZE + rows)
    assert params >= full / SIZE - rows * (SIZE - 1)


def test_clip_grad_norm_sees_the_global_norm(comm):
    ref, ref_losses, ref_norms = whole_batch("mlp", clip=0.05)
    model, opt, losses, norms = sharded("mlp", comm, clip=0.05)
    opt.finish()
    print(f"norms: fsdp {norms}, whole batch {ref_norms}")
    assert all(n > 0.05 for n in ref_norms), "the clip never bit: the check would not see it"
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    assert_close_models(model, ref, "clipped")


def saved(opt):
    """The checkpoint's contents through torch.save (as the run's checkpoints hold them)."""
    buf = io.BytesIO()
    torch.save({"model": opt.model_state_dict(), "strategy": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_resume_from_a_checkpoint_is_bit_exact(comm):
    model, opt, _, _ = sharded("gpt2", comm, steps=range(3))
    state = saved(opt)
    assert all(isinstance(v, ShardOf) for v in state["model"].values() if not torch.is_tensor(v))
    train("gpt2", model, opt, range(3, STEPS), comm.rank)
    opt.finish()
    again = gpt2()
    opt2 = FSDP(again, adamw(again), comm, wrap="GPT2Block")
    opt2.load_model_state_dict(state["model"])
    opt2.load_state_dict(state["strategy"])
    train("gpt2", again, opt2, range(3, STEPS), comm.rank)
    opt2.finish()
    assert state_sha256(again) == state_sha256(model), "the resumed run differs"


def test_a_state_dict_before_the_first_step_changes_nothing_and_resumes_exactly(comm):
    """torch's FSDP optimizer state dict makes missing state with an optimizer step at lr 0
    (AdamW's count 1 and zero moments: its first real step would then be its second, with
    another bias correction). A state dict taken before the first step (accelerate takes one
    when the Trainer starts; a checkpoint at step 0) must leave the run bit-identical, and
    resuming from it must start as a fresh optimizer does."""
    model, opt, _, _ = sharded("gpt2", comm, steps=range(STEPS))
    opt.finish()
    again = gpt2()
    opt2 = FSDP(again, adamw(again), comm, wrap="GPT2Block")
    state = saved(opt2)
    assert not opt2.optimizer.state and not state["strategy"]["optimizer"]["state"]
    third = gpt2()
    opt3 = FSDP(third, adamw(third), comm, wrap="GPT2Block")
    train("gpt2", third, opt3, range(1), comm.rank)            # state to be replaced
    opt3.load_model_state_dict(state["model"])
    opt3.load_state_dict(state["strategy"])
    assert not opt3.optimizer.state, "a step-0 checkpoint resumed with optimizer state"
    for m, o in ((again, opt2), (third, opt3)):
        train("gpt2", m, o, range(STEPS), comm.rank)
        o.finish()
        assert state_sha256(m) == state_sha256(model), "the run differs from one without it"


def test_resume_on_one_rank_continues_the_two_rank_run(comm):
    """2 -> 1: each rank alone resumes the 2-rank checkpoint (reshard) — exactly the state the
    2 ranks held — and trains on the whole batch as the 2 ranks would have."""
    model, opt, _, _ = sharded("mlp", comm, steps=range(3))
    old = comm.allgather_object(saved(opt))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    moments = {n: opt.optimizer.state[p]["exp_avg_sq"].full_tensor()
               for n, p in model.named_parameters()}
    train("mlp", model, opt, range(3, STEPS), comm.rank)
    opt.finish()
    alone = comm.split(comm.rank)                   # a 1-rank world on each rank
    single = mlp()
    opt1 = FSDP(single, adamw(single), alone, wrap="Linear")
    merged = opt1.reshard(old)
    opt1.load_model_state_dict(merged["model"])
    opt1.load_state_dict(merged["strategy"])
    for n, p in single.named_parameters():
        assert torch.equal(p.full_tensor(), full[n]), f"{n}: not the 2 ranks' parameters"
        assert torch.equal(opt1.optimizer.state[p]["exp_avg_sq"].full_tensor(), moments[n]), n
    train("mlp", single, opt1, range(3, STEPS), None)
    opt1.finish()
    assert_close_models(single, model, "resumed on 1 rank")


def test_a_checkpoint_of_another_method_is_refused(comm):
    model = mlp()
    opt = FSDP(model, adamw(model), comm, wrap="Linear")
    with pytest.raises(LowcommError, match="written by 'syncdp', not fsdp"):
        opt.load_state_dict({"optimizer": {}, "method": "syncdp"})
    opt.finish()


@pytest.mark.parametrize("wrap,match", [
    ("GPT2Blok", "argument 'wrap': 'GPT2Blok' matches no module of GPT2LMHeadModel"),
    ("GPT2Block,Conv9", "argument 'wrap': Conv9 matches no module of GPT2LMHeadModel"),
    (lambda m: isinstance(m, torch.nn.Conv2d), "argument 'wrap': the callable '<lambda>' matches no module"),
])
def test_a_wrap_that_matches_nothing_is_an_error_naming_it(wrap, match, comm):
    model = gpt2()
    inner = adamw(model)
    with pytest.raises(ArgumentError, match=match):
        FSDP(model, inner, comm, wrap=wrap)
    inner.step()          # refused before anything changed: the optimizer is the user's again
    assert not any(hasattr(p, "to_local") for p in model.parameters())


def test_wrap_by_a_callable_shards_the_blocks_it_picks(comm):
    from torch.distributed.fsdp import FSDPModule
    model = gpt2()
    opt = FSDP(model, adamw(model), comm, wrap=lambda m: type(m).__name__ == "GPT2Block")
    assert [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)] == \
        ["FSDPGPT2LMHeadModel", "FSDPGPT2Block", "FSDPGPT2Block"]
    opt.finish()
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def run_fsdp(comm, out, resume=None, steps=STEPS):
    """The MLP task through lowcomm's loop under fsdp (AdamW, checkpoints every 3 steps, held-out
    loss every 2: 3 eval batches on 2 ranks, so the ranks evaluate different shares)."""
    data = toy_dataset()
    task = lowcomm.from_functions(lambda cfg: mlp(), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                                  dataset_batches(data),
                                  lambda cfg: [data[i * 50:(i + 1) * 50] for i in range(3)])
    return lowcomm.train(task, strategy="fsdp:wrap=Linear",
                         steps=steps, batch_size=B, log_every=2, eval_every=2, lr=0.01,
                         set=["optimizer.name=adamw", "checkpoint.every=3"], out=str(out),
                         comm=comm, run=lowcomm.RunOptions(resume=resume, progress=False))


def sha_of_checkpoint(folder) -> str:
    """state_sha256 of the whole model the ranks' shard files hold (joined on dim 0)."""
    return dict_sha256(join_shards([torch.load(f, weights_only=False)["model"]
                                    for f in sorted(folder.glob("rank-*.pt"))]))


def test_the_loop_resumes_a_two_rank_run_on_one_rank(comm, shared_dir):
    """Through lowcomm.train: the 2-rank run checkpoints shards; resumed on 1 rank at the
    checkpoint's step, the model is the whole of the 2 ranks' shards; resumed to the end, it
    finishes (finite eval loss, the resize recorded). Checked after rank 1 waited."""
    two = run_fsdp(comm, shared_dir / "two")
    problems = [] if two["ranks_agree"] is True and two["eval_loss"] == two["eval_loss"] else \
        [f"2-rank run: ranks_agree {two['ranks_agree']}, eval loss {two['eval_loss']}"]
    alone = comm.split(0 if comm.rank == 0 else -1)
    if comm.rank == 0:
        want = sha_of_checkpoint(shared_dir / "two" / "checkpoints" / f"step-{3:08d}")
        at = run_fsdp(alone, shared_dir / "one-at", resume=shared_dir / "two", steps=3)
        if at["state_sha256"] != want:
            problems.append("resumed on 1 rank, the model is not the 2 ranks' shards put together")
        one = run_fsdp(alone, shared_dir / "one", resume=shared_dir / "two")
        if not one["eval_loss"] == one["eval_loss"] or one["resizes"] != [{"step": 3, "from": 2, "to": 1}]:
            problems.append(f"1-rank resume: eval loss {one['eval_loss']}, resizes {one['resizes']}")
    waited, comm.watchdog.timeout_s = comm.watchdog.timeout_s, 600   # rank 1 waits for rank 0's runs
    try:
        every = comm.allgather_object(problems)
    finally:
        comm.watchdog.timeout_s = waited
    assert not any(every), every


def test_fsdp_traffic_is_in_the_ledger(comm):
    """Per step: one reduce-scatter of every gradient ((K-1)/K of the model's bytes sent by
    each rank: GPT-2's tensors split evenly here) and at least one all-gather of every
    parameter (forward; the blocks again in backward)."""
    from lowcomm.comm.ledger import Ledger
    model = gpt2()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    ledger = Ledger()
    opt = FSDP(model, adamw(model), comm.dup(ledger), wrap="GPT2Block")
    train("gpt2", model, opt, range(2), comm.rank)
    opt.finish()
    rows = {r["op"]: r for r in ledger.rows()}
    assert rows["reduce_scatter.fsdp"]["bytes_sent"] == 2 * full * (SIZE - 1) // SIZE
    assert rows["reduce_scatter.fsdp"]["calls"] == 2 * 3          # root + 2 blocks, 2 steps
    assert rows["allgather.fsdp"]["bytes_sent"] >= 2 * full * (SIZE - 1) // SIZE
    assert rows["allgather.fsdp"]["calls"] == 2 * (3 + 2)          # backward re-gathers blocks
