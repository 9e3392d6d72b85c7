"""PyTorch Lightning under mpirun with lowcomm methods (lowcomm.integrations.lightning, 2 ranks):
``Trainer(strategy=LowcommStrategy(...))`` with gradient accumulation, clipping, bf16 autocast,
an LR scheduler and checkpoints: SyncDP equals one process training on the ranks' batches
together, micro-batches that end no optimizer step exchange nothing, ``bf16-mixed`` with
``gradient_clip_val`` clips, a resume from a checkpoint is exact and every rank ends with the
same model."""
import glob
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_models_close, control, seeded_mlp, sent, toy_dataset
from lowcomm.comm.ledger import Ledger
from lowcomm.errors import LowcommError
from lowcomm.integrations.lightning import LowcommStrategy
from lowcomm.run.evaluate import state_sha256

BATCH, ACCUM, STEPS, CLIP, LR = 4, 2, 4, 0.2, 0.1


class Classifier(L.LightningModule):
    """The toy MLP as a LightningModule; records the gradient norm each clipping leaves."""

    def __init__(self, optimizer: str = "sgd"):
        super().__init__()
        self.net = seeded_mlp(10, 16, 3)
        self.optimizer, self.clipped, self.seen = optimizer, [], []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen.append(i.tolist())
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR) if self.optimizer == "sgd" else \
            torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped.append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in self.parameters() if p.grad is not None])))


class Watch(L.Callback):
    """Bytes the method sends in each micro-batch (and whether it ended a step), and each
    rank's model when training ends, before the method ends."""

    def __init__(self, ledger):
        self.ledger, self.traffic, self.before, self.local = ledger, [], 0, None

    def on_train_start(self, trainer, module):
        self.ledger.reset()                     # (the method's build exchanged once)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = sent(self.ledger)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.traffic.append(((batch_idx + 1) % ACCUM == 0, sent(self.ledger) - self.before))

    def on_train_end(self, trainer, module):
        self.local = state_sha256(module)


class Points(torch.utils.data.Dataset):
    """The first ``n`` toy points, each with its index (to see which rank trained on which)."""

    def __init__(self, n: int):
        self.X, self.Y = toy_dataset()[:n]

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], self.Y[i], i


def loader(n: int):
    return torch.utils.data.DataLoader(Points(n), batch_size=BATCH)


def trainer(strategy, watch=None, **kwargs):
    args = dict(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUM,
                gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                callbacks=[watch] if watch else [])
    return L.Trainer(strategy=strategy, **{**args, **kwargs})


@pytest.mark.parametrize("precision,atol", [("32-true", 1e-6), ("16-mixed", 2e-3)])
def test_syncdp_is_one_process_on_the_ranks_batches_and_exchanges_once_per_step(precision, atol, comm):
    """SyncDP, 2 micro-batches per step, clipping at 0.2 and a per-step scheduler: the ranks
    train on disjoint shares of the data (Lightning's DistributedSampler), every rank's model
    equals one process training on the 16 points the ranks' micro-batches of each step hold
    together, and the method's ledger shows one all-reduce of the gradients per optimizer step,
    none on the other micro-batches. Under ``16-mixed`` (a GradScaler) the gradients are unscaled
    once, before clipping: the model is the fp32 one's to fp16's precision (clipping the scaled
    gradients, or unscaling twice, would leave the updates 65536 times too small)."""
    method_comm = comm.dup(Ledger())
    strategy = LowcommStrategy("syncdp:algorithm=mpi", comm=method_comm)
    module, watch = Classifier(), Watch(method_comm.ledger)
    n = STEPS * ACCUM * BATCH * comm.size
    # Lightning makes "16-mixed" bf16 on a CPU: its fp16 plugin with a GradScaler, given as is
    amp = {"plugins": [L.pytorch.plugins.MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]} \
        if precision == "16-mixed" else {"precision": precision}
    t = trainer(strategy, watch, **amp)
    assert (t.global_rank, t.world_size, t.is_global_zero) == (comm.rank, comm.size, comm.rank == 0)
    t.fit(module, loader(n))
    if precision == "16-mixed":       # the scaler did scale (and stepped through the method)
        assert t.precision_plugin.scaler.get_scale() >= 2.0 ** 16 and t.precision_plugin.precision == "16-mixed"
    assert [s for s, _ in watch.traffic] == [False, True] * STEPS
    assert all(b == 0 for s, b in watch.traffic if not s), watch.traffic
    calls = sum(r["calls"] for r in method_comm.ledger.rows() if r["op"].startswith("allreduce"))
    votes = STEPS if precision == "16-mixed" else 0     # a GradScaler's skip, agreed: 4 bytes a step
    assert calls == STEPS + votes, method_comm.ledger.rows()
    assert len(module.clipped) == STEPS and max(module.clipped) <= CLIP * (1 + 1e-5), module.clipped

    ref = seeded_mlp(10, 16, 3)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + 0.1 * t))
    seen = control(comm).allgather_object(module.seen)     # [rank][micro-batch][point]
    assert sorted(i for rank in seen for b in rank for i in b) == list(range(n))
    X, Y = toy_dataset()[:n]
    for s in range(STEPS):
        mine = [i for rank in seen for b in rank[s * ACCUM:(s + 1) * ACCUM] for i in b]
        opt.zero_grad()
        F.cross_entropy(ref(X[mine]), Y[mine]).backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP) > CLIP   # clipping acts
        opt.step()
        sched.step()
    assert_models_close(module.net, ref, f"SyncDP under Lightning ({precision}) against one process",
                        atol=atol)


