"""Methods in the user's own loop: what they refuse, and when, on every rank.

* an optimizer holding a tensor that is not a parameter of the model is refused at build; a
  group added later (``add_param_group``) at the next step, naming the parameter;
* progressive unfreezing: a parameter frozen at build and unfrozen later is left alone while
  frozen and trained from then on, one model on every rank — under syncdp (sending nothing for
  it while frozen) and localsgd at period 1 equal to single-process training on the ranks'
  whole batch; a method that does not take it in (onebit-adam, zeroone-adam, demo, ZeRO)
  refuses it, naming it;
* a parameter of the same element count but another shape on one rank is refused at build by
  every method (before: gossip, onebit-adam and zeroone-adam accepted it silently);
* ``load_state_dict`` refuses another method's state, or other settings, naming both; a method
  whose state differs between ranks refuses another rank's state (torch DDP's habit, rank 0
  saves and every rank loads) and accepts it through ``lowcomm.adopt``; a replicated one
  accepts it;
* a sparse-gradient embedding under a method that exchanges dense gradients, a second method on
  a wrapped optimizer, and a model cast after build are clear errors naming their cause.
"""
import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import agree, assert_models_close, control, every_method, sent, train_steps
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import CommError, LowcommError
from lowcomm.run.optimizers import OPTIMIZERS
from under_mpi import RANK

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def ctl(comm):
    return control(comm)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(step, rank=None):
    g = torch.Generator().manual_seed(1000 * step + (RANK if rank is None else rank))
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(model, opt, steps, first=0):
    train_steps(model, opt, batch, steps, first)


def build(spec, model, params=None, comm=None, needs=""):
    params = list(model.parameters()) if params is None else params
    inner = OPTIMIZERS[needs](params, lr=0.01) if needs else torch.optim.SGD(params, lr=0.1)
    return lowcomm.build(spec, model, inner, comm.dup(Ledger()))


def raised(comm, fn):
    """The exception ``fn()`` raised (None if none), after every rank got there."""
    try:
        fn()
        out = None
    except Exception as e:     # noqa: BLE001 - the checks look at it
        out = e
    comm.barrier()
    return out


def one_model(ctl, model) -> bool:
    return all(agree(ctl, t) for t in model.state_dict().values())


#: every registered method at its example (helpers.every_method), and the settings these checks
#: train with
SPECS = {name: spec for name, (spec, _) in every_method({
    "syncdp-int8": ("syncdp:compressor=int8", []), "localsgd": ("localsgd:period=2", []),
    "diloco": ("diloco:period=2", []), "gossip": ("gossip", []),
    "onebit-adam": ("onebit-adam:freeze_step=2", []),
    "zeroone-adam": ("zeroone-adam:var_freeze_step=2", []), "sparta": ("sparta:fraction=0.5", [])}).items()}
#: the inner optimizer each method needs (its registry entry's), else SGD
NEEDS = {name: m.optimizer for name, m in lowcomm.STRATEGIES.items()}


# parameters the method was not built for ----------------------------------------------------
@pytest.mark.parametrize("name", SPECS)
def test_an_optimizer_tensor_outside_the_model_is_refused_at_build(name, comm):
    model = Net()
    extra = torch.nn.Parameter(torch.zeros(5))
    e = raised(comm, lambda: build(SPECS[name], model, [*model.parameters(), extra], comm,
                                   needs=NEEDS.get(name, "")))
    assert isinstance(e, LowcommError), f"{name}: {e!r}"
    group = 1 if NEEDS.get(name) == "muon" else 0      # MuonAdamW steps 1-D tensors in its AdamW group
    assert f"param group {group}" in str(e) and "(5,)" in str(e) and "not a parameter of the model" in str(e), e


@pytest.mark.parametrize("name", ["syncdp", "diloco", "gossip", "onebit-adam"])
def test_a_group_added_after_build_is_refused_at_the_next_step_naming_it(name, comm, ctl):
    model = Net()
    opt = build(SPECS[name], model, list(model.a.parameters()), comm, needs=NEEDS.get(name, ""))
    train(model, opt, 2)
    opt.optimizer.add_param_group({"params": list(model.b.parameters())})
    e = raised(comm, lambda: train(model, opt, 1, 2))
    assert isinstance(e, LowcommError) and "'b.weight'" in str(e) and "add_param_group" in str(e), repr(e)
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(7))]})
    e = raised(comm, lambda: opt.step())
    assert isinstance(e, LowcommError) and "shape (7,)" in str(e), repr(e)
    opt.close()


UNFREEZING = {**{n: SPECS[n] for n in ("syncdp", "syncdp-int8", "localsgd", "diloco", "gossip",
                                        "sparta")},
              "syncdp-unoverlapped": "syncdp:overlap=false", "localsgd-1": "localsgd:period=1",
              "streaming-diloco": "streaming-diloco:period=2,fragments=2",
              "sparta-diloco": "sparta-diloco:period=2,fraction=0.5"}
