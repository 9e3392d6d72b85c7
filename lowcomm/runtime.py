"""What the training loop keeps and restores around the steps, shared by :mod:`lowcomm.loop`
and the parameter server's part of it (:mod:`lowcomm.strategies.ps.run`): the optimizer and
its lr schedule, the held-out evaluation, the NaN check, the SIGINT/SIGTERM flag, the output
folder, checkpoint snapshots and their restore, and the parameters' hash."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .checkpoint import Checkpointer, CheckpointError
from .comm import Comm
from .errors import LowcommError
from .ledger import Ledger

if TYPE_CHECKING:
    from .tasks import Task

log = logging.getLogger("lowcomm.train")


class Interrupted(LowcommError):
    """The run was stopped by a signal after writing a final checkpoint."""

    def __init__(self, signum: int, step: int, where: Path | None):
        self.signum, self.step, self.exit_code = signum, step, 128 + signum
        saved = f"checkpoint written to {where}" if where else "no checkpoint folder configured"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {saved}")


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "onebit-adam": torch.optim.Adam}[o.name]
    return cls(params, lr=cfg.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)


def lr_at(cfg, step: int) -> float:
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
def evaluate(model, task: Task, batches: list, ctl: Comm) -> float:
    """Mean loss of ``task`` on the held-out ``batches``, split across the ranks of ``ctl``
    (NaN when there are none)."""
    model.eval()
    total = count = 0.0
    for i, b in enumerate(batches):
        if i % ctl.size == ctl.rank:
            total += task.loss(model, b).item()
            count += 1
    model.train()
    total, count = _sum(ctl, [total, count])
    return total / count if count else float("nan")


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


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _metrics_upto(src: Path, dst: Path, step: int) -> None:
    """Carry the metric lines up to ``step`` from ``src`` into ``dst`` (dropping any the stopped
    run wrote after its checkpoint, and a last line a kill or a full disk cut short)."""
    lines = src.read_text().splitlines() if src.exists() else []
    keep = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:          # cut short while being written: drop it
                log.warning("%s: dropping its last line, cut short (%d bytes)", src, len(line))
                continue
            raise LowcommError(f"{src}, line {i + 1}: not a JSON line ({line[:60]!r}); the file "
                               "was changed by something other than lowcomm") from None
        if row["step"] <= step:
            keep.append(line)
    _write_text(dst, "".join(line + "\n" for line in keep))


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``; a full disk or a read-only folder is an error naming it."""
    try:
        path.write_text(text)
    except OSError as e:
        raise LowcommError(f"cannot write {path}: {e.strerror or e}") from e


#: the files a run writes into its folder (another run must not overwrite them)
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints")
_LOCKS: dict[str, object] = {}


def _lock(out: Path) -> str | None:
    """Hold ``out/.lowcomm.lock`` (an flock, released when this process ends, even on SIGKILL)
    for this run; None, or a line naming the run that holds it."""
    import fcntl
    import os
    import socket
    import sys
    f = open(out / ".lowcomm.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return f"{out} is in use by another run ({holder}); wait for it or choose another --out"
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)[:200]}\n")
    f.flush()
    _LOCKS[str(out)] = f
    return None


def refusal(out: Path, resume: str | Path | None, overwrite: bool) -> str | None:
    """Why a run may not use ``out`` (it holds another run that this one neither resumes nor
    replaces), or None."""
    if overwrite or (resume is not None and Path(resume).resolve() == out.resolve()):
        return None
    present = [f for f in RUN_FILES if (out / f).exists()]
    if present:
        return (f"{out} holds another run ({', '.join(present)}); continue it with --resume "
                f"{out}, replace it with --overwrite, or choose another --out")
    return None


def close_run(out: Path | None) -> None:
    """Release the run folder's lock (the end of :func:`lowcomm.loop.run`)."""
    f = _LOCKS.pop(str(out), None) if out else None
    if f is not None:
        f.close()


def apply_comm_settings(cfg, comm: Comm) -> None:
    """``cfg.comm`` on ``comm``: shape validation and the watchdog's floor, factor and outage
    allowance. Before the run's first collective (the topology's communicators included), so
    that none of them waits under another run's limits."""
    comm.validate, comm.watchdog.timeout_s = cfg.comm.validate, cfg.comm.timeout_s
    comm.watchdog.factor, comm.watchdog.outage_s = cfg.comm.watchdog_factor, cfg.comm.outage_s


