"""The training loop every method shares: plain PyTorch, with a strategy wrapping the optimizer.

Writes ``config.json`` (the resolved config), ``metrics.jsonl`` (one line per logged step) and
``summary.json`` into the output folder from rank 0, and checkpoints into
``<out>/checkpoints`` (see :mod:`lowcomm.checkpoint`). Losses and byte counts are over all ranks;
the reductions that gather them run on a separate control communicator whose traffic is not
charged to the method.

Reliability, per step boundary:

* ``checkpoint.every = N``: every N-th step all ranks write a checkpoint holding model,
  optimizer and strategy state (compressor residuals, outer optimizer, …), every RNG state,
  the ledger and the loop's own counters; the data order is a pure function of the step, so a
  resumed run replays exactly the batches it would have seen (``params_sha256`` in the summary
  is identical to an uninterrupted run's).
* SIGINT / SIGTERM: every rank finishes the step it is in, a final checkpoint is written, and
  the job exits with status 128 + signal. Ranks agree on the stop through a non-blocking
  all-reduce started one step earlier, so a signal that reaches only some ranks stops all of
  them at the same step, and a run without signals pays no waiting for it.
* ``on_nonfinite``: a NaN/Inf loss or gradient either ends the job naming the rank, step and
  parameter (``"abort"``, the default; nothing non-finite is ever sent) or is skipped by all
  ranks together (``"skip"``: one 4-byte all-reduce per step to agree; counted in the summary).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch

from .comm import Comm, init
from .config import Config
from .errors import LowcommError, NonFiniteError
# the run's pieces the async-ps loop shares; importable from here too
from .runtime import (Corpus, _metrics_upto, _rng_state, _set_rng_state, _sum,  # noqa: F401
                      build_model, build_optimizer, evaluate, nonfinite, open_run, params_sha256,
                      restore, snapshot)
from .strategies import STRATEGIES

log = logging.getLogger("lowcomm.train")


class Interrupted(LowcommError):
    """The run was stopped by a signal after writing a final checkpoint."""

    def __init__(self, signum: int, step: int, where: Path | None):
        self.signum, self.step, self.exit_code = signum, step, 128 + signum
        saved = f"checkpoint written to {where}" if where else "no checkpoint folder configured"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {saved}")


def lr_at(cfg: Config, step: int) -> float:
    """The (inner) optimizer's lr at ``step`` (1-based): a linear warm-up over
    ``optimizer.warmup_steps`` steps (Goyal et al. 2017, arXiv 1706.02677), then ``lr`` constant
    or, for ``schedule = "cosine"``, SGDR's cosine without restarts (Loshchilov & Hutter 2017,
    arXiv 1608.03983) from ``lr`` down to ``min_lr_ratio · lr`` at the last step:
    ``lr_t = lr · (r + (1 − r) · ½(1 + cos(π · (t − W) / (T − W))))``.
    A function of the step alone, so a resumed run sets the same lr without saved state."""
    o = cfg.optimizer
    if step <= o.warmup_steps:
        return cfg.lr * step / o.warmup_steps
    if o.schedule == "constant":
        return cfg.lr
    progress = (step - o.warmup_steps) / (cfg.steps - o.warmup_steps)   # warmup < steps
    r = o.min_lr_ratio
    return cfg.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_strategy(cfg: Config, model, optimizer, comm: Comm, levels=None):
    """``levels``: the topology's communicators (policies and the hierarchical all-reduce)."""
    if cfg.optimizer.name == "onebit-adam":   # 1-bit Adam owns both the update and the exchange
        from .strategies.onebit_adam import OneBitAdam
        return OneBitAdam.from_config(cfg, model, optimizer, comm)
    if cfg.policy:                          # a strategy per topology level
        from .strategies.policy import build_policy
        return build_policy(cfg, model, optimizer, comm, levels)
    extra = {"levels": levels} if cfg.strategy.algorithm == "hierarchical" else {}
    return STRATEGIES[cfg.strategy.name].from_config(cfg, model, optimizer, comm, **extra)


