"""accelerate under mpirun with lowcomm methods (lowcomm.integrations.accelerate, 2 ranks): a
script written for accelerate (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``,
``save_state``/``load_state``) trains as under ``accelerate launch``: SyncDP equals one process
training on the ranks' batches together, micro-batches that end no optimizer step exchange
nothing, bf16 autocast with clipping works, a checkpoint resumes exactly and every rank ends
with the same model."""
import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState

from helpers import assert_models_close, control, seeded_mlp, sent, toy_dataset
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import LowcommError
from lowcomm.integrations.accelerate import Accelerator
from lowcomm.run.evaluate import state_sha256

BATCH, ACCUM, STEPS, CLIP, LR = 4, 2, 4, 0.2, 0.1


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each case builds its Accelerator as a fresh process would (accelerate keeps one state
    per process, and the cases use different precisions)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def loader(n: int):
    """The first ``n`` toy points in order (accelerate's prepare shards them over the ranks)."""
    return torch.utils.data.DataLoader(torch.utils.data.Subset(toy_dataset(), range(n)),
                                       batch_size=BATCH)


def train(accelerator, model, opt, data, sched=None, first: int = 0, stop: int = STEPS,
          ledger=None):
    """The user's accelerate loop: optimizer steps ``first`` .. ``stop``-1, each of ``ACCUM``
    micro-batches, clipped at ``CLIP``; returns the losses and, given the method's ``ledger``,
    (whether it ended a step, bytes sent) of each micro-batch."""
    losses, traffic = [], []
    batches = iter(accelerator.skip_first_batches(data, first * ACCUM) if first else data)
    for _ in range((stop - first) * ACCUM):
        x, y = next(batches)
        with accelerator.accumulate(model):
            before = sent(ledger) if ledger is not None else 0
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                assert torch.isfinite(norm)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
            if ledger is not None:
                traffic.append((accelerator.sync_gradients, sent(ledger) - before))
            losses.append(loss.item())
    return losses, traffic


def test_syncdp_under_accumulate_is_one_process_on_the_ranks_batches_and_exchanges_once_per_step(comm):
    """SyncDP with 2 micro-batches per step, clipping and a scheduler: every rank's model equals
    one process training on the 16 points the ranks' micro-batches hold together (accelerate's
    sharding: rank r takes every K-th batch), with the scheduler stepped K times per step as
    accelerate does in a K-process job; the method's ledger shows one all-reduce of the
    gradients per optimizer step (4, not one per micro-batch: 8)."""
    method_comm = comm.dup(Ledger())              # the method's traffic alone
    accelerator = Accelerator(method="syncdp:algorithm=mpi", comm=method_comm,
                              gradient_accumulation_steps=ACCUM, cpu=True)
    assert (accelerator.process_index, accelerator.num_processes) == (comm.rank, comm.size)
    assert accelerator.is_main_process == (comm.rank == 0)
    model = seeded_mlp(10, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t))
    n = STEPS * ACCUM * BATCH * comm.size
    model, opt, data, sched = accelerator.prepare(model, opt, loader(n), sched)
    method_comm.ledger.reset()
    _, traffic = train(accelerator, model, opt, data, sched, ledger=method_comm.ledger)
    accelerator.finish()
    assert [s for s, _ in traffic] == [False, True] * STEPS
    assert all(b == 0 for s, b in traffic if not s), f"a micro-batch without a step exchanged: {traffic}"
    numel = sum(p.numel() for p in model.parameters())
    calls = sum(r["calls"] for r in method_comm.ledger.rows() if r["op"].startswith("allreduce"))
    assert calls == STEPS, method_comm.ledger.rows()
    per_step = [b for s, b in traffic if s]        # each: the gradients' all-reduce (bucket-padded)
    assert len(set(per_step)) == 1 and per_step[0] >= 4 * numel * 2 * (comm.size - 1) // comm.size, traffic

    ref = seeded_mlp(10, 16, 3)                   # one process, the ranks' 16 points per step
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda t: 1 / (1 + 0.1 * t))
    X, Y = next(iter(torch.utils.data.DataLoader(torch.utils.data.Subset(toy_dataset(), range(n)),
                                                 batch_size=n)))
    per_step = n // STEPS
    for s in range(STEPS):
        ref_opt.zero_grad()
        F.cross_entropy(ref(X[s * per_step:(s + 1) * per_step]),
                        Y[s * per_step:(s + 1) * per_step]).backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP) > CLIP   # clipping acts
        ref_opt.step()
        for _ in range(comm.size):
            ref_sched.step()
    assert_models_close(model, ref, "SyncDP under accelerate against one process")
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])