def open_run(cfg, comm: Comm, out: str | Path | None, resume: str | Path | None = None,
             overwrite: bool = False):
    """Apply ``cfg.comm`` to ``comm``; return the uncharged control communicator, the output
    folder and the checkpointer (None without a folder).

    Rank 0 locks the folder for the run (a second run on it fails, naming the holder). A run
    never writes over another run's files: a folder that holds a run is refused unless this
    run resumes it, or ``overwrite`` (its files are then removed first). A fresh run's resolved
    config is written now; a resumed run's after its checkpoint is accepted
    (:func:`write_config`). Every rank raises the same error."""
    apply_comm_settings(cfg, comm)
    ctl = comm.dup(Ledger(), "control")
    ctl.validate = False            # fixed shapes; keeps its non-blocking calls non-blocking
    out = Path(out) if out else None
    problem = None
    if out and comm.rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            problem = _lock(out)
        except OSError as e:
            problem = f"cannot use {out} for the run: {e.strerror or e}"
        resuming_here = resume is not None and Path(resume).resolve() == out.resolve()
        if problem is None:
            problem = refusal(out, resume, overwrite)
        if problem is None and overwrite and not resuming_here:
            import shutil
            for f in RUN_FILES:
                if (out / f).exists():
                    (shutil.rmtree if (out / f).is_dir() else Path.unlink)(out / f)
        if problem is None and resume is None:
            write_config(cfg, out)
    problem = ctl.bcast_object(problem) if comm.size > 1 else problem
    if problem:
        close_run(out)
        raise LowcommError(problem)
    ck_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else (out / "checkpoints" if out else None)
    return ctl, out, Checkpointer(ck_dir, ctl, cfg.checkpoint.keep) if ck_dir else None


def write_config(cfg, out: Path) -> None:
    _write_text(out / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")


def snapshot(model, strategy, comm: Comm, loop: dict) -> dict:
    """Everything one rank needs to continue exactly: model, strategy (optimizer, residuals,
    outer state, versions), ledger counters, RNG states and the loop's own counters."""
    return {"model": model.state_dict(), "strategy": strategy.state_dict(),
            "ledger": comm.ledger.state_dict(), "rng": _rng_state(), "loop": loop}


def resized(state: dict, comm: Comm, strategy, where: Path) -> dict:
    """This rank's state from the checkpoint of a run on another number of ranks
    (``state["ranks"]``: every old rank's state). The rules:

    * model and strategy: the strategy's own :meth:`~lowcomm.strategies.base.Strategy.reshard`
      (replicated state: rank 0's; per-rank state: averaged; compressor state: reset);
    * RNG states: new rank r takes old rank ``r mod K_old``'s (a run that shrinks continues
      its first ranks' streams; one that grows repeats old ranks' streams on its new ranks),
      unless the strategy's ``reshard`` returns ``"rng"`` (and ``"loop"``) itself (the
      parameter server: a worker takes an old worker's);
    * ledger: new rank 0 takes the sum of every old rank's counters, the others start at zero,
      so the run's byte totals (summed over ranks) carry over;
    * the loop's counters: old rank ``r mod K_old``'s (equal on every rank), except the loss
      window of the current log interval, which new ranks beyond K_old start empty.
    Every rank raises the same error when the strategy cannot be resized."""
    old, K_old, r = state["ranks"], state["world_size"], comm.rank
    try:
        merged = strategy.reshard(old)
    except LowcommError as e:
        raise CheckpointError(f"checkpoint {where} was written by {K_old} ranks and cannot be "
                              f"resumed on {comm.size}: {e}") from None
    rows: dict = {}
    if r == 0:
        for s in old:
            for row in s["ledger"]["rows"]:
                acc = rows.setdefault((row["level"], row["op"]), dict(row, calls=0, bytes_sent=0,
                                                                     bytes_recv=0, seconds=0.0))
                for k in ("calls", "bytes_sent", "bytes_recv", "seconds"):
                    acc[k] += row[k]
    loop = dict(merged.get("loop", old[r % K_old]["loop"]))
    if r >= K_old and "window" in loop:
        loop["window"] = []
    loop["resizes"] = [*loop.get("resizes", []), {"step": state["step"], "from": K_old,
                                                   "to": comm.size}]
    if r == 0:
        log.warning("resuming the %d-rank checkpoint %s on %d ranks, merged by %s's rule",
                    K_old, where, comm.size, getattr(strategy, "name", "async-ps"))
    return {"step": state["step"], "model": merged["model"], "strategy": merged["strategy"],
            "ledger": {"rows": list(rows.values())}, "rng": merged.get("rng", old[r % K_old]["rng"]),
            "loop": loop}


def restore(resume: str | Path, cfg, comm: Comm, ctl: Comm, model, strategy,
            out: Path | None) -> tuple[int, dict]:
    """Load the newest intact checkpoint of run `resume` (or of ``checkpoint.dir``) into
    `model`, `strategy`, the ledger and the RNGs (merged by :func:`resized` when it was
    written by another number of ranks); copy the run's metrics up to that step into
    `out`. Returns (step, loop state). Raises CheckpointError when none is intact."""
    resume = Path(resume)
    from_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else resume / "checkpoints"
    state = Checkpointer(from_dir, ctl).load_latest(cfg.to_dict(), resize=True)
    if state is None:
        raise CheckpointError(f"no intact checkpoint in {from_dir} to resume from")
    if state["step"] > cfg.steps:
        raise CheckpointError(f"the checkpoint in {from_dir} is at step {state['step']}, past "
                              f"steps={cfg.steps}: resume with steps >= {state['step']}")
    if "ranks" in state:
        state = resized(state, comm, strategy, from_dir)
    model.load_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    comm.ledger.load_state_dict(state["ledger"])
    _set_rng_state(state["rng"])
    if out and comm.rank == 0:                 # accepted: now the folder may change
        write_config(cfg, out)
        _metrics_upto(resume / "metrics.jsonl", out / "metrics.jsonl", state["step"])
        log.info("resumed from %s at step %d", from_dir, state["step"])
    return state["step"], state["loop"]
