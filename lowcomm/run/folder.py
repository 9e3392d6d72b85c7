"""The run folder: its lock (one run at a time), its marker (which run wrote it), the rules for
reusing it (never over another run's files, never removing what lowcomm did not write), the
checkpoint folder a run claims, and writing text files so that a full disk names the file.

A run folder holds ``.lowcomm-run.json``, the marker: ``{"written_by": "lowcomm", "run": ID,
"out": PATH}``. ``ID`` names the run: a fresh run draws one (a supervisor gives every attempt
its own, so that a relaunch from step 0 may reuse the folder of its earlier attempt), and a
resumed run keeps the one of the run it continues. ``--overwrite`` removes only what lowcomm
wrote (``config.json``, ``metrics.jsonl``, ``summary.json``, tracebacks and the checkpoints),
and only from a folder with the marker. A ``checkpoint.dir`` outside the run folder is locked
and marked too, and belongs to the run that first wrote into it.
"""
from __future__ import annotations

import errno
import json
import math
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..comm.comm import Comm
from ..comm.ledger import Ledger
from ..errors import LowcommError, RunFolderError
from .checkpoint import Checkpointer, checkpoint_steps
from .config import apply_comm_settings

log = logging.getLogger("lowcomm.train")

#: the marker lowcomm writes into a run folder (and a ``checkpoint.dir`` it claims)
MARKER = ".lowcomm-run.json"

#: the files a run writes into its folder (another run must not overwrite them)
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints")

#: errors of a folder that cannot be written (not a full disk: that may pass)
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


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
    """Write ``text`` to ``path`` at once (a temporary file beside it, renamed over it: a reader
    sees the old text or the new, never a part, e.g. a fleet's marker rewritten at every
    relaunch while ``lowcomm fault`` reads it); a full disk or a read-only folder is an error
    naming it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kind = RunFolderError if e.errno in _UNWRITABLE else LowcommError
        raise kind(f"cannot write {path}: {e.strerror or e}") from e


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(obj, indent: int | None = 2) -> str:
    """``obj`` as JSON text ending in a newline, a float that is not finite written as null
    (``json.dumps`` writes a bare NaN, which is not JSON: a task without held-out batches has
    no eval loss)."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False) + "\n"


def new_run_id() -> str:
    """A new run's id (random, 32 hex digits)."""
    return uuid.uuid4().hex


def read_marker(folder: Path) -> dict | None:
    """The marker of ``folder`` (``{"run", "out", ...}``), or None when it has none (or one
    lowcomm did not write)."""
    try:
        m = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("written_by") == "lowcomm" and m.get("run") else None


def run_id_of(folder: str | Path | None) -> str | None:
    """The id of the run whose folder this is (None: no marker, a run from before markers)."""
    m = read_marker(Path(folder)) if folder else None
    return m["run"] if m else None


def write_marker(folder: Path, run_id: str, out: Path | None) -> None:
    """Mark ``folder`` as written by lowcomm for the run ``run_id`` whose folder is ``out``."""
    write_text(folder / MARKER, json.dumps({"written_by": "lowcomm", "run": run_id,
                                            "out": str(out.resolve()) if out else None}) + "\n")


_LOCKS: dict[str, list] = {}


def lock(folder: Path, owner: str | None = None, hint: str = "choose another --out") -> str | None:
    """Hold ``folder/.lowcomm.lock`` (an flock, released when this process ends, even on SIGKILL)
    for the run keyed ``owner`` (default: ``folder``; :func:`close_run` releases it); None, or a
    line naming the run that holds it. An unwritable folder raises OSError."""
    import fcntl
    import os
    import socket
    import sys
    f = open(folder / ".lowcomm.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return f"{folder} is in use by another run ({holder}); wait for it or {hint}"
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)[:200]}\n")
    f.flush()
    _LOCKS.setdefault(str(owner or folder), []).append(f)
    return None


def usable(folder: Path) -> str | None:
    """Why ``folder`` cannot hold a run now (it cannot be created or written, or a live run
    holds its lock), or None; takes no lock (a supervisor asks before it launches the job)."""
    key = f"probe:{folder}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        problem = lock(folder, key)
    except OSError as e:
        return f"cannot use {folder} for the run: {e.strerror or e}"
    close_run(key)
    return problem


