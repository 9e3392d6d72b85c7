"""Tensor and sequence parallelism (``tp``, torch's DTensor parallel styles behind lowcomm's
method) on 2 ranks.

Reference: one process training the whole model on the same batch with the same torch optimizer.
The split layers sum partial products in another order (a row split's all-reduce), so the match
is to float tolerance: LOSS_ATOL on each step's loss, PARAM_RTOL / PARAM_ATOL on the parameters
after the run (SGD with momentum; measured differences ~1e-7)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import control
from lowcomm.comm.comm import init
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import ConfigError, LowcommError
from lowcomm.parallel.tensor import TensorParallel
from lowcomm.run.evaluate import state_sha256
from lowcomm.tasks.tinygpt import TinyGPT
from split_models import (assert_resumes_bit_for_bit, assert_same_state, language_models,
                           token_batch, train_beside)
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2,))
B, T, STEPS = 4, 16, 3
LOSS_ATOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 1e-6
transformers = pytest.importorskip("transformers")


MODELS = language_models(T, layers=2, gpt2_heads=4)
tinygpt = MODELS["tinygpt"]


def batch(step, vocab):
    return token_batch(step, (B, T), vocab)


CASES = {   # name: (model, vocabulary, the loss of a batch)
    "tinygpt": (tinygpt, 256, lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())),
    "gpt2": (MODELS["gpt2"], 64, lambda m, b: m(input_ids=b[0], labels=b[0]).loss),
    "llama": (MODELS["llama"], 64, lambda m, b: m(input_ids=b[0], labels=b[0]).loss),
}


def run_both(case, sequence=False, clip=None, steps=STEPS, comm=None):
    """(tp's losses, reference losses, the split model after finish, reference model, method
    before finish's parameter count on this rank)."""
    make, vocab, loss_fn = CASES[case]
    ref, model = make(), make()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), comm,
                         sequence=sequence)
    held = sum(p.numel() for p in opt.local_shards().values())
    ours, theirs = train_beside(opt, ref, ropt, (batch(s, vocab) for s in range(steps)), loss_fn,
                                loss_fn, clip)
    opt.finish()
    return ours, theirs, model, ref, held


def assert_same_model(model, ref):
    assert_same_state(model, ref, PARAM_RTOL, PARAM_ATOL)


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_equals_one_process_on_the_same_batch(case, sequence):
    ours, theirs, model, ref, _ = run_both(case, sequence)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL, (ours, theirs)
    assert_same_model(model, ref)
    assert len(set(control(init()).allgather_object(state_sha256(model)))) == 1


@pytest.mark.parametrize("case", ["tinygpt", "gpt2"])
def test_clipping_by_the_whole_models_norm_equals_torchs(case):
    ours, theirs, model, ref, _ = run_both(case, clip=0.3)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= LOSS_ATOL
    assert_same_model(model, ref)


def split_and_whole(model, opt):
    """(parameters in the plan's split layers, those of the rest) as this rank holds them."""
    split = {n for n in opt._pieces}
    held = opt.local_shards()
    return (sum(held[n].numel() for n in split), sum(v.numel() for n, v in held.items()
                                                     if n not in split))


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_holds_a_tth_of_the_split_layers(case):
    make = CASES[case][0]
    whole = make()
    model = make()
    opt = TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
    names = set(opt._pieces)
    assert names, "the plan split nothing"
    split, rest = split_and_whole(model, opt)
    full = dict(whole.named_parameters())
    assert split * SIZE == sum(full[n].numel() for n in names)
    assert rest == sum(p.numel() for n, p in full.items() if n not in names)
    assert {id(p) for g in opt.optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters()}, "the optimizer steps the split parameters"
    opt.close()


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
def test_the_ledger_holds_the_split_layers_collectives_as_megatron_counts_them(sequence):
    """Megatron per block and step (L blocks, activations A = B·S·D·4 bytes): without sequence
    parallelism 2 all-reduces of A forward (after each row split) and 2 backward (the column
    splits' input gradients); with it each all-reduce becomes an all-gather of A/T and a
    reduce-scatter of A, plus the two ends' all-gathers (the final norm's input forward, the
    first block's input gradient backward) and the norms' partial gradients summed."""
    from lowcomm.comm.ledger import wire_bytes
    comm = init().dup(Ledger())
    make, vocab, loss_fn = CASES["tinygpt"]
    model = make()
    opt = TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), comm,
                         sequence=sequence)
    for step in range(2):
        opt.zero_grad()
        opt.forward_backward(loss_fn, batch(step, vocab))
        opt.step()
    L, A, steps = 2, B * T * 32 * 4, 2
    rows = {op: comm.ledger.get(op, comm.level) for op in
            ("allreduce.tp", "allgather.tp", "reduce_scatter.tp")}
    opt.close()
    if not sequence:
        assert rows["allgather.tp"].calls == rows["reduce_scatter.tp"].calls == 0
        r = rows["allreduce.tp"]
        assert r.calls == 4 * L * steps
        assert r.bytes_sent == r.calls * wire_bytes("allreduce", A, SIZE)[0]
    else:
        gather, scatter = rows["allgather.tp"], rows["reduce_scatter.tp"]
        assert gather.calls == (4 * L + 2) * steps
        assert gather.bytes_sent == gather.calls * wire_bytes("allgather", A // SIZE, SIZE)[0]
        assert scatter.calls == 4 * L * steps
        assert scatter.bytes_sent == scatter.calls * wire_bytes("reduce_scatter", A, SIZE)[0]
        norms = rows["allreduce.tp"]          # ln1, ln2 (weight, bias) of each block
        assert norms.calls == 4 * L * steps


def fresh_adamw(make, comm=None, sgd=False):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9) if sgd else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TensorParallel(model, opt, comm)


