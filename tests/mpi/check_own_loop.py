"""Methods in the user's own loop: what they refuse, and when, on every rank.

* an optimizer holding a tensor that is not a parameter of the model is refused at build; a
  group added later (``add_param_group``) at the next step, naming the parameter; a parameter
  frozen at build and unfrozen later at the first step that sees its gradient, naming it — and
  nothing has diverged: the ranks still hold one model, and a method built anew after
  unfreezing averages it;
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
from helpers import agree, control, train_steps
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import CommError, LowcommError
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


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(model, opt, steps, first=0):
    train_steps(model, opt, batch, steps, first)


def build(spec, model, params=None, comm=None, adam=False):
    params = list(model.parameters()) if params is None else params
    inner = torch.optim.Adam(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.1)
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


SPECS = {"syncdp": "syncdp", "syncdp-int8": "syncdp:compressor=int8", "localsgd": "localsgd:period=2",
         "diloco": "diloco:period=2", "gossip": "gossip", "onebit-adam": "onebit-adam:freeze_step=2",
         "zeroone-adam": "zeroone-adam:var_freeze_step=2", "demo": "demo:topk=4,chunk=8",
         "sparta": "sparta:fraction=0.5", "desloc": "desloc:period=2,period_u=3,period_v=4",
         "noloco": "noloco:period=2"}
ADAM = ("onebit-adam", "zeroone-adam", "desloc")


# parameters the method was not built for ----------------------------------------------------
@pytest.mark.parametrize("name", SPECS)
def test_an_optimizer_tensor_outside_the_model_is_refused_at_build(name, comm):
    model = Net()
    extra = torch.nn.Parameter(torch.zeros(5))
    e = raised(comm, lambda: build(SPECS[name], model, [*model.parameters(), extra], comm,
                                   adam=name in ADAM))
    assert isinstance(e, LowcommError), f"{name}: {e!r}"
    assert "param group 0" in str(e) and "(5,)" in str(e) and "not a parameter of the model" in str(e), e


@pytest.mark.parametrize("name", ["syncdp", "diloco", "gossip", "onebit-adam"])
def test_a_group_added_after_build_is_refused_at_the_next_step_naming_it(name, comm, ctl):
    model = Net()
    opt = build(SPECS[name], model, list(model.a.parameters()), comm, adam=name in ADAM)
    train(model, opt, 2)
    opt.optimizer.add_param_group({"params": list(model.b.parameters())})
    e = raised(comm, lambda: train(model, opt, 1, 2))
    assert isinstance(e, LowcommError) and "'b.weight'" in str(e) and "add_param_group" in str(e), repr(e)
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(7))]})
    e = raised(comm, lambda: opt.step())
    assert isinstance(e, LowcommError) and "shape (7,)" in str(e), repr(e)
    opt.close()


@pytest.mark.parametrize("name", ["syncdp", "syncdp-int8", "diloco", "gossip"])
def test_a_parameter_unfrozen_after_build_is_refused_then_a_new_method_averages_it(name, comm, ctl):
    """Progressive unfreezing: the step that first sees the unfrozen parameter's gradient
    raises, naming it, before anything diverges; finishing the method and building a new one
    after unfreezing trains it on every rank alike."""
    model = Net()
    for p in model.b.parameters():
        p.requires_grad_(False)
    opt = build(SPECS[name], model, None, comm)
    train(model, opt, 2)
    for p in model.b.parameters():
        p.requires_grad_(True)
    e = raised(comm, lambda: train(model, opt, 1, 2))
    assert isinstance(e, LowcommError) and "'b.weight'" in str(e) and "frozen" in str(e), repr(e)
    opt.finish()
    assert one_model(ctl, model), "the ranks differ after the refused step"
    before = model.b.weight.detach().clone()
    opt = build(SPECS[name], model, opt.optimizer.param_groups[0]["params"], comm)
    train(model, opt, 4, 3)
    opt.finish()
    assert not torch.equal(model.b.weight, before), "b did not train (the check can fail)"
    assert one_model(ctl, model), f"{name}: the ranks differ"


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
    e = raised(comm, lambda: build(SPECS[name], Odd(), None, comm, adam=name in ADAM))
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
    e = raised(comm, lambda: build(SPECS[name], model, None, comm, adam=name in ADAM))
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
    """A rejoining datacenter takes a donor's live state (lowcomm.run.member's payload and
    install): rank 0's DiLoCo state, per-rank, is installed on every rank on purpose."""
    from types import SimpleNamespace

    from lowcomm.run.member import install, payload
    model, opt = trained("diloco:period=2", comm, steps=3)
    data = comm.bcast_object(payload(SimpleNamespace(model=model, strategy=opt)), root=0)
    assert raised(comm, lambda: install(SimpleNamespace(model=model, strategy=opt), data, False)) is None
    assert one_model(ctl, model), "every rank holds the donor's model"
    opt.close()
