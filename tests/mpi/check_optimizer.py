"""Every registered method where a torch optimizer is expected, on 2 ranks: LR schedulers drive
it, the wrapped optimizer cannot be stepped behind its back, clipping sees the gradients it will
apply, AMP's GradScaler skips a step with an Inf (together where the ranks' gradients meet),
gradient accumulation works, a ``with`` block ends it with one model — parameters and BatchNorm
buffers — on every rank; SyncDP's buffers follow torch DDP's ``broadcast_buffers``."""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowcomm
from helpers import every_method
from lowcomm.run.evaluate import state_sha256

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(16, 3))


def batch(step: int, rank: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 6, generator=g) * (1 + rank), torch.randint(0, 3, (n,), generator=g)


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


def by_spec(spec: str, needs: list[str], **kw):
    """A builder on (model, inner optimizer, comm): the spec, on the inner optimizer the
    method needs (``needs``: ``["optimizer.name=X"]``) or the test's SGD."""
    def make(m, o, c):
        if needs:
            from lowcomm.run.optimizers import OPTIMIZERS
            o = OPTIMIZERS[needs[0].partition("=")[2]](m.parameters(), lr=0.01)
        return lowcomm.build(spec, m, o, c, **kw)
    return make


# name -> how to build it on (model, inner optimizer, comm): every registered method at its
# example (helpers.every_method), and the variants and settings these checks need
METHODS = {name: by_spec(spec, needs) for name, (spec, needs) in every_method({
    "syncdp-int8": ("syncdp", []),
    "zero1": ("zero1:qgz=int8", []),
    "horovod": ("syncdp:backend=horovod", []),
    "localsgd": ("localsgd:period=2", []),
    "diloco": ("diloco:period=2,compressor=int8", []),
    "streaming-diloco": ("streaming-diloco:period=4,fragments=2,delay=1,merge=add-local", []),
    "gossip": ("gossip", []),
    "onebit-adam": ("onebit-adam:freeze_step=2", ["optimizer.name=adam"]),
    "zeroone-adam": ("zeroone-adam:var_freeze_step=8,var_update_scaler=2", ["optimizer.name=adam"]),
    "sparta": ("sparta:fraction=0.1", []),
    "sparta-diloco": ("sparta-diloco:period=2,fraction=0.1", []),
    "sparseloco": ("sparseloco:period=2,chunk=8,topk=4", []),
    "muloco-ef2bit": ("muloco-ef2bit:period=2", ["optimizer.name=muon"]),
}).items()}
METHODS["syncdp-int8"] = by_spec("syncdp", [], compressor="int8")
METHODS["async-ps"] = by_spec("async-ps:max_staleness=0", [],
                             context=lowcomm.Context(nonfinite="skip"))
METHODS["policy"] = lambda m, o, c: lowcomm.policy({"dc": "diloco:period=2"}, m, o, c,
                                                   topology="dc:2,rank:1")


def build(name: str, comm, lr: float = 0.1):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    opt = METHODS[name](model, inner, comm)
    return model, opt.optimizer, opt


def run(opt, model, comm, steps=STEPS, *, each=None, scaler=None, inf_at=None, micro=1,
        no_sync=True):
    """The user's loop; ``each(step)`` after every step; ``inf_at``: rank 1's loss is Inf at
    that step; ``micro`` backward passes per step, all but the last under ``opt.no_sync()``
    (unless not ``no_sync``). Server ranks of the parameter server serve."""
    if getattr(opt, "is_server", False):
        opt.serve()
        return
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batch(step, comm.rank, 8 * micro)
        for i in range(micro):
            sl = slice(8 * i, 8 * (i + 1))
            with (opt.no_sync() if no_sync and i < micro - 1 else contextlib.nullcontext()):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                    loss = loss_of(model, x[sl], y[sl]) / micro
                if inf_at == step and comm.rank == 1:
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if each:
            each(step)


def plain(model, params_only: bool = False) -> dict:
    """A copy of the model's state (``params_only``: its parameters) as whole tensors (FSDP's
    sharded DTensors gathered)."""
    state = dict(model.named_parameters()) if params_only else model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


def hashes(comm, model) -> list[str]:
    return comm.allgather_object(state_sha256(model))




