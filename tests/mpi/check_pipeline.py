"""Pipeline parallelism (``pp``, torch.distributed.pipelining behind lowcomm's method) on 2 ranks.

Reference: one process training the whole model on the whole batch with the same torch
optimizer. The pipeline sums the micro-batches' gradients in another order than the whole
batch's backward, so the match is to float tolerance: LOSS_ATOL on each step's loss, PARAM_RTOL /
PARAM_ATOL on the parameters after the run (plain SGD; measured differences ~1e-7)."""
import pytest
import torch
import torch.nn.functional as F

from helpers import control
from lowcomm.comm.comm import init
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import ConfigError, LowcommError
from lowcomm.parallel.deferred import build_deferred
from lowcomm.parallel.pipeline import PipelineParallel, bubble_formula, schedules
from lowcomm.run.evaluate import state_sha256
from lowcomm.strategies.method import Context
from split_models import (assert_resumes_bit_for_bit, assert_same_state, language_models,
                          token_batch, train_beside)
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2,))
B, T, STEPS, M = 8, 16, 4, 4
LOSS_ATOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 1e-6
transformers = pytest.importorskip("transformers")


MODELS = language_models(T, layers=4, gpt2_heads=2)
tinygpt = MODELS["tinygpt"]


def lm_batch(step, vocab=256):
    return token_batch(step, (B, T), vocab)


def next_token(logits, x):
    """transformers' causal-LM loss: the next token's cross-entropy, a mean over tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


CASES = {   # name: (model, batch(step), criterion, split, the whole model's loss)
    "tinygpt": (tinygpt, lm_batch, lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
                None, lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())),
    "gpt2": (MODELS["gpt2"], lambda s: lm_batch(s, 64)[0], next_token, lambda x: ((x,), x),
             lambda m, x: m(input_ids=x, labels=x).loss),
    "llama": (MODELS["llama"], lambda s: lm_batch(s, 64)[0], next_token, lambda x: ((x,), x),
              lambda m, x: m(input_ids=x, labels=x).loss),
}


def run_both(case, schedule="1F1B", clip=None, steps=STEPS, deferred=False, example=None,
             **options):
    """(pipeline's losses, reference losses, pipelined model after finish, reference model);
    ``deferred``: the pipeline's model built on the meta device (each rank its stage only)."""
    make, batch, criterion, split, whole_loss = CASES[case]
    ref = make()
    model = build_deferred(make, "strategy.build") if deferred else make()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = PipelineParallel(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                           microbatches=M, schedule=schedule, criterion=criterion,
                           context=Context(split=split, batches=None if example is None else [example]),
                           **options)
    ours, theirs = train_beside(opt, ref, ropt, map(batch, range(steps)), None, whole_loss, clip)
    opt.finish()
    return ours, theirs, model, ref


def assert_same_model(model, ref):
    assert_same_state(model, ref, PARAM_RTOL, PARAM_ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp_equals_one_process_on_the_whole_batch(case):
    ours, theirs, model, ref = run_both(case)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL, (ours, theirs)
    assert_same_model(model, ref)
    assert len(set(control(init()).allgather_object(state_sha256(model)))) == 1


@pytest.mark.parametrize("schedule", sorted(schedules()))
def test_every_schedule_of_this_torch_trains_the_same_model(schedule):
    ours, theirs, model, ref = run_both("tinygpt", schedule, steps=3)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL, (schedule, ours, theirs)
    assert_same_model(model, ref)


@pytest.mark.parametrize("case", ["tinygpt", "gpt2"])
def test_clipping_by_the_norm_over_every_stage_equals_torchs_on_the_whole_model(case):
    ours, theirs, model, ref = run_both(case, clip=0.3)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL
    assert_same_model(model, ref)


def test_activations_and_their_gradients_are_charged_per_boundary():
    comm = init().dup(Ledger())            # this case's traffic alone
    model = tinygpt()
    opt = PipelineParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), comm,
                           microbatches=M, criterion=CASES["tinygpt"][2])
    for step in range(2):
        opt.zero_grad()
        opt.forward_backward(None, lm_batch(step))
        opt.step()
    one = (B // M) * T * 32 * 4              # a micro-batch's hidden states, float32
    act = comm.ledger.get("send.activation.0-1", comm.level)
    grad = comm.ledger.get("send.gradient.1-0", comm.level)
    sent, got = (act, grad) if RANK == 0 else (grad, act)
    assert (sent.calls, sent.bytes_sent) == (2 * M, 2 * M * one)
    assert (got.calls, got.bytes_recv, got.bytes_sent) == (0, 2 * M * one, 0)
    m = opt.metrics(control(comm))
    assert m["pp_bubble_formula"] == bubble_formula("1F1B", SIZE, M) == (SIZE - 1) / (M + SIZE - 1)
    assert 0.0 <= m["pp_bubble"] <= m["pp_bubble_max"] <= 1.0
    opt.finish()


def test_a_stage_resumes_bit_for_bit_from_its_state():
    make, batch, criterion, _, _ = CASES["tinygpt"]

    def fresh():
        model = make()
        return model, PipelineParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       microbatches=M, criterion=criterion)

    def steps(opt, a, b):
        for s in range(a, b):
            opt.zero_grad()
            opt.forward_backward(None, batch(s))
            opt.step()

    assert_resumes_bit_for_bit(fresh, steps)


