"""The run folder: its lock (one run at a time), the rules for reusing it (never over another
run's files), and writing its text files so that a full disk names the file."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..comm.comm import Comm
from ..comm.ledger import Ledger
from ..errors import LowcommError
from .checkpoint import Checkpointer
from .config import apply_comm_settings

log = logging.getLogger("lowcomm.train")


def metrics_upto(src: Path, dst: Path, step: int) -> None:
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
    write_text(dst, "".join(line + "\n" for line in keep))


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path``; a full disk or a read-only folder is an error naming it."""
    try:
        path.write_text(text)
    except OSError as e:
        raise LowcommError(f"cannot write {path}: {e.strerror or e}") from e


#: the files a run writes into its folder (another run must not overwrite them)
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints")


_LOCKS: dict[str, object] = {}


def lock(out: Path) -> str | None:
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
    """Release the run folder's lock (the end of :func:`lowcomm.run.loop.run`)."""
    f = _LOCKS.pop(str(out), None) if out else None
    if f is not None:
        f.close()


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
            problem = lock(out)
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
    write_text(out / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")


def write_summary(r, fields: dict, write: bool) -> dict:
    """The run's summary — the same head on every run (method, task, ranks, steps, parameter
    count), then ``fields``, then the resolved config — written to ``<out>/summary.json`` where
    ``write`` (one rank) and the run has a folder. The one writer of summary.json."""
    summary = {"method": r.cfg.method, "task": r.task.where, "ranks": r.comm.size,
               "steps": r.cfg.steps, "params": sum(p.numel() for p in r.model.parameters()),
               **fields, "config": r.cfg.to_dict()}
    if write and r.out:
        write_text(r.out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