@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before")
@pytest.mark.parametrize("name", METHODS)
def test_is_an_optimizer_that_lr_schedulers_drive(name, comm):
    model, inner, opt = build(name, comm)
    assert isinstance(opt, torch.optim.Optimizer)
    assert all(a is b for a, b in zip(opt.param_groups, inner.param_groups))
    for make in (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
                 lambda o: torch.optim.lr_scheduler.OneCycleLR(   # momentum cycled where it has one
                     o, max_lr=0.1, total_steps=20,
                     cycle_momentum=bool({"momentum", "betas"} & set(o.defaults)))):
        ref_opt = torch.optim.SGD(make_model().parameters(), lr=inner.param_groups[0]["lr"])
        ours, ref = make(opt), make(ref_opt)
        for _ in range(3):
            ours.step()
            ref.step()
        assert inner.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    opt.finish()
    # LambdaLR at factor 0 must stop every method's update: the lr reaches what updates
    model, inner, opt = build(name, comm)
    before = plain(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    run(opt, model, comm, each=lambda s: sched.step())
    opt.finish()
    assert inner.param_groups[0]["lr"] == 0.0
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k]), f"{k} moved at lr 0"
    # and at factor 1 they move
    model, inner, opt = build(name, comm)
    before = plain(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run(opt, model, comm, each=lambda s: sched.step())
    opt.finish()
    assert any(not torch.equal(v.detach(), before[k]) for k, v in model.named_parameters())


@pytest.mark.parametrize("name", METHODS)
def test_the_wrapped_optimizer_cannot_step_behind_the_method(name, comm):
    model, inner, opt = build(name, comm)
    with pytest.raises(lowcomm.LowcommError, match=f"wrapped by lowcomm's {type(opt).__name__}"):
        inner.step()
    opt.finish()


@pytest.mark.parametrize("name", [n for n in METHODS if n != "policy"])
def test_clipping_between_backward_and_step_sees_the_gradients_applied(name, comm):
    model, inner, opt = build(name, comm)
    if getattr(opt, "is_server", False):
        opt.serve()
        opt.finish()
        return
    shadow = make_model()                    # the same parameters, no method: local gradients
    shadow.load_state_dict(plain(model))
    x, y = batch(1, comm.rank)
    rng = torch.get_rng_state()                # the same dropout masks in both
    opt.zero_grad()
    loss_of(model, x, y).backward()
    if name in ("zero1", "zero2"):            # no rank holds a whole gradient: torch's clip
        with pytest.raises(lowcomm.LowcommError, match="clip_grad_norm_"):   # is refused, the
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # method's sees all
        norm = float(opt.clip_grad_norm_(float("inf"), norm_type=2.0))
    else:                                     # (fsdp: DTensor gradients, a global norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    torch.set_rng_state(rng)
    loss_of(shadow, x, y).backward()
    local = [p.grad.clone() for p in shadow.parameters()]
    if name in ("syncdp", "horovod", "zero2", "fsdp"):  # the average of the ranks' gradients, on every rank
        every = comm.allgather_object(local)
        mean = [sum(g[i] for g in every) / comm.size for i in range(len(local))]
        want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean])))
        assert norm == pytest.approx(want, rel=1e-5)
        assert len(set(comm.allgather_object(round(norm, 6)))) == 1
    elif name in ("syncdp-int8", "zero1"):    # the average of the int8-coded gradients: near it
        assert len(set(comm.allgather_object(round(norm, 6)))) == 1
    else:                                     # local steps: the local gradients
        want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local])))
        assert norm == pytest.approx(want, rel=1e-5)
    opt.step()
    opt.finish()


@pytest.mark.parametrize("name", METHODS)
def test_grad_scaler_skips_a_step_whose_gradients_are_not_finite(name, comm):
    """Rank 1's loss is Inf at step 2. Where the ranks' gradients meet every step, every rank
    skips that step and halves its scale; elsewhere rank 1 alone skips its update (its inner
    optimizer steps once less) and the method's schedule goes on together."""
    model, inner, opt = build(name, comm)
    # the method's own word: the ranks' gradients meet every step (a policy's is its per-step
    # level's, here one rank per datacenter: the world's ranks do not meet every step)
    lockstep = opt.lockstep and name != "policy"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    inner_steps = [0]
    inner.register_step_post_hook(lambda *_: inner_steps.__setitem__(0, inner_steps[0] + 1))
    seen = {0: (plain(model, True), scaler.get_scale())}

    def each(step):
        seen[step] = (plain(model, True), scaler.get_scale())

    run(opt, model, comm, scaler=scaler, inf_at=2, each=each)
    opt.finish()
    assert len(set(hashes(comm, model))) == 1, "ranks end with different models"
    assert all(math.isfinite(float(v.abs().sum())) for v in model.state_dict().values()
               if v.is_floating_point())
    if getattr(opt, "is_server", False):
        assert opt.server.stats()["skipped"] == [1]
        return
    skipped = comm.rank == 1 or lockstep
    assert seen[2][1] == (seen[1][1] / 2 if skipped else seen[1][1])
    if lockstep:
        for k in seen[1][0]:
            assert torch.equal(seen[1][0][k], seen[2][0][k]), f"{k} moved in a skipped step"
    elif name != "async-ps":                  # a worker's optimizer is stepped by the servers
        assert inner_steps[0] == STEPS - (comm.rank == 1)


