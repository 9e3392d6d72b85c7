"""The Hugging Face Trainer under mpirun with lowcomm methods (2 ranks): a transformers GPT-2
built from a config, trained by ``lowcomm.integrations.transformers.Trainer`` with the Trainer's
own cosine schedule with warm-up, gradient clipping, gradient accumulation, evaluation and
logging; every rank must end with the same model and finite losses."""
import math
from pathlib import Path

import pytest
import torch

import lowcomm
from lowcomm.integrations import transformers as lt
from lowcomm.run.evaluate import state_sha256

transformers = pytest.importorskip("transformers")

SEQ = 32


class Windows(torch.utils.data.Dataset):
    """Windows of real text's bytes (the licences every Debian machine ships) as LM examples."""

    def __init__(self, text: bytes, n: int, offset: int = 0):
        data = torch.tensor(list(text[offset:offset + n * SEQ]), dtype=torch.long)
        self.x = data.view(n, SEQ)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def text() -> bytes:
    from pathlib import Path
    files = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    return b"".join(f.read_bytes() for f in files)[:200_000]


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0))


@pytest.mark.parametrize("spec,compressor", [("syncdp", None), ("diloco:period=2", None),
                                             ("syncdp", "int8"), ("async-ps", None),
                                             ("zero2", None)])
def test_trainer_trains_gpt2_under_a_method(spec, compressor, comm, tmp_path_factory):
    train_gpt2(spec, compressor, comm, tmp_path_factory)


def train_gpt2(spec, compressor, comm, tmp_path_factory):
    """The Trainer on a small GPT-2 under ``spec``, checked; returns (trainer, final eval, model)."""
    lt.init(comm)
    out = comm.bcast_object(str(tmp_path_factory.mktemp("trainer")))
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=5e-3, lr_scheduler_type="cosine",
        warmup_steps=2, max_grad_norm=0.5, logging_steps=2, eval_strategy="steps", eval_steps=3,
        save_strategy="no", report_to="none", use_cpu=True, seed=1, disable_tqdm=True)
    model = gpt2()
    inner = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    method = lowcomm.build(spec, model, inner, comm, compressor=compressor)
    corpus = text()
    trainer = lt.Trainer(model=model, args=args, train_dataset=Windows(corpus, 96),
                         eval_dataset=Windows(corpus, 16, offset=100_000),
                         optimizers=(method, None))
    result = trainer.train()
    hashes = comm.allgather_object(state_sha256(model))
    assert len(set(hashes)) == 1, "the ranks end with different models"
    if getattr(method, "is_server", False):
        return
    assert result.global_step == 6 and math.isfinite(result.training_loss)
    logs = trainer.state.log_history
    losses = [e["loss"] for e in logs if "loss" in e]
    evals = [e["eval_loss"] for e in logs if "eval_loss" in e]
    if trainer._first:               # the first training rank logs
        assert losses and all(math.isfinite(v) for v in losses), logs
        assert evals and all(math.isfinite(v) for v in evals), logs
        assert any("grad_norm" in e for e in logs), logs
    # the Trainer's cosine schedule drove the inner optimizer: it decays to 0 at max_steps
    assert inner.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)
    # evaluation metrics are averaged over the training ranks: the same number everywhere
    if hasattr(method, "is_server"):
        return
    e = trainer.evaluate()
    assert len(set(comm.allgather_object(round(e["eval_loss"], 6)))) == 1
    return trainer, e, model


SHARDED = ("zero1", "zero2", "fsdp:wrap=GPT2Block")


def test_sharded_methods_train_gpt2_under_the_trainer_as_syncdp_does(comm, tmp_path_factory):
    """ZeRO-1, -2 and FSDP under the Trainer (gradient accumulation, clipping at 0.5 through the
    global norm, a cosine schedule): on 2 ranks the same logged losses and gradient norms as
    SyncDP to 1e-5 and the same eval loss. (accelerate reads the optimizer's state_dict() before
    the first step; torch's FSDP state dict then makes Adam's state with a step at lr 0, which
    fsdp undoes: Adam's first step keeps its bias correction.)"""
    runs = {spec: train_gpt2(spec, None, comm, tmp_path_factory) for spec in ("syncdp", *SHARDED)}
    logs = {s: [v for e in t.state.log_history if "loss" in e for v in (e["loss"], e["grad_norm"])]
            for s, (t, _, _) in runs.items()}
    for spec in SHARDED:
        assert logs[spec] == pytest.approx(logs["syncdp"], rel=1e-5), (spec, logs)
        assert runs[spec][1]["eval_loss"] == pytest.approx(runs["syncdp"][1]["eval_loss"], rel=1e-5)


