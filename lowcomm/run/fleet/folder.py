"""A fleet's run folder (:mod:`lowcomm.run.fleet`): its lock, its marker, and the rules for
reusing it — those of a single run's folder (:mod:`lowcomm.run.folder`), for what a fleet
writes.

``OUT`` holds the fleet's files (:data:`FLEET_FILES`) and one run folder per launch of a
datacenter's job (``dc<i>``, ``dc<i>.<k>``). Its marker is a single run's with a ``fleet``
entry: ``{"dcs", "np", "args", "folders": [{"dc", "inc", "folder"}, ...]}`` — the launch
arguments (what ``--resume`` continues with) and every folder the fleet made, added as it
makes them. Rules:

* the fleet holds ``OUT``'s lock while it runs: a second fleet or run on ``OUT`` (with
  ``--overwrite`` or not) is refused naming the holder, and so is one while a datacenter's
  folder is still locked by a job;
* a folder that holds a run (a fleet's or a single run's: its files, or its marker) is refused
  unless resumed or replaced with ``--overwrite``;
* ``--overwrite`` removes only what a fleet of lowcomm wrote, by its marker: the fleet's files
  and the folders its marker names (each only of what lowcomm writes there); never anything
  else (a user's ``dc2023_backup/`` stays); a single run's folder, or one without a marker, is
  refused.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ...errors import RunFolderError
from ..folder import (MARKER, RUN_FILES, close_run, lock, read_marker, remove_run, usable,
                     write_text)

log = logging.getLogger("lowcomm.fleet")

#: the files a fleet writes into its folder, beside the datacenters' folders
FLEET_FILES = ("summary.json", "metrics.jsonl", "membership.jsonl", "coordinator.log")

#: what the fleet writes into a datacenter's folder beside the run's own files
JOB_FILES = ("stdout.log", "stderr.log", ".reports", ".lowcomm.lock")


def lock_key(out: Path) -> str:
    return f"fleet:{Path(out).resolve()}"


def fleet_of(out: Path) -> dict | None:
    """The ``fleet`` entry of ``out``'s marker, or None (no marker, or a single run's)."""
    m = read_marker(out)
    return m.get("fleet") if m and isinstance(m.get("fleet"), dict) else None


def folders(out: Path) -> list[dict]:
    """The datacenters' folders the fleet in ``out`` made: ``{"dc", "inc", "folder"}`` each."""
    f = fleet_of(out)
    return [x for x in (f or {}).get("folders", []) if (Path(out) / x["folder"]).parent == Path(out)]


def claim(out: Path, overwrite: bool, resume: bool) -> None:
    """Lock ``out`` for this fleet (held until :func:`lowcomm.run.folder.close_run` of
    :func:`lock_key`) and check that it may be used (module docstring); with ``overwrite``,
    remove the run it holds. A RunFolderError says why not."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        problem = lock(out, lock_key(out))
    except OSError as e:
        raise RunFolderError(f"cannot use {out} for the fleet: {e.strerror or e}") from None
    if problem:
        raise RunFolderError(problem)
    try:
        _check(out, overwrite, resume)
    except BaseException:
        close_run(lock_key(out))
        raise


def _check(out: Path, overwrite: bool, resume: bool) -> None:
    mine = folders(out)
    for x in mine:
        busy = usable(out / x["folder"]) if (out / x["folder"]).is_dir() else None
        if busy:
            raise RunFolderError(busy)
    marker = read_marker(out)
    present = sorted({*(f for f in (*RUN_FILES, *FLEET_FILES) if (out / f).exists()),
                      *(x["folder"] for x in mine if (out / x["folder"]).exists())})
    if resume:
        if fleet_of(out) is None:
            raise RunFolderError(f"--resume {out}: no fleet's run there (no {MARKER} of a fleet)"
                                 + ("; it holds a single run: resume it without --dcs"
                                    if marker else ""))
        try:
            ended = json.loads((out / "summary.json").read_text())
        except (OSError, ValueError):
            ended = None                     # stopped before its summary, or failed
        if ended is not None and not ended.get("stopped"):
            raise RunFolderError(f"--resume {out}: the fleet there finished (summary.json); "
                                 "nothing to continue, and a finished run is never changed")
        return
    if not present and marker is None:
        return
    if not overwrite:
        what = "a fleet's run" if fleet_of(out) is not None else "another run"
        raise RunFolderError(f"{out} holds {what} ({', '.join(present) or MARKER}); continue it "
                             f"with --resume {out}, replace it with --overwrite, or choose "
                             "another --out")
    if marker is None:
        raise RunFolderError(f"{out} holds {', '.join(present)} but no {MARKER}: lowcomm did not "
                             "write them, and --overwrite removes only what lowcomm wrote; move "
                             "them away or choose another --out")
    if fleet_of(out) is None:
        raise RunFolderError(f"{out} holds a single run ({', '.join(present)}), not a fleet's: "
                             "a fleet's --overwrite replaces only a fleet's run; choose another "
                             "--out (or replace that run with a single run's --overwrite)")
    remove(out)


def remove(out: Path) -> None:
    """Remove the fleet's run lowcomm wrote into ``out`` (by its marker), keeping everything
    else."""
    for x in folders(out):
        f = out / x["folder"]
        if f.is_dir():
            remove_run(f)
            for name in JOB_FILES:
                p = f / name
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
            try:
                f.rmdir()
            except OSError:
                log.warning("%s: kept %s (not written by lowcomm)", f,
                            ", ".join(sorted(p.name for p in f.iterdir())))
    for name in ("membership.jsonl", "coordinator.log"):
        (out / name).unlink(missing_ok=True)
    remove_run(out)                    # the fleet's summary, metrics and marker


def mark(out: Path, run_id: str, entry: dict) -> None:
    """Write ``out``'s marker for the fleet ``run_id`` with its ``fleet`` ``entry``."""
    write_text(out / MARKER, json.dumps({"written_by": "lowcomm", "run": run_id,
                                         "out": str(out.resolve()), "fleet": entry}) + "\n")


__all__ = ["FLEET_FILES", "claim", "fleet_of", "folders", "lock_key", "mark", "remove"]
