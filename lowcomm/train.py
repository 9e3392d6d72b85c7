"""The training loop every method shares: plain PyTorch, with a strategy wrapping the optimizer.

Writes ``metrics.jsonl`` (one line per logged step) and ``summary.json`` into the output
folder from rank 0. Losses and byte counts in them are over all ranks; the reductions that
gather them run on a separate control communicator whose traffic is not charged to the method.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .comm import Comm, init
from .config import Config
from .data import Corpus
from .ledger import Ledger
from .models import build_model
from .strategies import STRATEGIES



def build_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[o.name]
    return cls(params, lr=cfg.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)


def build_strategy(cfg: Config, model, optimizer, comm: Comm):
    s = cfg.strategy
    return STRATEGIES[s.name](model, optimizer, comm, algorithm=s.algorithm, bucket_mb=s.bucket_mb,
                              backward_passes_per_step=s.backward_passes_per_step,
                              overlap=s.overlap, backend=s.backend)


def _sum(ctl: Comm, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    ctl.allreduce_(t)
    return t.tolist()


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


def train(cfg: Config, out: str | Path | None = None, comm: Comm | None = None,
          progress: bool = True) -> dict:
    """Train ``cfg``'s model with ``cfg``'s strategy; return (and write) the run summary."""
    comm = comm or init()
    comm.validate, comm.watchdog.timeout_s = cfg.comm.validate, cfg.comm.timeout_s
    ctl = comm.dup(Ledger(), "control")
    rank, K = comm.rank, comm.size
    out = Path(out) if out else None
    if out and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    corpus = Corpus.load(cfg.data.path, cfg.data.max_bytes, cfg.data.eval_fraction)
    model = build_model(cfg)
    strategy = build_strategy(cfg, model, build_optimizer(cfg, model.parameters()), comm)
    n_params = sum(p.numel() for p in model.parameters())

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc=cfg.method, unit="step", dynamic_ncols=True, mininterval=1.0)
    metrics = open(out / "metrics.jsonl", "w") if out and rank == 0 else None
    window, recent = [], float("nan")
    ctl.barrier()
    t0 = time.perf_counter()
    try:
        for step in range(1, cfg.steps + 1):
            x, y = corpus.batch(step, rank, K, cfg.batch_size, cfg.data.seq_len, cfg.seed)
            strategy.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            strategy.step()
            window.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.steps:
                loss_sum, n, sent = _sum(ctl, [sum(window), len(window), comm.ledger.totals()["bytes_sent"]])
                recent = loss_sum / n
                window = []
                if metrics:
                    metrics.write(json.dumps({"step": step, "loss": recent, "bytes": int(sent),
                                              "wall_s": time.perf_counter() - t0}) + "\n")
                    metrics.flush()
                if bar:
                    bar.set_postfix(loss=f"{recent:.3f}", MB=f"{sent / 1e6:.1f}")
            if bar:
                bar.update(1)
        wall = time.perf_counter() - t0
    finally:
        if bar:
            bar.close()
        if metrics:
            metrics.close()
        strategy.close()
    eval_loss = evaluate(model, corpus, cfg, ctl) if cfg.eval_batches else float("nan")
    levels = sorted(set().union(*ctl.allgather_object(list(comm.ledger.by_level()))))
    per_level = _sum(ctl, [comm.ledger.by_level().get(lv, 0) for lv in levels])
    summary = {
        "method": cfg.method, "ranks": K, "steps": cfg.steps, "params": n_params,
        "final_loss": recent, "eval_loss": eval_loss,
        "bytes_total": int(sum(per_level)), "bytes_by_level": {lv: int(b) for lv, b in zip(levels, per_level)},
        "bytes_per_step_per_rank": sum(per_level) / K / cfg.steps,
        "wall_s": max(ctl.allgather_object(wall)),
        "samples": cfg.steps * cfg.batch_size * K,
        "ledger_rank0": comm.ledger.rows(),
        "config": cfg.to_dict(),
    }
    if out and rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