def test_a_plain_optimizer_is_refused(comm):
    lt.init(comm)
    model = gpt2()
    with pytest.raises(TypeError, match="lowcomm method"):
        lt.Trainer(model=model, args=transformers.TrainingArguments("unused", report_to="none",
                                                                    use_cpu=True),
                   optimizers=(torch.optim.AdamW(model.parameters()), None))


def test_a_method_that_passes_over_steps_is_refused_naming_why(comm):
    lt.init(comm)
    model = gpt2()
    method = lowcomm.build("diloco-dylu:period=4", model, torch.optim.AdamW(model.parameters()),
                           comm=comm)
    with pytest.raises(lowcomm.LowcommError, match="passes over some"):
        lt.Trainer(model=model, args=transformers.TrainingArguments("unused", report_to="none",
                                                                    use_cpu=True),
                   optimizers=(method, None))
    method.close()


def trainer_run(comm, spec: str, out: str, resume=None, steps: int = 6) -> str:
    """A 1-layer GPT-2 under ``spec`` through the Trainer, checkpointed every 3 steps; the
    final model's digest."""
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=5e-3,
        lr_scheduler_type="cosine", save_strategy="steps", save_steps=3, report_to="none",
        use_cpu=True, seed=1, disable_tqdm=True, logging_steps=100)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    method = lowcomm.build(spec, model, torch.optim.AdamW(model.parameters(), lr=args.learning_rate),
                           comm)
    trainer = lt.Trainer(model=model, args=args, train_dataset=Windows(text(), 64),
                         optimizers=(method, None))
    trainer.train(resume_from_checkpoint=resume)
    return state_sha256(model)


def test_resume_from_checkpoint_mid_period_is_exact_under_diloco(comm, tmp_path_factory):
    """A checkpoint at step 3 of DiLoCo's period 4 (the ranks' local models differ): every rank
    saves its own model and method state beside the Trainer's files, and
    ``resume_from_checkpoint`` continues each rank from its own, ending bit-identical to the
    uninterrupted run (before: every rank took rank 0's optimizer state and model)."""
    lt.init(comm)
    out = comm.bcast_object(str(tmp_path_factory.mktemp("resume")))
    whole = trainer_run(comm, "diloco:period=4", out)
    ckpt = Path(out) / "checkpoint-3"
    assert (ckpt / f"lowcomm-rank{comm.rank}-of-{comm.size}.pt").is_file()
    mine = torch.load(ckpt / f"lowcomm-rank{comm.rank}-of-{comm.size}.pt", weights_only=True)
    locals_ = comm.allgather_object(mine["model"]["transformer.h.0.mlp.c_fc.weight"].numpy().tobytes())
    assert len(set(locals_)) == comm.size, "the local models at step 3 agree: the check is void"
    resumed = trainer_run(comm, "diloco:period=4", comm.bcast_object(
        str(tmp_path_factory.mktemp("again"))), resume=str(ckpt))
    assert resumed == whole, "the resumed run ends with another model than the uninterrupted one"


def test_resume_from_checkpoint_is_exact_under_fsdp(comm, tmp_path_factory):
    """FSDP under the Trainer checkpoints each rank's shards of the model and of Adam's state
    (1/K each) beside the Trainer's files; ``resume_from_checkpoint`` ends bit-identical to the
    uninterrupted run."""
    lt.init(comm)
    spec = "fsdp:wrap=GPT2Block"
    out = comm.bcast_object(str(tmp_path_factory.mktemp("fsdp")))
    whole = trainer_run(comm, spec, out)
    ckpt = Path(out) / "checkpoint-3"
    mine = torch.load(ckpt / f"lowcomm-rank{comm.rank}-of-{comm.size}.pt", weights_only=True)
    shard = mine["model"]["transformer.h.0.mlp.c_fc.weight"]
    assert tuple(shard.shape) == (32, 128) and shard.local.shape[0] == 32 // comm.size, shard
    resumed = trainer_run(comm, spec, comm.bcast_object(str(tmp_path_factory.mktemp("again"))),
                          resume=str(ckpt))
    assert resumed == whole, "the resumed run ends with another model than the uninterrupted one"