#: methods equal to single-process SGD on the ranks' whole batch (plain SGD)
EXACT = ("syncdp", "syncdp-unoverlapped", "localsgd-1")


def frozen_b() -> Net:
    model = Net()
    for p in model.b.parameters():
        p.requires_grad_(False)
    return model


def whole_batch_reference(world: int, frozen_steps: int, steps: int) -> Net:
    """One process, plain SGD on every rank's batch at once, ``b`` unfrozen after
    ``frozen_steps``."""
    model = frozen_b()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if step == frozen_steps:
            for p in model.b.parameters():
                p.requires_grad_(True)
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model


@pytest.mark.parametrize("name", UNFREEZING)
def test_a_parameter_unfrozen_after_build_is_trained_from_then_on_on_every_rank(name, comm, ctl):
    """Progressive unfreezing: ``b`` frozen at build stays where it is, then, unfrozen, trains
    on every rank alike (as single-process SGD on the whole batch where the method equals it)."""
    model = frozen_b()
    before = model.b.weight.detach().clone()
    opt = build(UNFREEZING[name], model, None, comm)
    train(model, opt, 2)
    assert torch.equal(model.b.weight, before), f"{name}: the frozen parameter moved"
    for p in model.b.parameters():
        p.requires_grad_(True)
    train(model, opt, 4, 2)
    opt.finish()
    assert not torch.equal(model.b.weight, before), f"{name}: b did not train after unfreezing"
    assert one_model(ctl, model), f"{name}: the ranks differ"
    if name in EXACT:
        assert_models_close(model, whole_batch_reference(comm.size, 2, 6), name)


def test_syncdp_sends_nothing_for_a_frozen_parameter_until_it_is_unfrozen(comm):
    """While ``b`` is frozen, a step costs what it costs without ``b`` in the optimizer at all,
    plus one 4-byte agreement per frozen bucket; unfrozen, ``b``'s gradient is sent too."""
    def step_bytes(model, params, steps, first=0):
        opt = build("syncdp:algorithm=ring", model, params, comm)
        ledger = opt.comm.ledger
        train(model, opt, 1, first)          # the first step (set-up traffic) is not counted
        b0 = sent(ledger)
        train(model, opt, steps, first + 1)
        per_step = (sent(ledger) - b0) / steps
        return opt, per_step
    alone = frozen_b()
    opt, without = step_bytes(alone, list(alone.a.parameters()), 2)
    opt.finish()
    model = frozen_b()
    opt, frozen = step_bytes(model, None, 2)
    assert without < frozen <= without + 16, (without, frozen)
    for p in model.b.parameters():
        p.requires_grad_(True)
    b0 = sent(opt.comm.ledger)
    train(model, opt, 2, 3)
    unfrozen = (sent(opt.comm.ledger) - b0) / 2
    opt.finish()
    b_bytes = sum(p.numel() * 4 for p in model.b.parameters())
    assert unfrozen >= frozen + b_bytes * (comm.size - 1) / comm.size, (frozen, unfrozen)


@pytest.mark.parametrize("name", ["onebit-adam", "zeroone-adam", "demo", "zero2"])
def test_a_method_that_does_not_take_unfrozen_parameters_in_refuses_them_naming_one(name, comm, ctl):
    """The Adam-like compressed methods and ZeRO (whose shards are cut at build) exchange the
    parameters that trained at build: the step that first sees the unfrozen one's gradient raises, naming it,
    before anything diverges."""
    model = frozen_b()
    opt = build(SPECS.get(name, name), model, None, comm, needs=NEEDS.get(name, ""))
    train(model, opt, 2)
    for p in model.b.parameters():
        p.requires_grad_(True)
    e = raised(comm, lambda: train(model, opt, 1, 2))
    assert isinstance(e, LowcommError) and "'b.weight'" in str(e) and "frozen" in str(e), repr(e)
    opt.finish()
    assert one_model(ctl, model), "the ranks differ after the refused step"