@pytest.mark.parametrize("spec,compressor", [("diloco:period=3", None), ("syncdp", "int8"),
                                             ("syncdp", "powersgd")])
def test_methods_train_under_bf16_with_clipping_and_end_with_one_model(spec, compressor, comm):
    """bf16 autocast, clipping, 2 micro-batches per step: finite losses, no traffic on a
    micro-batch that ends no step, and after ``end_training()`` the same model on every rank
    (DiLoCo's local models differ before: the check is not void)."""
    ctl = control(comm)
    method_comm = comm.dup(Ledger())
    accelerator = Accelerator(method=spec, compressor=compressor, comm=method_comm,
                              mixed_precision="bf16", gradient_accumulation_steps=ACCUM, cpu=True)
    model = seeded_mlp(10, 16, 3)
    model, opt, data = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                           loader(STEPS * ACCUM * BATCH * comm.size))
    losses, traffic = train(accelerator, model, opt, data, ledger=method_comm.ledger)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(b == 0 for s, b in traffic if not s), traffic
    assert sum(b for _, b in traffic) > 0, "the method sent nothing"
    mine = state_sha256(model)
    if spec.startswith("diloco"):       # 4 steps of period 3: one step past the last outer step
        assert len(set(ctl.allgather_object(mine))) == comm.size
    accelerator.end_training()
    assert len(set(ctl.allgather_object(state_sha256(model)))) == 1, "the ranks' models differ"


@pytest.mark.parametrize("spec", ["diloco:period=3", "syncdp"])
def test_save_state_and_load_state_resume_exactly(spec, comm, tmp_path_factory):
    """``save_state`` after step 2 (mid-period under DiLoCo: the ranks' local models differ),
    then a new Accelerator, model and optimizer ``load_state`` it and train on: each rank's model
    is bit-identical to the uninterrupted run's, before and after ``finish()``."""
    ctl = control(comm)
    folder = ctl.bcast_object(str(tmp_path_factory.mktemp("acc")))
    n = STEPS * ACCUM * BATCH * comm.size

    def run(resume: str | None):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(method=spec, comm=comm, gradient_accumulation_steps=ACCUM, cpu=True)
        model = seeded_mlp(10, 16, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t))
        model, opt, data, sched = accelerator.prepare(model, opt, loader(n), sched)
        if resume is None:
            train(accelerator, model, opt, data, sched, stop=2)
            assert str(accelerator.save_state(f"{folder}/ckpt")) == f"{folder}/ckpt"
            train(accelerator, model, opt, data, sched, first=2)
        else:
            accelerator.load_state(resume)
            train(accelerator, model, opt, data, sched, first=2)
        local = state_sha256(model)
        accelerator.finish()
        return local, state_sha256(model)

    whole = run(None)
    if spec.startswith("diloco"):
        saved = torch.load(f"{folder}/ckpt/lowcomm-rank{comm.rank}-of-{comm.size}.pt",
                           weights_only=False)["models"][0]
        digests = ctl.allgather_object(saved["a.weight"].numpy().tobytes())
        assert len(set(digests)) == comm.size, "the local models at step 2 agree: the check is void"
    assert run(f"{folder}/ckpt") == whole, "the resumed run ends with another model"


def test_a_shuffling_loader_gives_the_ranks_disjoint_shares_of_each_epoch(comm):
    """Ranks seeded differently (as unseeded processes are) still draw one permutation per
    epoch (accelerate gives the sampler a generator of its own, the same on every rank): their
    shares are disjoint and cover the data, and the order changes between epochs."""
    ctl = control(comm)
    torch.manual_seed(1000 + comm.rank)
    accelerator = Accelerator(method="syncdp", comm=comm, cpu=True)
    model = seeded_mlp(10, 16, 3)
    indices = torch.utils.data.TensorDataset(torch.arange(64))
    _, _, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.utils.data.DataLoader(indices, batch_size=4, shuffle=True))
    epochs = [[int(i) for (b,) in data for i in b] for _ in range(2)]
    accelerator.finish()
    every = ctl.allgather_object(epochs)          # [rank][epoch][index]
    for e in range(2):
        assert sorted(i for rank in every for i in rank[e]) == list(range(64)), every
    assert every[0][0] != every[0][1] and every[0][0] != sorted(every[0][0]), "not shuffled"


def test_a_plain_optimizer_without_a_method_and_the_parameter_server_are_refused(comm):
    accelerator = Accelerator(comm=comm, cpu=True)
    model = seeded_mlp(10, 16, 3)
    with pytest.raises(LowcommError, match="every rank would train alone"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(method="async-ps", comm=comm, cpu=True)
    with pytest.raises(LowcommError, match="server ranks serve"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
