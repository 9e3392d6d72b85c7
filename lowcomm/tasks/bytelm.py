"""The built-in task: byte-level language modelling with :class:`~lowcomm.tasks.tinygpt.TinyGPT` on
text that every machine has (the Python standard library's sources, or ``data.path``).

Its options are the config's ``[model]`` (``name``, ``d_model``, ``n_layers``, ``n_heads``) and
``[data]`` (``path``, ``glob``, ``seq_len``, ``max_bytes``, ``eval_fraction``) tables, with
``batch_size`` sequences per rank per step and ``eval_batches`` held-out batches.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from .corpus import Corpus
from .tinygpt import MODELS

log = logging.getLogger("lowcomm.tasks.bytelm")


@functools.lru_cache(maxsize=4)
def corpus(path: str, glob: str, max_bytes: int, eval_fraction: float) -> Corpus:
    c = Corpus.load(path, max_bytes, eval_fraction, glob)
    log.debug("corpus %s", c.describe())
    return c


def _corpus(cfg) -> Corpus:
    d = cfg.data
    return corpus(d.path, d.glob, d.max_bytes, d.eval_fraction)


def model(cfg) -> torch.nn.Module:
    m = cfg.model
    if m.name not in MODELS:
        raise ValueError(f"model.name {m.name!r} is not a model of the bytelm task; known: "
                         f"{', '.join(MODELS)}")
    return MODELS[m.name](cfg.data.seq_len, m.d_model, m.n_layers, m.n_heads)


def loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return criterion(model(x), y)


def criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy of the model's output (what a pipeline's last stage computes)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(step: int, rank: int, world: int, cfg):
    c = _corpus(cfg)
    c.check(cfg.data.seq_len, world)       # names data.path when the text is too short
    return c.batch(step, rank, world, cfg.batch_size, cfg.data.seq_len, cfg.seed)


def eval_batches(cfg):
    c = _corpus(cfg)
    c.check(cfg.data.seq_len, 1)
    return c.eval_batches(cfg.eval_batches, cfg.batch_size, cfg.data.seq_len)


def tokens(cfg) -> int:
    """Tokens (bytes) in one sample: a window of ``data.seq_len``."""
    return int(cfg.data.seq_len)


def describe(cfg) -> str:
    """One line on the data read (files, bytes, skipped), for the run's log."""
    return _corpus(cfg).describe()
