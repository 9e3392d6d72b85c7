"""Eval accuracy of a small BERT classifier under the Hugging Face Trainer with lowcomm's
SyncDP, dense against int8 (a scale per block of 2048) and int8 with one scale per chunk of the
bucket (``block`` larger than any bucket: the old rule), at one seed each run.

The model: ``transformers.BertForSequenceClassification`` from a small ``BertConfig`` (byte
vocabulary, 2 layers, hidden 64; random weights, no download). The data: real text on every
Debian machine, windows of ``--seq`` bytes labelled by where they come from — the Python
standard library's source files (label 0) or /usr/share/common-licenses and /usr/share/doc's
plain-text files (label 1); files are split into training and held-out by a hash of their
path, so no file gives windows to both. Run::

    launchers/local.sh -n 2 python experiments/bert_int8.py --seed 0 --method int8

and it prints one JSON line on rank 0: method, seed, eval accuracy and loss, wall seconds.
"""
import argparse
import json
import time
import zlib
from pathlib import Path

import torch

import lowcomm
from lowcomm.compress.settings import CompressorSettings
from lowcomm.integrations import transformers as lt

METHODS = {"dense": None, "int8": CompressorSettings(name="int8"),
           "int8-per-chunk": CompressorSettings(name="int8", block=1 << 30)}


def sources(seed_files: int = 400) -> tuple[list[Path], list[Path]]:
    """(Python standard library files, licence and documentation texts), sorted."""
    import sysconfig
    py = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:seed_files]
    prose = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    prose += sorted(p for p in Path("/usr/share/doc").rglob("*")
                    if p.is_file() and p.suffix in ("", ".txt") and p.name not in ("copyright",)
                    and p.stat().st_size > 2000)[:300]
    return py, prose


class Windows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def windows(files: list[Path], label: int, seq: int, per_file: int):
    xs = []
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:1000] or len(data) < seq:
            continue
        step = max(seq, (len(data) - seq) // per_file)
        for a in range(0, len(data) - seq + 1, step)[:per_file]:
            xs.append(torch.tensor(list(data[a:a + seq]), dtype=torch.long))
    return xs, [label] * len(xs)


def dataset(seq: int, per_file: int = 8):
    """(training set, held-out set): balanced, shuffled with a fixed seed."""
    py, prose = sources()
    parts = {True: ([], []), False: ([], [])}
    for label, files in ((0, py), (1, prose)):
        for f in files:
            held = zlib.crc32(str(f).encode()) % 5 == 0
            x, y = windows([f], label, seq, per_file)
            parts[held][0].extend(x)
            parts[held][1].extend(y)
    out = []
    for held in (False, True):
        x, y = torch.stack(parts[held][0]), torch.tensor(parts[held][1])
        n = min(int((y == 0).sum()), int((y == 1).sum()))         # balanced classes
        keep = torch.cat([torch.nonzero(y == c).flatten()[:n] for c in (0, 1)])
        keep = keep[torch.randperm(len(keep), generator=torch.Generator().manual_seed(0))]
        out.append(Windows(x[keep], y[keep]))
    return out


def bert(transformers, seq: int, seed: int):
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=seq, num_labels=2, type_vocab_size=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=sorted(METHODS), default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="/tmp/lowcomm-bert-int8")
    a = ap.parse_args()
    torch.set_num_threads(1)
    comm = lt.init()
    import transformers
    train, held = dataset(a.seq)
    args = transformers.TrainingArguments(
        output_dir=f"{a.out}/{a.method}-{a.seed}", max_steps=a.steps, per_device_train_batch_size=16,
        per_device_eval_batch_size=64, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=a.steps // 10, weight_decay=0.01, logging_steps=a.steps, eval_strategy="no",
        save_strategy="no", report_to="none", use_cpu=True, seed=a.seed, disable_tqdm=True)
    model = bert(transformers, a.seq, a.seed)
    inner = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    method = lowcomm.build("syncdp", model, inner, comm, compressor=METHODS[a.method])

    def accuracy(p):
        return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}
    trainer = lt.Trainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                         optimizers=(method, None), compute_metrics=accuracy)
    t0 = time.time()
    trainer.train()
    ev = trainer.evaluate()
    if comm.rank == 0:
        print(json.dumps({"method": a.method, "seed": a.seed, "eval_accuracy": ev["eval_accuracy"],
                          "eval_loss": ev["eval_loss"], "train_windows": len(train),
                          "held_out_windows": len(held), "wall_s": round(time.time() - t0, 1),
                          "ranks": comm.size}), flush=True)


if __name__ == "__main__":
    main()