#: what ``lowcomm compare`` writes into its folder (:mod:`lowcomm.tools.compare_folder`)
COMPARE_MARKER = ".lowcomm-compare.json"


def refusal(out: Path, resume: str | Path | None, overwrite: bool,
            run_id: str | None = None) -> str | None:
    """Why a run may not use ``out`` (it holds another run that this one neither resumes nor
    replaces, or files lowcomm did not write), or None. ``run_id``: the run's own id from its
    supervisor: a folder marked with it holds this run's earlier attempt, which it replaces."""
    if (out / COMPARE_MARKER).exists():
        return (f"{out} holds a comparison (lowcomm compare's {COMPARE_MARKER}, results.json): a "
                "run there would mix its files with the comparison's, which could then no longer "
                "be extended; choose another --out")
    if resume is not None and Path(resume).resolve() == out.resolve():
        return None
    present = [f for f in RUN_FILES if (out / f).exists()]
    if not present:
        return None
    marker = read_marker(out)
    if marker and run_id and marker["run"] == run_id:
        return None
    if marker and marker.get("fleet"):
        return (f"{out} holds a fleet's run ({', '.join(present)}); continue it with 'lowcomm "
                f"train --dcs {marker['fleet'].get('dcs')} --resume {out}', or choose another --out")
    if not overwrite:
        return (f"{out} holds another run ({', '.join(present)}); continue it with --resume "
                f"{out}, replace it with --overwrite, or choose another --out")
    if marker is None:
        return (f"{out} holds {', '.join(present)} but no {MARKER}: lowcomm did not write them, "
                "and --overwrite removes only what lowcomm wrote; move them away or choose "
                "another --out")
    return None