def test_a_state_of_another_split_is_refused_naming_it():
    make, _, criterion, _, _ = CASES["tinygpt"]
    m1, m2 = make(), make()
    a = PipelineParallel(m1, torch.optim.SGD(m1.parameters(), lr=0.1), microbatches=M,
                         criterion=criterion, split="at:1")
    b = PipelineParallel(m2, torch.optim.SGD(m2.parameters(), lr=0.1), microbatches=M,
                         criterion=criterion, split="at:3")
    with pytest.raises(LowcommError, match="saved by another split"):
        b.load_model_state_dict(a.model_state_dict())
    with pytest.raises(LowcommError, match="split='at:1'"):
        b.load_state_dict(a.state_dict())
    a.close()
    b.close()


@pytest.mark.parametrize("options, key, words", [
    (dict(split="every:3"), "strategy.split", "every:3 cannot cut 4 blocks into 2 stages"),
    (dict(split="at:7"), "strategy.split", "not a block where a stage can begin"),
    (dict(schedule="Interleaved1F1B", stages_per_rank=3), "strategy.stages_per_rank",
     "6 stages for a model of 4 blocks"),
    (dict(schedule="Zigzag"), "strategy.schedule", "no schedule"),
])
def test_a_bad_split_or_schedule_is_an_error_naming_the_setting(options, key, words):
    model = tinygpt()
    with pytest.raises(ConfigError) as e:
        PipelineParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), microbatches=M,
                         criterion=CASES["tinygpt"][2], **options)
    assert e.value.key.endswith(key.split(".")[-1]) and words in str(e.value), str(e.value)


def test_micro_batches_that_do_not_divide_the_batch_are_an_error_naming_the_setting():
    model = tinygpt()
    opt = PipelineParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), microbatches=3,
                           criterion=CASES["tinygpt"][2])
    with pytest.raises(LowcommError, match="strategy.microbatches"):
        opt.forward_backward(None, lm_batch(0))
    opt.close()


def test_a_split_by_measured_time_cuts_alike_on_every_rank_and_trains_the_same_model():
    """``split = "time"``: rank 0's block times decide the cut (every rank holds the same
    bounds); the pipeline still equals one process on the whole batch."""
    ours, theirs, model, ref = run_both("tinygpt", split="time", example=lm_batch(0))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL
    assert_same_model(model, ref)
    m = tinygpt()
    opt = PipelineParallel(m, torch.optim.SGD(m.parameters(), lr=0.1), microbatches=M,
                           criterion=CASES["tinygpt"][2], split="time",
                           context=Context(batches=[lm_batch(0)]))
    every = control(init()).allgather_object(opt.bounds)
    assert every[0] == every[1] and every[0][0] == 0 and every[0][-1] == 4
    opt.close()
    m = tinygpt()
    with pytest.raises(ConfigError, match="needs each block's measured time"):
        PipelineParallel(m, torch.optim.SGD(m.parameters(), lr=0.1), microbatches=M,
                         criterion=CASES["tinygpt"][2], split="time")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pipeline_built_on_the_meta_device_holds_its_stage_and_trains_the_same_model(case):
    make, _, criterion, split, _ = CASES[case]
    ref, model = make(), build_deferred(make, "strategy.build")
    opt = PipelineParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), microbatches=M,
                           criterion=criterion, context=Context(split=split))
    held = {id(p) for st in opt.stages for p in st.parameters()}
    whole = dict(ref.named_parameters())
    for n, p in model.named_parameters():         # the stage's as the whole build's, bit for bit
        assert p.is_meta != (id(p) in held), n
        if id(p) in held:
            assert torch.equal(p, whole[n]), n
    opt.close()
    ours, theirs, trained, ref = run_both(case, deferred=True)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL, (ours, theirs)
    assert_same_model(trained, ref)
    for (n, b), rb in zip(trained.named_buffers(), ref.buffers()):   # non-persistent ones too
        assert torch.equal(b, rb), n
