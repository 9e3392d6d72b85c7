"""How a job ended, in its ranks' own words, for the supervisor that launched it.

mpirun's exit status does not say why a job ended (a job whose ranks stopped on a SIGTERM sent
to mpirun exits 1, as a crash does), so a supervised job's ranks say it themselves. The
supervisor gives each attempt ``--report-dir DIR`` and every rank writes ``DIR/rank<r>.json``:

* ``"started": true`` when it starts;
* ``"signal": "SIGTERM"`` as soon as a stop signal arrives (before the final checkpoint, so a
  rank killed while writing it has told already), ``"stopped": "SIGTERM"`` when it stopped on
  request after its final checkpoint (a rank the signal missed stops on the others' vote);
* ``"error": "ConfigError: ..."`` (the first line) when it fails, with ``"repeats": true`` for an
  error that a relaunch would meet again: a bad config or task, a checkpoint that cannot
  continue the run, a run folder it may not use. The supervisor does not retry those.

The job was stopped on request when every rank that started says so. One rank's signal is not
enough: when a rank dies (SIGKILL, a crash), mpirun ends the others with SIGTERM.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from ..errors import ConfigError, RunFolderError

_TO: dict = {"dir": None, "rank": 0}


def report_to(folder: str | Path | None, rank: int) -> None:
    """Write this rank's reports into ``folder`` (None: nowhere, an unsupervised run), starting
    with the report that it started."""
    _TO.update(dir=Path(folder) if folder else None, rank=rank)
    _update(started=True)


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


def stop_signal(signum: int) -> None:
    """Report a stop signal, as it arrives."""
    _update(signal=signal.Signals(signum).name)


def stopped(signum: int) -> None:
    """Report that this rank stopped on request (``signum``: the stop's signal)."""
    _update(stopped=signal.Signals(signum).name)


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
    """What the ranks reported: ``{"stop": the signal's name when every rank that started was
    stopped on request, else None; "signalled": whether any rank got a stop signal; "error": a
    rank's error (one that would repeat first) or None; "repeats": whether any rank's error
    would repeat}``."""
    reports = []
    for p in sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:] or 0)):
        try:
            reports.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    started = [r for r in reports if r.get("started")]
    stops = [r.get("signal") or r.get("stopped") for r in started]
    stops = stops if stops and all(stops) else []
    errors = [r for r in reports if r.get("error")]
    first = next((r for r in errors if r.get("repeats")), errors[0] if errors else None)
    return {"stop": stops[0] if stops else None,
            "signalled": any(r.get("signal") for r in reports),
            "error": first["error"] if first else None,
            "repeats": any(r.get("repeats") for r in errors)}