def remove_checkpoints(folder: Path) -> None:
    """Remove lowcomm's checkpoints from ``folder`` (``step-*`` folders with a manifest, partial
    ``.step-*.tmp`` ones); anything else stays."""
    for p in sorted(folder.glob("step-*")):
        if p.is_dir() and p.name[5:].isdigit() and (p / "manifest.json").exists():
            shutil.rmtree(p)
    for p in folder.glob(".step-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def remove_run(out: Path) -> None:
    """Remove the files a run wrote into ``out`` (:data:`RUN_FILES`, its tracebacks), keeping
    whatever else is there (the supervisor's logs among them)."""
    for name in ("config.json", "metrics.jsonl", "summary.json", MARKER):
        (out / name).unlink(missing_ok=True)
    for p in out.glob("rank*.traceback.log"):
        p.unlink()
    ck = out / "checkpoints"
    if ck.is_dir():
        remove_checkpoints(ck)
        kept = sorted(p.name for p in ck.iterdir())
        if kept:
            log.warning("%s: kept %s (not written by lowcomm)", ck, ", ".join(kept))
        else:
            ck.rmdir()


def _claim_checkpoint_dir(ck: Path, out: Path | None, run_id: str, earlier: str | None,
                          resuming: bool) -> str | None:
    """Lock ``checkpoint.dir`` for this run and check that it is this run's: marked with
    ``run_id``, or with ``earlier`` (the run this one replaces), or unmarked and empty of
    checkpoints (or resumed from: the user says it is this run's). None or the problem."""
    ck.mkdir(parents=True, exist_ok=True)
    problem = lock(ck, str(out), "give this run its own checkpoint.dir")
    if problem:
        return problem
    owner = read_marker(ck)
    if owner is not None and owner["run"] not in (run_id, earlier):
        return (f"checkpoint.dir {ck} holds the checkpoints of another run (the run in "
                f"{owner.get('out')}); give this run its own checkpoint.dir")
    if owner is None and not resuming and checkpoint_steps(ck):
        return (f"checkpoint.dir {ck} holds checkpoints of no known run (no {MARKER}); give "
                "this run its own checkpoint.dir, or remove them")
    return None


def close_run(out) -> None:
    """Release the locks of the run in ``out`` (the end of :func:`lowcomm.run.loop.run`)."""
    for f in _LOCKS.pop(str(out), []):
        f.close()


def _prepare(cfg, out: Path | None, resume, overwrite: bool, run_id: str | None):
    """Rank 0's part of :func:`open_run`: (problem or None, the run's id)."""
    resuming_here = resume is not None and out is not None and \
        Path(resume).resolve() == out.resolve()
    rid = run_id_of(resume) if resume is not None else None
    rid = rid or run_id or new_run_id()
    earlier = None
    if out:
        try:
            out.mkdir(parents=True, exist_ok=True)
            problem = lock(out)
        except OSError as e:
            return f"cannot use {out} for the run: {e.strerror or e}", rid
        problem = problem or refusal(out, resume, overwrite, run_id)
        if problem:
            return problem, rid
        earlier = run_id_of(out) if overwrite and not resuming_here else None
    ck = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if ck is not None:
        try:
            problem = _claim_checkpoint_dir(ck, out, rid, earlier, resume is not None)
        except OSError as e:
            problem = f"cannot use checkpoint.dir {ck}: {e.strerror or e}"
        if problem:
            return problem, rid
    try:
        if out and not resuming_here and any((out / f).exists() for f in RUN_FILES):
            remove_run(out)      # replaced on request, or this run's own earlier attempt
        if ck is not None:
            owner = read_marker(ck)
            if owner is not None and owner["run"] != rid:
                remove_checkpoints(ck)                          # the replaced run's
            write_marker(ck, rid, out)
        ck_root = checkpoint_dir(cfg, out)
        for tmp in ck_root.glob(".step-*.tmp") if ck_root else ():
            shutil.rmtree(tmp, ignore_errors=True)  # a save cut short: it may hold the disk full
        if out and (not resuming_here or read_marker(out) is None):   # a resume changes
            write_marker(out, rid, out)            # nothing before its checkpoint is accepted
        if out and resume is None:
            write_config(cfg, out)
    except LowcommError as e:
        return str(e), rid
    except OSError as e:
        return f"cannot prepare {out or ck} for the run: {e.strerror or e}", rid
    return None, rid


def checkpoint_dir(cfg, out: str | Path | None) -> Path | None:
    """Where the checkpoints of the run in folder ``out`` go: ``checkpoint.dir`` when set, else
    ``<out>/checkpoints`` (None without either)."""
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path(out) / "checkpoints" if out else None


@dataclass(frozen=True)
class RunOptions:
    """Where a run writes and how it starts: its folder ``out`` (None: nothing written),
    ``progress`` (a progress bar), ``resume`` (the folder of an earlier run of this config: go on
    from its newest intact checkpoint), ``overwrite`` another run in ``out`` (only the files
    lowcomm wrote), ``run_id`` (its supervisor's id of the run, see :func:`open_run`)."""
    out: str | Path | None = None
    progress: bool = True
    resume: str | Path | None = None
    overwrite: bool = False
    run_id: str | None = None


def open_run(cfg, comm: Comm, out: str | Path | None, resume: str | Path | None = None,
             overwrite: bool = False, run_id: str | None = None):
    """Apply ``cfg.comm`` to ``comm``; return the uncharged control communicator, the output
    folder and the checkpointer (None without a folder).

    Rank 0 locks the folder for the run (a second run on it fails, naming the holder). A run
    never writes over another run's files: a folder that holds a run is refused unless this
    run resumes it, or ``overwrite`` (its lowcomm files are then removed first, if it has
    lowcomm's marker), or it holds the earlier attempt of this very run (``run_id``, from a
    supervisor). A ``checkpoint.dir`` is locked and must be this run's. A fresh run's resolved
    config is written now; a resumed run's after its checkpoint is accepted
    (:func:`write_config`). Every rank raises the same error."""
    apply_comm_settings(cfg, comm)
    ctl = comm.dup(Ledger(), "control")
    ctl.validate = False            # fixed shapes; keeps its non-blocking calls non-blocking
    out = Path(out) if out else None
    problem, rid = _prepare(cfg, out, resume, overwrite, run_id) if comm.rank == 0 else (None, None)
    if comm.size > 1:
        problem, rid = ctl.bcast_object((problem, rid))
    if problem:
        close_run(out)
        raise RunFolderError(problem)
    ck_dir = checkpoint_dir(cfg, out)
    return ctl, out, Checkpointer(ck_dir, ctl, cfg.checkpoint.keep, run=rid) if ck_dir else None


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
        write_text(r.out / "summary.json", json_text(summary))
    return summary