class StopFlag:
    """SIGINT/SIGTERM set a flag (main thread only); the loop acts on it at a step boundary."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum:             # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum
        log.warning("%s: stopping after this step and writing a checkpoint (send it again to "
                    "stop at once)", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def train(cfg: Config, out: str | Path | None = None, comm: Comm | None = None,
          progress: bool = True, resume: str | Path | None = None) -> dict:
    """Train ``cfg``'s model with ``cfg``'s strategy; return (and write) the run summary.

    ``resume``: the output folder of an earlier run of this config; continue from the newest
    intact checkpoint in its checkpoint folder (an error if there is none)."""
    if cfg.strategy.name == "async-ps":   # issue 7: servers serve, workers never wait for a collective
        from .strategies.ps_train import train_async_ps
        return train_async_ps(cfg, out, comm, progress, resume, build_model=build_model)
    comm = comm or init()
    topo_comms = None                       # the topology's communicators: hierarchical/policy
    if cfg.topology or os.environ.get("LOWCOMM_TOPOLOGY") or cfg.policy \
            or cfg.strategy.algorithm == "hierarchical":
        from .topology import Topology
        topo = Topology.from_env(comm, cfg.topology)     # checks the spec against the job
        if cfg.policy or cfg.strategy.algorithm == "hierarchical":
            topo_comms = topo.comms(comm)
    ctl, out, ckpt = open_run(cfg, comm, out)
    rank, K = comm.rank, comm.size

    torch.manual_seed(cfg.seed)
    corpus = Corpus.load(cfg.data.path, cfg.data.max_bytes, cfg.data.eval_fraction)
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model.parameters())
    strategy = build_strategy(cfg, model, optimizer, comm, topo_comms)
    n_params = sum(p.numel() for p in model.parameters())

    first, skipped, wall_before, window, recent = 1, 0, 0.0, [], float("nan")
    if resume:
        step, loop = restore(resume, cfg, comm, ctl, model, strategy, out)
        skipped, wall_before, window, recent = loop["skipped"], loop["wall_s"], loop["window"], loop["recent"]
        first = step + 1

    def save(step: int) -> Path:
        loop = {"skipped": skipped, "wall_s": wall_before + time.perf_counter() - t0,
                "window": list(window), "recent": recent}
        return ckpt.save(step, snapshot(model, strategy, comm, loop), cfg.to_dict())

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=first - 1, desc=cfg.method, unit="step",
                   dynamic_ncols=True, mininterval=1.0)
    metrics = open(out / "metrics.jsonl", "a" if resume else "w") if out and rank == 0 else None
    ctl.barrier()
    t0 = time.perf_counter()
    stop_vote = None                 # non-blocking all-reduce of the ranks' stop flags
    try:
        with StopFlag() as stop:
            for step in range(first, cfg.steps + 1):
                x, y = corpus.batch(step, rank, K, cfg.batch_size, cfg.data.seq_len, cfg.seed)
                strategy.zero_grad()
                loss = model.loss(x, y)
                loss.backward()
                bad = nonfinite(loss, model)
                if cfg.on_nonfinite == "skip":
                    if _sum(ctl, [1.0 if bad else 0.0])[0] > 0:
                        if bad:
                            log.warning("rank %d step %d: %s is not finite; all ranks skip the step",
                                        rank, step, bad)
                        strategy.skip()
                        skipped += 1
                        bad = "skipped"
                elif bad:
                    raise NonFiniteError(rank, bad, step)
                if bad != "skipped":
                    set_lr(optimizer, lr_at(cfg, step))
                    strategy.step()
                    window.append(loss.item())
                if step % cfg.log_every == 0 or step == cfg.steps:
                    tot = comm.ledger.totals()
                    loss_sum, n, sent, comm_s, rounds = _sum(ctl, [
                        sum(window), len(window), tot["bytes_sent"], tot["seconds"], comm.ledger.rounds(K)])
                    recent = loss_sum / n if n else float("nan")
                    window = []
                    line = {"step": step, "loss": recent, "bytes": int(sent),
                            "wall_s": wall_before + time.perf_counter() - t0,
                            "comm_s": comm_s / K, "rounds": rounds / K,
                            "lr": optimizer.param_groups[0]["lr"]}
                    line.update(strategy.log_fields(ctl))
                    if cfg.eval_batches and cfg.eval_every and step % cfg.eval_every == 0:
                        line["eval_loss"] = evaluate(model, corpus, cfg, ctl)
                    if metrics:
                        metrics.write(json.dumps(line) + "\n")
                        metrics.flush()
                    if bar:
                        bar.set_postfix(loss=f"{recent:.3f}", MB=f"{sent / 1e6:.1f}")
                if bar:
                    bar.update(1)
                if ckpt and cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.steps:
                    save(step)
                if stop_vote is not None:      # started one step ago: usually done by now
                    flags, request = stop_vote
                    request.wait()
                    if flags.item() > 0:
                        signum = stop.signum or signal.SIGTERM   # ranks the signal missed
                        raise Interrupted(signum, step, save(step) if ckpt else None)
                flags = torch.tensor([1 if stop.signum else 0], dtype=torch.int32)
                stop_vote = (flags, ctl.iallreduce_(flags) if K > 1 else _Done())
            if stop_vote is not None:
                stop_vote[1].wait()
        wall = wall_before + time.perf_counter() - t0
    finally:
        if bar:
            bar.close()
        if metrics:
            metrics.close()
        strategy.close()
    extra = strategy.summary(ctl)
    strategy.finish()
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
        "skipped_steps": skipped,
        **extra,
        "params_sha256": params_sha256(model),
        "ledger_rank0": comm.ledger.rows(),
        "config": cfg.to_dict(),
    }
    if out and rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


class _Done:
    """A completed request (one rank: nothing to agree with)."""

    def wait(self) -> None:
        pass
