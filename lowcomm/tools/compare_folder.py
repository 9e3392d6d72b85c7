"""The folder of a comparison: what it holds, and the rules for running into it again.

``lowcomm compare`` marks its ``--out`` with ``.lowcomm-compare.json`` (the settings every method
ran with: ranks, steps, config file and its hash, overrides, launcher). Into a folder that holds
an earlier comparison it runs only what loses nothing:

* methods that are not there yet are added; the earlier methods' results are kept (one table,
  one ``results.json``), which is only meaningful with the same settings, so other settings are
  refused unless ``--overwrite`` (then the earlier comparison is replaced);
* a method that is there already is run again only with ``--overwrite`` (its record and run
  folder are replaced; the other methods' are kept);
* a method's ``--tune`` sweep (``tune/<method>/<point>/``) goes with its run: replaced with it,
  kept with it;
* a ``results.json`` without the marker was not written by ``lowcomm compare``: refused, and so
  is the folder of a training run.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunFolderError
from ..run.folder import COMPARE_MARKER, RUN_FILES, read_marker, remove_run, write_text

if TYPE_CHECKING:
    from .compare import CompareOptions

MARKER = COMPARE_MARKER
#: the runs of rounds 2… of a repeated comparison: ``repeats/<round>/<method>``
REPEATS = "repeats"
#: the ``--tune`` sweeps: ``tune/<method>/<point>`` (:mod:`lowcomm.tools.tune`)
TUNE = "tune"
#: what a comparison writes beside its methods' run folders
FILES = ("results.json", "tuning.json", "table.md", "eval_loss_vs_bytes.png", "eval_loss_vs_wall.png",
         "eval_loss_vs_modelled_wall.png", "eval_loss_vs_steps.png")


def settings(opts: CompareOptions) -> dict:
    """What makes two comparisons' results comparable: ranks, steps, the config file and its
    hash, the runs' overrides (the budget's included), datacenters, launcher, and the rounds
    and the ``--tune`` values and the sweep's steps where given."""
    config, launcher = opts.config, opts.launcher
    text = Path(config).read_bytes() if config else b""
    return {"np": opts.np, "steps": opts.steps, "config": str(config) if config else None,
            "config_sha256": hashlib.sha256(text).hexdigest() if config else None,
            "overrides": list(opts.run_overrides), "dcs": opts.dcs,
            "launcher": launcher if isinstance(launcher, (str, type(None))) else list(launcher),
            **({"repeat": opts.repeat} if opts.repeat > 1 else {}),
            **({"tune": {k: list(v) for k, v in opts.tune.items()}, "tune_steps": opts.tune_steps}
               if opts.tune else {})}


def _marker(out: Path) -> dict | None:
    try:
        m = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("settings"), dict) else None


def _differences(old: dict, now: dict) -> list[str]:
    out = []
    for k in now:
        if old.get(k) == now[k]:
            continue
        if isinstance(now[k], list) and isinstance(old.get(k), list):
            gone = [x for x in old[k] if x not in now[k]]
            new = [x for x in now[k] if x not in old[k]]
            out.append(f"{k}: {' '.join(gone) or '(none)'} then, {' '.join(new) or '(none)'} now")
        else:
            out.append(f"{k}: {old.get(k)!r} then, {now[k]!r} now")
    return out


def prepare(out: Path, now: dict, methods: list[str], overwrite: bool) -> list[dict]:
    """Check ``out`` for a comparison of ``methods`` with settings ``now`` and mark it; returns
    the earlier results to keep. Raises RunFolderError (nothing changed) when it would lose
    results; see the module's notes."""
    out.mkdir(parents=True, exist_ok=True)
    run = [f for f in RUN_FILES if (out / f).exists()]
    if run:
        raise RunFolderError(f"{out} holds a training run ({', '.join(run)}), not a comparison; "
                             "choose another --out")
    marker, results = _marker(out), out / "results.json"
    earlier: list[dict] = []
    if results.exists():
        if marker is None:
            raise RunFolderError(f"{out} holds a results.json but no {MARKER}: lowcomm compare "
                                 "did not write it; choose another --out")
        try:
            earlier = json.loads(results.read_text())
        except ValueError as e:
            raise RunFolderError(f"{results} is not readable ({e}); choose another --out") from None
    if marker is not None and marker["settings"] != now:
        diff = _differences(marker["settings"], now)
        if not overwrite:
            raise RunFolderError(f"{out} holds a comparison with other settings ({'; '.join(diff)}); "
                                 "choose another --out, or --overwrite to replace it")
        for r in earlier:                 # replaced as asked: only what lowcomm wrote
            swept = sorted((out / TUNE / r["method"]).glob("*"))
            for run in (*(folder / r["method"] for folder in (out, *sorted((out / REPEATS).glob("*")))),
                        *swept):
                if read_marker(run) is not None:
                    remove_run(run)
        for name in FILES:
            (out / name).unlink(missing_ok=True)
        earlier = []
    again = [r["method"] for r in earlier if r["method"] in methods]
    if again and not overwrite:
        raise RunFolderError(f"{out} holds results of {', '.join(again)} already: --overwrite runs "
                             "them again (the other methods' results are kept), or choose another "
                             "--out")
    write_text(out / MARKER, json.dumps({"written_by": "lowcomm compare", "settings": now},
                                        indent=1) + "\n")
    return [r for r in earlier if r["method"] not in methods]
