"""How a job ended, in its ranks' own words, for the supervisor that launched it.

mpirun's exit status does not say why a job ended (a job whose ranks stopped on a SIGTERM sent
to mpirun exits 1, as a crash does), so a supervised job's ranks say it themselves. The
supervisor gives each attempt ``--report-dir DIR`` and every rank writes ``DIR/rank<r>.json``:

* ``"stop": "SIGTERM"`` as soon as a stop signal arrives (before the final checkpoint, so a rank
  killed while writing it has told already);
* ``"error": "ConfigError: ..."`` (the first line) when it fails, with ``"repeats": true`` for an
  error that a relaunch would meet again: a bad config or task, a checkpoint that cannot
  continue the run, a run folder it may not use. The supervisor does not retry those.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from ..errors import ConfigError, RunFolderError

_TO: dict = {"dir": None, "rank": 0}


def report_to(folder: str | Path | None, rank: int) -> None:
    """Write this rank's reports into ``folder`` (None: nowhere, an unsupervised run)."""
    _TO.update(dir=Path(folder) if folder else None, rank=rank)


def _update(**entry) -> None:
    if _TO["dir"] is None:
        return
    path = _TO["dir"] / f"rank{_TO['rank']}.json"
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**old, **entry}))
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass                      # the supervisor then judges by the exit status and the log


def stop(signum: int) -> None:
    """Report a stop that was asked for (a signal)."""
    _update(stop=signal.Signals(signum).name)


def error(message: str, repeats: bool) -> None:
    """Report the error this rank ends with (its first line)."""
    _update(error=message.splitlines()[0] if message else "", repeats=repeats)


def repeats(e: BaseException) -> bool:
    """Whether a relaunch would meet ``e`` again: a bad config or task, a checkpoint that cannot
    continue the run, a run folder it may not use."""
    from ..tasks import TaskError               # late: the command line starts without torch
    from .checkpoint import CheckpointError
    return isinstance(e, (ConfigError, TaskError, CheckpointError, RunFolderError))


def read(folder: Path) -> dict:
    """What the ranks reported: ``{"stop": signal name or None, "error": the first rank's error
    or None, "repeats": whether any rank's error would repeat}``."""
    reports = []
    for p in sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0)):
        try:
            reports.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    stops = [r["stop"] for r in reports if r.get("stop")]
    errors = [r for r in reports if r.get("error")]
    first = next((r for r in errors if r.get("repeats")), errors[0] if errors else None)
    return {"stop": stops[0] if stops else None, "error": first["error"] if first else None,
            "repeats": any(r.get("repeats") for r in errors)}