@pytest.mark.parametrize("name", METHODS)
def test_gradient_accumulation_under_no_sync(name, comm):
    model, inner, opt = build(name, comm)
    if name == "horovod":
        with pytest.raises(lowcomm.LowcommError, match="backward_passes_per_step"):
            opt.no_sync()
        opt.finish()
        return
    torch.manual_seed(comm.rank)               # dropout: the same masks in the runs below
    run(opt, model, comm, micro=2)
    opt.finish()
    assert len(set(hashes(comm, model))) == 1
    if name != "syncdp":
        return
    # SyncDP: no_sync() over the first of two backward passes, an exchange after each (DDP
    # without no_sync) and backward_passes_per_step=2 all give the same averaged sum
    finals = [model]
    for spec, sync_each in (("syncdp", False), ("syncdp:backward_passes_per_step=2", False)):
        m = make_model()
        o = lowcomm.build(spec, m, torch.optim.SGD(m.parameters(), lr=0.1), comm)
        torch.manual_seed(comm.rank)
        run(o, m, comm, micro=2, no_sync=sync_each)
        o.finish()
        finals.append(m)
    for k, v in model.named_parameters():
        for other in finals[1:]:
            assert torch.allclose(v, dict(other.named_parameters())[k], rtol=1e-5, atol=1e-6), k


def test_syncdp_step_with_a_closure_exchanges_the_accumulated_gradients_once(comm):
    """The last micro-batch's backward inside ``step(closure)`` (Lightning's way) after one
    under ``no_sync()``: one all-reduce per step, as when that backward runs before ``step()``,
    and the same model (before: the step exchanged the first micro-batch's gradients, then the
    closure's backward exchanged again, 2 all-reduces a step)."""
    from lowcomm.comm.ledger import Ledger
    models = []
    for in_closure in (False, True):
        model, c = make_model(), comm.dup(Ledger())
        opt = lowcomm.build("syncdp:algorithm=mpi", model, torch.optim.SGD(model.parameters(), lr=0.1), c)
        torch.manual_seed(comm.rank)                    # dropout: the same masks in both runs
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            x, y = batch(step, comm.rank, 16)
            with opt.no_sync():
                (loss_of(model, x[:8], y[:8]) / 2).backward()

            def last():
                loss = loss_of(model, x[8:], y[8:]) / 2
                loss.backward()
                return loss
            if in_closure:
                opt.step(last)
            else:
                last()
                opt.step()
        opt.finish()
        calls = sum(r["calls"] for r in c.ledger.rows() if r["op"].startswith("allreduce"))
        assert calls == STEPS, (in_closure, c.ledger.rows())
        models.append(model)
    assert state_sha256(models[0]) == state_sha256(models[1])


@pytest.mark.parametrize("name", METHODS)
def test_a_with_block_ends_it_with_one_model_and_moved_buffers(name, comm):
    model = None
    with build(name, comm)[2] as opt:
        model = opt.model
        run(opt, model, comm)
    assert len(set(hashes(comm, model))) == 1, "the ranks' whole states differ"
    bn = model[1]
    assert not torch.equal(bn.running_mean, torch.zeros(16)), "BatchNorm statistics never moved"
    assert int(bn.num_batches_tracked) > 0
    with pytest.raises(lowcomm.LowcommError, match="has ended"):
        opt.step()


def test_syncdp_buffers_follow_torch_ddp_broadcast_buffers(comm):
    from lowcomm.tools.bench import init_gloo
    dist = init_gloo(comm)
    ref = make_model()
    ddp = nn.parallel.DistributedDataParallel(ref, broadcast_buffers=True)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    model = make_model()
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm)
    torch.manual_seed(comm.rank)                # dropout: the same masks in both models
    for step in range(1, STEPS + 1):
        x, y = batch(step, comm.rank)
        state = torch.get_rng_state()
        ref_opt.zero_grad()
        loss_of(ddp, x, y).backward()
        ref_opt.step()
        torch.set_rng_state(state)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    opt.finish()
    assert len(set(hashes(comm, model))) == 1
    # DDP's rank 0 carries its own buffers forward; its other ranks' last forward moved theirs
    want = comm.bcast_object({k: v.clone() for k, v in ref.state_dict().items()})
    for k, v in model.state_dict().items():
        assert torch.allclose(v.float(), want[k].float(), rtol=1e-5, atol=1e-6), k
    dist.barrier()
    dist.destroy_process_group()