# layouts that differ between ranks ----------------------------------------------------------
class Odd(torch.nn.Module):
    """A weight of 12 elements, (3, 4) on rank 0 and (4, 3) elsewhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 4) if RANK == 0 else torch.randn(4, 3))

    def forward(self, x):
        return x @ self.w.reshape(3, 4)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_same_size_in_another_shape_on_one_rank_is_refused_at_build(name, comm):
    e = raised(comm, lambda: build(SPECS[name], Odd(), None, comm, needs=NEEDS.get(name, "")))
    assert isinstance(e, CommError), f"{name}: {e!r}"
    assert "differently named or shaped" in str(e) and "ranks [1" in str(e), str(e)


# state from another method, settings or rank ------------------------------------------------
def trained(spec, comm, steps=2):
    model = Net()
    opt = build(spec, model, None, comm)
    train(model, opt, steps)
    return model, opt


def test_another_methods_state_is_refused_naming_both(comm):
    _, diloco = trained("diloco:period=2", comm)
    state = diloco.state_dict()
    for spec in ("syncdp", "streaming-diloco:period=2,fragments=2"):
        _, other = trained(spec, comm)
        e = raised(comm, lambda: other.load_state_dict(state))
        assert isinstance(e, LowcommError), f"{spec}: {e!r}"
        assert "saved by diloco" in str(e) and f"this method is {other.name}" in str(e), str(e)
        other.close()
    _, longer = trained("diloco:period=4", comm)
    e = raised(comm, lambda: longer.load_state_dict(state))
    assert isinstance(e, LowcommError) and "period=2" in str(e) and "period=4" in str(e), repr(e)
    longer.close()
    diloco.close()


@pytest.mark.parametrize("spec", ["diloco:period=2", "gossip", "syncdp:compressor=ef-sign"])
def test_a_per_rank_state_is_refused_on_another_rank_and_adopted_on_purpose(spec, comm, ctl):
    """torch DDP's habit (rank 0 saves, every rank loads) would resume DiLoCo, gossip and
    EF-sign inexactly: another rank's state is refused; each rank's own state is accepted; and
    lowcomm.adopt() takes another rank's on purpose."""
    _, opt = trained(spec, comm)
    mine = opt.state_dict()
    zero = comm.bcast_object(mine, root=0)
    e = raised(comm, lambda: opt.load_state_dict(zero))
    if RANK == 0:
        assert e is None, repr(e)
    else:
        assert isinstance(e, LowcommError) and "rank 0 of" in str(e) and f"rank {RANK} of" in str(e), repr(e)
    assert raised(comm, lambda: opt.load_state_dict(mine)) is None
    assert raised(comm, lambda: opt.load_state_dict(lowcomm.adopt(zero))) is None
    opt.close()


def test_a_replicated_state_loads_on_every_rank(comm):
    _, opt = trained("syncdp", comm)
    zero = comm.bcast_object(opt.state_dict(), root=0)
    assert raised(comm, lambda: opt.load_state_dict(zero)) is None
    opt.close()


# clear errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["syncdp", "demo", "onebit-adam"])
def test_a_sparse_gradient_embedding_is_refused_naming_it(name, comm):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
    e = raised(comm, lambda: build(SPECS[name], model, None, comm, needs=NEEDS.get(name, "")))
    assert isinstance(e, LowcommError), repr(e)
    assert "'0.weight'" in str(e) and "sparse gradients" in str(e) and name in str(e), str(e)


def test_a_second_method_on_a_wrapped_optimizer_is_refused_at_build(comm, ctl):
    model = Net()
    first = build("syncdp", model, None, comm)
    e = raised(comm, lambda: lowcomm.build("diloco:period=2", model, first.optimizer, comm.dup(Ledger())))
    assert isinstance(e, LowcommError) and "wrapped by lowcomm's SyncDP" in str(e), repr(e)
    train(model, first, 2)                   # the first one still works
    first.finish()
    second = lowcomm.build("diloco:period=2", model, first.optimizer, comm.dup(Ledger()))
    train(model, second, 2)
    second.finish()
    assert one_model(ctl, model)


@pytest.mark.parametrize("name", ["syncdp", "syncdp-int8"])
def test_a_model_cast_after_build_is_a_clear_error(name, comm):
    model = Net()
    opt = build(SPECS[name], model, None, comm)
    model.to(torch.bfloat16)

    def step():
        x, y = batch(0)
        opt.zero_grad()
        F.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        opt.step()
    e = raised(comm, step)
    assert isinstance(e, LowcommError) and "'a.weight'" in str(e) and "bfloat16" in str(e) and \
        "after lowcomm's syncdp was built" in str(e), repr(e)
    opt.close()


def test_a_build_that_fails_leaves_the_optimizer_free_for_another_method(comm, ctl):
    """1-bit Adam refuses SGD after the base class guarded and claimed the optimizer: the
    failed build leaves neither behind, so SyncDP builds on it and steps."""
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    e = raised(comm, lambda: lowcomm.build("onebit-adam", model, inner, comm.dup(Ledger())))
    assert isinstance(e, TypeError) and "Adam" in str(e), repr(e)
    opt = lowcomm.build("syncdp", model, inner, comm.dup(Ledger()))
    train(model, opt, 2)
    opt.finish()
    assert one_model(ctl, model)


def test_a_fleet_donors_state_installs_on_another_rank(comm, ctl):
    """A rejoining datacenter takes a donor's live state (lowcomm.run.fleet.member's payload and
    install): rank 0's DiLoCo state, per-rank, is installed on every rank on purpose."""
    from types import SimpleNamespace

    from lowcomm.run.fleet.member import install, payload
    model, opt = trained("diloco:period=2", comm, steps=3)
    data = comm.bcast_object(payload(SimpleNamespace(model=model, strategy=opt)), root=0)
    assert raised(comm, lambda: install(SimpleNamespace(model=model, strategy=opt), data, False)) is None
    assert one_model(ctl, model), "every rank holds the donor's model"
    opt.close()