def steps(opt, loss_fn, vocab, a, b):
    for s in range(a, b):
        opt.zero_grad()
        opt.forward_backward(loss_fn, batch(s, vocab))
        opt.step()


@pytest.mark.parametrize("case", ["tinygpt", "gpt2"])
def test_a_split_resumes_bit_for_bit_from_its_state(case):
    make, vocab, loss_fn = CASES[case]
    assert_resumes_bit_for_bit(lambda: fresh_adamw(make),
                               lambda opt, a, b: steps(opt, loss_fn, vocab, a, b))


def test_a_state_resumes_unsplit_with_the_model_unchanged():
    """TP 2 → 1: both ranks' pieces joined (:meth:`reshard`) are the gathered model bit for bit
    and load into the plain model and optimizer (the optimizer's state by parameter name); two
    more steps there match two more on the pair to float tolerance (SGD with momentum: its
    buffers resumed too). (One process holds one torch.distributed group: the 1-rank split is
    lowcomm train's, tests/test_tensor.py.)"""
    make, vocab, loss_fn = CASES["gpt2"]
    model, opt = fresh_adamw(make, sgd=True)
    steps(opt, loss_fn, vocab, 0, 2)
    old = control(init()).allgather_object({"model": opt.model_state_dict(),
                                            "strategy": opt.state_dict()})
    whole = opt.full_model_state_dict()
    state = opt.reshard(old)
    steps(opt, loss_fn, vocab, 2, 4)
    opt.finish()
    if RANK == 0:
        assert all(torch.equal(state["model"][k], v) for k, v in whole.items())
    alone = make()
    alone.load_state_dict(state["model"])
    plain = torch.optim.SGD(alone.parameters(), lr=0.5, momentum=0.9)
    names = dict(alone.named_parameters())
    saved = state["strategy"]["optimizer"]
    by_name = {n: saved["state"][i] for i, n in enumerate(state["strategy"]["names"])
               if i in saved["state"]}
    plain.load_state_dict({"state": {i: by_name[n] for i, n in enumerate(names)},
                           "param_groups": [{**saved["param_groups"][0],
                                             "params": list(range(len(names)))}]})
    for s in range(2, 4):
        plain.zero_grad()
        loss_fn(alone, batch(s, vocab)).backward()
        plain.step()
    assert_same_model(alone, model)


def test_a_state_of_another_degree_is_refused_naming_it():
    """A piece the size of the whole tensor (a degree-1 split's) does not load on 2 ranks."""
    from lowcomm.parallel.tensor import SplitOf
    make = CASES["tinygpt"][0]
    _, two = fresh_adamw(make)
    whole = make().state_dict()
    one = {k: SplitOf(v, v.shape, two._pieces[k][0], two._pieces[k][1]) if k in two._pieces
           else v for k, v in whole.items()}
    with pytest.raises(LowcommError, match="saved by another split"):
        two.load_model_state_dict(one)
    two.close()


def test_a_degree_that_does_not_divide_the_heads_is_an_error_naming_it():
    torch.manual_seed(0)
    model = TinyGPT(T, 33, 2, 3)
    with pytest.raises(ConfigError, match="heads = 3") as e:
        TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert e.value.key == "strategy.name"


def test_a_model_without_a_built_in_plan_needs_one_and_a_plan_must_name_modules():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="no built-in plan for Sequential"):
        TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
    from lowcomm.parallel.plans import Colwise, Rowwise
    with pytest.raises(ConfigError, match=r"names no module of Sequential: \['9'\]"):
        TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), plan={"9": Colwise()})
    ref = copy.deepcopy(model)
    opt = TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         plan={"0": Colwise(), "2": Rowwise()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(model(x), ref(x), atol=1e-6), "a user's own plan splits exactly"
    opt.finish()


def test_positions_that_the_degree_does_not_divide_are_an_error_under_sequence_parallelism():
    model = tinygpt()
    opt = TensorParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), sequence=True)
    with pytest.raises(LowcommError, match="does not divide them"):
        model(torch.zeros(2, T - 1, dtype=torch.long))
    opt.close()
