"""A task around a model nobody on the lowcomm team wrote: Hugging Face ``transformers``' GPT-2,
built from a config (random weights, no download), learning the bytes of text that ships with
every Debian machine (``/usr/share/common-licenses`` by default).

Run it under any method::

    launchers/local.sh -n 4 lowcomm train --set task=experiments/hf_gpt2_task.py --set steps=200
    lowcomm compare --np 2 --set task=experiments/hf_gpt2_task.py --methods ddp,diloco,ef-sign

Options (a ``[task]`` table, or ``--set task.<option>=...``): ``path`` (a text file or a
directory), ``seq_len``, ``n_embd``, ``n_layer``, ``n_head``, ``eval_fraction``, ``dropout`` (GPT-2's three
dropout rates; 0 by default — a resumed run then needs the checkpoint's RNG state to match). The batch size
is the run's ``batch_size``; held-out batches: the run's ``eval_batches``.
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lowcomm.tasks.corpus import Corpus
from lowcomm.tasks import dataset_batches

DEFAULTS = {"path": "/usr/share/common-licenses", "seq_len": 64, "n_embd": 64, "n_layer": 2,
            "n_head": 4, "eval_fraction": 0.1, "dropout": 0.0}


def options(cfg) -> dict:
    unknown = set(cfg.task.options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg.task.options}


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` bytes of ``text`` (a uint8 tensor), as int64."""

    def __init__(self, text: torch.Tensor, seq_len: int):
        self.text, self.seq_len = text, seq_len
        if len(text) < seq_len:
            raise ValueError(f"{len(text)} bytes of text are fewer than one window of {seq_len}")

    def __len__(self):
        return len(self.text) // self.seq_len

    def __getitem__(self, i):
        return self.text[i * self.seq_len:(i + 1) * self.seq_len].long()


_splits: dict = {}


def splits(cfg):
    """(training windows, held-out windows, a line on the text read, the batch function),
    built once per set of options."""
    o = options(cfg)
    key = (o["path"], o["seq_len"], o["eval_fraction"])
    if key not in _splits:
        corpus = Corpus.load(o["path"], eval_fraction=o["eval_fraction"])
        train = Windows(corpus.train, o["seq_len"])
        _splits[key] = (train, Windows(corpus.eval, o["seq_len"]), corpus.describe(),
                        dataset_batches(train))
    return _splits[key]


def model(cfg):
    o = options(cfg)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=o["seq_len"], n_embd=o["n_embd"], n_layer=o["n_layer"],
        n_head=o["n_head"], bos_token_id=0, eos_token_id=0,
        resid_pdrop=o["dropout"], embd_pdrop=o["dropout"], attn_pdrop=o["dropout"]))


def loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def batch(step, rank, world, cfg):
    return splits(cfg)[3](step, rank, world, cfg)


def eval_batches(cfg):
    held = splits(cfg)[1]
    n = min(len(held), cfg.eval_batches * cfg.batch_size)
    return [torch.stack([held[i] for i in range(b, min(n, b + cfg.batch_size))])
            for b in range(0, n, cfg.batch_size)]


def describe(cfg):
    return splits(cfg)[2]
