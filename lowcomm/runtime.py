"""The pieces of a training run that every loop shares (the common loop in :mod:`lowcomm.train`
and the parameter server's in :mod:`lowcomm.strategies.ps_train`): building the model and the
optimizer, opening the output folder, checkpoint snapshots and restores, evaluation, the NaN
scan and the parameters' hash. Neither loop imports the other; both import this.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import numpy as np
import torch

from .checkpoint import Checkpointer, CheckpointError
from .comm import Comm
from .config import Config
from .data import Corpus
from .ledger import Ledger
from .models import build_model

log = logging.getLogger("lowcomm.train")

__all__ = ["Corpus", "build_model", "build_optimizer", "evaluate", "nonfinite", "open_run",
           "params_sha256", "restore", "snapshot"]


def build_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "onebit-adam": torch.optim.Adam}[o.name]
    return cls(params, lr=cfg.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)



def params_sha256(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes in ``named_parameters`` order (to compare runs)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sum(ctl: Comm, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    ctl.allreduce_(t)
    return t.tolist()


def nonfinite(loss: torch.Tensor, model: torch.nn.Module) -> str | None:
    """What holds NaN/Inf on this rank (``"the loss"``, ``"the gradient of 'w'"``) or None."""
    if not bool(torch.isfinite(loss.detach()).all()):
        return "the loss"
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return f"the gradient of {name!r}"
    return None



@torch.no_grad()
def evaluate(model, corpus: Corpus, cfg: Config, ctl: Comm) -> float:
    """Mean loss on ``cfg.eval_batches`` fixed held-out batches, split across ranks."""
    model.eval()
    total = count = 0.0
    for i, (x, y) in enumerate(corpus.eval_batches(cfg.eval_batches, cfg.batch_size, cfg.data.seq_len)):
        if i % ctl.size == ctl.rank:
            total += model.loss(x, y).item()
            count += 1
    model.train()
    total, count = _sum(ctl, [total, count])
    return total / max(count, 1)



def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _metrics_upto(src: Path, dst: Path, step: int) -> None:
    """Carry the metric lines up to ``step`` from ``src`` into ``dst`` (dropping any the stopped
    run wrote after its checkpoint)."""
    lines = src.read_text().splitlines() if src.exists() else []
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    dst.write_text("".join(line + "\n" for line in keep))


def open_run(cfg: Config, comm: Comm, out: str | Path | None):
    """Apply ``cfg.comm`` to ``comm``; return the uncharged control communicator, the output
    folder (rank 0 writes the resolved config there) and the checkpointer (None without a
    folder)."""
    comm.validate, comm.watchdog.timeout_s = cfg.comm.validate, cfg.comm.timeout_s
    ctl = comm.dup(Ledger(), "control")
    ctl.validate = False            # fixed shapes; keeps its non-blocking calls non-blocking
    out = Path(out) if out else None
    if out and comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    ck_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else (out / "checkpoints" if out else None)
    return ctl, out, Checkpointer(ck_dir, ctl, cfg.checkpoint.keep) if ck_dir else None


def snapshot(model, strategy, comm: Comm, loop: dict) -> dict:
    """Everything one rank needs to continue exactly: model, strategy (optimizer, residuals,
    outer state, versions), ledger counters, RNG states and the loop's own counters."""
    return {"model": model.state_dict(), "strategy": strategy.state_dict(),
            "ledger": comm.ledger.state_dict(), "rng": _rng_state(), "loop": loop}


def restore(resume: str | Path, cfg: Config, comm: Comm, ctl: Comm, model, strategy,
            out: Path | None) -> tuple[int, dict]:
    """Load the newest intact checkpoint of run `resume` (or of ``checkpoint.dir``) into
    `model`, `strategy`, the ledger and the RNGs; copy the run's metrics up to that step into
    `out`. Returns (step, loop state). Raises CheckpointError when none is intact."""
    resume = Path(resume)
    from_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else resume / "checkpoints"
    state = Checkpointer(from_dir, ctl).load_latest(cfg.to_dict())
    if state is None:
        raise CheckpointError(f"no intact checkpoint in {from_dir} to resume from")
    model.load_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    comm.ledger.load_state_dict(state["ledger"])
    _set_rng_state(state["rng"])
    if out and comm.rank == 0:
        _metrics_upto(resume / "metrics.jsonl", out / "metrics.jsonl", state["step"])
        log.info("resumed from %s at step %d", from_dir, state["step"])
    return state["step"], state["loop"]