@pytest.mark.parametrize("spec,compressor", [("diloco:period=3", None), ("syncdp", "int8"),
                                             ("syncdp", "powersgd")])
def test_methods_train_under_bf16_mixed_with_clipping_and_end_with_one_model(spec, compressor, comm):
    """``precision="bf16-mixed"`` with ``gradient_clip_val`` (Lightning refused to clip for a
    lowcomm method: "does not allow for gradient clipping"): the gradients are clipped, no
    traffic on micro-batches that end no step, and after ``fit`` the same model on every rank
    (DiLoCo's local models differ before: the check is not void)."""
    ctl = control(comm)
    method_comm = comm.dup(Ledger())
    module, watch = Classifier("adamw"), Watch(method_comm.ledger)
    trainer(LowcommStrategy(spec, compressor=compressor, comm=method_comm), watch,
            precision="bf16-mixed").fit(module, loader(STEPS * ACCUM * BATCH * comm.size))
    assert len(module.clipped) == STEPS and max(module.clipped) <= CLIP * (1 + 1e-3), module.clipped
    assert all(b == 0 for s, b in watch.traffic if not s) and sum(b for _, b in watch.traffic) > 0, \
        watch.traffic
    if spec.startswith("diloco"):       # 4 steps of period 3: one step past the last outer step
        assert len(set(ctl.allgather_object(watch.local))) == comm.size
    assert len(set(ctl.allgather_object(state_sha256(module)))) == 1, "the ranks' models differ"


@pytest.mark.parametrize("spec", ["diloco:period=3", "syncdp:compressor=int8"])
def test_fit_from_a_checkpoint_resumes_exactly(spec, comm, tmp_path_factory):
    """Checkpoints at each epoch's end (2 steps an epoch; mid-period under DiLoCo, where the
    ranks' local models differ, and error feedback under int8): ``fit(ckpt_path=...)`` from the
    first one ends with each rank's model bit-identical to the uninterrupted run's, before and
    after the method ends."""
    ctl = control(comm)
    folder = ctl.bcast_object(str(tmp_path_factory.mktemp("lightning")))
    n = (STEPS // 2) * ACCUM * BATCH * comm.size            # an epoch: 2 optimizer steps

    def run(ckpt=None):
        module, watch = Classifier("adamw"), Watch(Ledger())
        save = L.pytorch.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1,
                                                   filename="{epoch}")
        t = trainer(LowcommStrategy(spec, comm=comm), watch, max_steps=-1, max_epochs=2,
                    enable_checkpointing=True, callbacks=[watch, save])
        t.fit(module, loader(n), ckpt_path=ckpt)
        return watch.local, state_sha256(module)

    whole = run()
    first = f"{folder}/epoch=0.ckpt"
    mine = f"{first}.lowcomm-rank{comm.rank}-of-{comm.size}.pt"
    assert os.path.isfile(first) and os.path.isfile(mine), glob.glob(f"{folder}/*")
    if spec.startswith("diloco"):
        saved = torch.load(mine, weights_only=False)["state_dict"]["net.a.weight"]
        assert len(set(ctl.allgather_object(saved.numpy().tobytes()))) == comm.size, \
            "the local models at the checkpoint agree: the check is void"
    assert run(first) == whole, "the resumed run ends with another model"


def test_two_optimizers_and_a_wrong_spec_are_refused(comm):
    with pytest.raises(Exception, match="unknown|known"):
        LowcommStrategy("no-such-method", comm=comm)

    class Two(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False     # (Lightning's rule for several optimizers)

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net.a.parameters(), lr=LR),
                    torch.optim.SGD(self.net.b.parameters(), lr=LR)]

        def training_step(self, batch, batch_idx):
            return None
    with pytest.raises(LowcommError, match="one optimizer"):
        trainer(LowcommStrategy("syncdp", comm=comm), gradient_clip_val=None,
                accumulate_grad_batches=1).fit(Two(), loader(64))
