"""Checkpoint contents: what one rank saves to continue exactly (:func:`snapshot`), how it is loaded
back (:func:`restore`), and how a checkpoint of another rank count is merged (:func:`resized`)."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from ..comm.comm import Comm
from ..errors import LowcommError
from ..strategies.ownership import adopt
from .checkpoint import Checkpointer, CheckpointError
from .folder import checkpoint_dir, metrics_upto, run_id_of, write_config

log = logging.getLogger("lowcomm.train")


def seed_all(seed: int) -> None:
    """Seed every generator a task may draw from: torch's, Python's ``random`` and NumPy's
    global one (the same seed on every rank, so that the ranks build the same model)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def snapshot(model, strategy, comm: Comm, loop: dict, with_model: bool = True) -> dict:
    """Everything one rank needs to continue exactly: model (unless ``with_model`` is False:
    it goes through torch.distributed.checkpoint, :mod:`lowcomm.run.dcp`), strategy
    (optimizer, residuals, outer state, versions), ledger counters, RNG states and the loop's
    own counters."""
    return {"model": strategy.model_state_dict() if with_model else {},
            "strategy": strategy.state_dict(),
            "ledger": comm.ledger.state_dict(), "rng": rng_state(), "loop": loop}


def resized(state: dict, comm: Comm, strategy, where: Path) -> dict:
    """This rank's state from the checkpoint of a run on another number of ranks
    (``state["ranks"]``: every old rank's state). The rules:

    * model and strategy: the strategy's own :meth:`~lowcomm.strategies.capabilities.Capabilities.reshard`
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
                    K_old, where, comm.size, strategy.name)
    return {"step": state["step"], "model": merged["model"], "strategy": adopt(merged["strategy"]),
            "ledger": {"rows": list(rows.values())}, "rng": merged.get("rng", old[r % K_old]["rng"]),
            "loop": loop}


def check_model(own: dict, saved: dict, where: Path) -> None:
    """A CheckpointError naming ``where`` and the keys that differ when the checkpoint's model
    ``saved`` (a state dict) is not the model whose state is ``own`` (the task was edited in
    between)."""
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k} {tuple(saved[k].shape)} in the checkpoint, {tuple(own[k].shape)} now"
              for k in own if k in saved and hasattr(saved[k], "shape") and saved[k].shape != own[k].shape]
    parts = [f"{what}: {_some(keys)}" for what, keys in (("keys the model has and the checkpoint "
                                                           "lacks", missing),
                                                          ("keys only the checkpoint has", unexpected),
                                                          ("shapes differ", shapes)) if keys]
    if parts:
        raise CheckpointError(f"checkpoint {where} holds another model than the task builds now "
                              f"(was the task changed?): " + "; ".join(parts))


def _some(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _load_distributed(strategy, folder: Path, ctl: Comm) -> None:
    """The model read back in place from the checkpoint's DCP files; a CheckpointError naming
    the folder where they hold another model (DCP's own error, shortened)."""
    from .dcp import load_model
    try:
        load_model(strategy.distributed_model_state(), folder, ctl)
    except LowcommError:
        raise
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {folder}/dcp cannot be loaded into this model: "
                              f"{str(e).splitlines()[0][:300]}") from None


def restore(resume: str | Path, cfg, comm: Comm, ctl: Comm, model, strategy,
            out: Path | None) -> tuple[int, dict]:
    """Load the newest intact checkpoint of run `resume` (or of ``checkpoint.dir``) into
    `model`, `strategy`, the ledger and the RNGs (merged by :func:`resized` when it was
    written by another number of ranks); copy the run's metrics up to that step into
    `out`. Returns (step, loop state). Raises CheckpointError when none is intact."""
    resume = Path(resume)
    from_dir = checkpoint_dir(cfg, resume)
    state = Checkpointer(from_dir, ctl, run=run_id_of(resume)).load_latest(cfg.to_dict(), resize=True)
    if state is None:
        raise CheckpointError(f"no intact checkpoint in {from_dir} to resume from")
    if state["step"] > cfg.steps:
        raise CheckpointError(f"the checkpoint in {from_dir} is at step {state['step']}, past "
                              f"steps={cfg.steps}: resume with steps >= {state['step']}")
    where = from_dir / f"step-{state['step']:08d}"
    if "ranks" in state:      # another rank count: every old rank's keys against the whole model
        check_model(model.state_dict(), {k: v for s in reversed(state["ranks"])
                                         for k, v in s["model"].items()}, where)   # rank 0's first
    elif "dcp" not in state:  # this rank's keys (a pipeline stage's, a shard's)
        check_model(strategy.model_state_dict(), state["model"], where)
    if "ranks" in state:
        state = resized(state, comm, strategy, from_dir)
    if "dcp" in state:        # the model through torch.distributed.checkpoint
        _load_distributed(strategy, state["dcp"], ctl)
    else:
        strategy.load_model_state_dict(state["model"])
    strategy.load_state_dict(state["strategy"])
    comm.ledger.load_state_dict(state["ledger"])
    set_rng_state(state["rng"])
    if out and comm.rank == 0:                 # accepted: now the folder may change
        write_config(cfg, out)
        metrics_upto(resume / "metrics.jsonl", out / "metrics.jsonl", state["step"])
        log.info("resumed from %s at step %d", from_dir, state["step"])
    return state["step"], state["loop"]
