"""``lowcomm compare --tune KEY=V1,V2,...``: every method at the best value of its own short sweep.

A comparison at one shared setting is unfair to the methods that setting does not suit (a sign
method at an Adam learning rate rises; DeMo's sign step at another method's rate diverges). With
``--tune``, for each method:

1. the grid is every combination of the ``--tune`` values of the keys the method has
   (:func:`applies`: ``strategy.outer_lr`` is not tuned for ddp, a ``compressor.*`` knob not for
   a method without a compressor; the table says which keys were left out, and why);
2. each point of the grid trains ``--tune-steps`` steps -- the comparison's config, then the
   method's own overrides, then the point's values; one evaluation at the end -- into
   ``OUT/tune/<method>/<point>/``;
3. the point with the lowest final eval loss wins (the final train loss where the task has no
   held-out batches). A run that failed (an error; a non-finite loss aborts it) or ended with a
   non-finite loss diverged and never wins; where every point diverged the method is failed
   with that error and not run at all;
4. the method's comparison run trains at the winning values (every round of ``--repeat``).

The cost is stated beside the results: per method and in total, the sweep's runs, steps,
compute CPU seconds (:func:`lowcomm.comm.ledger.compute_cpu_clock`, the slowest rank's) and
the driver's wall-clock (``results.json``: each method's ``tuning``; ``tuning.json``; the
table's tuning section). The sweep is not part of a method's modelled time or bytes.
"""
from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

from ..errors import ConfigError
from ..run.config import parse_override

def parse(specs) -> dict[str, list]:
    """``("lr=1e-4,3e-4", "strategy.outer_lr=0.5,0.7")`` -> ``{"lr": [0.0001, 0.0003], ...}``,
    values read as TOML literals (as ``--set`` reads them). A malformed spec, a key given twice,
    an empty or repeated value is a ValueError saying which."""
    space: dict[str, list] = {}
    for spec in specs:
        key, eq, raw = spec.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"{spec!r} must look like KEY=V1,V2,... (e.g. lr=1e-4,3e-4,1e-3)")
        if key in space:
            raise ValueError(f"{key} is given twice; give all its values in one KEY=V1,V2,...")
        items = [x.strip() for x in raw.split(",")]
        if not any(items):
            raise ValueError(f"{key} has no values; give KEY=V1,V2,...")
        if not all(items):
            raise ValueError(f"{key}={raw}: an empty value between commas")
        values = [parse_override(f"{key}={x}")[1] for x in items]
        twice = [x for x, v in zip(items, values) if values.count(v) > 1]
        if twice:
            raise ValueError(f"{key}: the value {' = '.join(twice)} is given more than once")
        space[key] = values
    return space


def grid(space: dict[str, list]) -> list[dict]:
    """Every combination of ``space``'s values, the first key's slowest; ``[{}]`` for none."""
    keys = list(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]


def label(point: dict) -> str:
    """A point as a folder name and a table cell: ``lr=0.001`` (keys joined by ``_``)."""
    return "_".join(f"{k}={_text(v)}" for k, v in point.items()) or "defaults"


def _text(v) -> str:
    """A value as text that reads back as itself: floats by their shortest exact repr."""
    return repr(v) if isinstance(v, float) else str(v).lower() if isinstance(v, bool) else str(v)


def sets(point: dict) -> list[str]:
    """A point as ``--set`` overrides (TOML literals: a string quoted)."""
    return [f"{k}={json.dumps(v) if isinstance(v, str) else _text(v)}" for k, v in point.items()]


def applies(cfg, key: str) -> str | None:
    """None where tuning ``key`` changes the run that ``cfg`` (a method's resolved config)
    describes, else why it does not: a ``strategy.X`` that none of its strategies has (every
    level of a per-level policy counted), a ``compressor.X`` knob where nothing compresses."""
    from ..run.registry import method, parse_spec
    section, _, rest = key.partition(".")
    if section == "strategy" and rest and rest != "name":
        used = [parse_spec(s)[0] for s in cfg.policy.values()] if cfg.policy else \
            [method(cfg.strategy.get("name", "syncdp"))]
        if not any(rest in m.settings.fields() for m in used):
            return f"{'/'.join(m.name for m in used)} has no setting {rest}"
    if section == "compressor" and rest and rest != "name":
        named = [cfg.strategy.get("compressor")] + \
            [parse_spec(s)[1].get("compressor") for s in cfg.policy.values()]
        if cfg.compressor.name == "none" and all(c in (None, "", "none") for c in named):
            return "it uses no compressor"
    return None


def plan(load, methods: dict[str, list[str]], space: dict[str, list], base: list[str]) -> dict:
    """Each method's sweep before anything runs: ``{method: {"keys": {key: values},
    "not_tuned": {key: why}, "points": [...]}}``. ``load(overrides)`` resolves a config
    (raising ConfigError); ``methods`` maps a method to its overrides; ``base`` the comparison's
    own. Every value is checked on every method it applies to: a bad one (a word where a
    number is needed, out of range) is a ValueError naming it, and so is a key that no method
    has."""
    out, why = {}, {}
    for m, own in methods.items():
        cfg = load([*base, *own])
        keys, skipped = {}, {}
        for key, values in space.items():
            reason = applies(cfg, key)
            if reason:
                skipped[key] = reason
                why.setdefault(key, []).append(f"{m}: {reason}")
                continue
            for v in values:
                try:
                    load([*base, *own, *sets({key: v})])
                except ConfigError as e:
                    raise ValueError(f"{key}={_text(v)} for {m}: {e}") from None
            keys[key] = values
        out[m] = {"keys": keys, "not_tuned": skipped, "points": grid(keys) if keys else []}
    for key, reasons in why.items():
        if len(reasons) == len(methods):
            raise ValueError(f"{key} is a setting of none of the methods run ({'; '.join(reasons)})")
    return out


def finite(x) -> bool:
    """Whether ``x`` is a finite number (a loss that is None, nan or inf is not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _last_line(folder: Path) -> dict:
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def outcome(record: dict, folder: Path, wall_s: float) -> dict:
    """One point's run as the sweep keeps it: status ``ok``, ``diverged`` (a non-finite final
    loss or eval loss, read from its summary.json), ``failed`` or ``interrupted``; its losses
    and what it cost (steps and compute CPU s from its summary, or from its last metrics line
    when it did not finish; ``wall_s`` measured by the driver)."""
    status, error = record["status"], record.get("error")
    summary = {}
    if status == "ok":
        summary = json.loads((folder / "summary.json").read_text())
        ev, tr = summary.get("eval_loss"), summary.get("final_loss")
        if not finite(tr) or (ev is not None and not finite(ev)):
            status, error = "diverged", f"non-finite loss (train {tr}, eval {ev})"
    last = _last_line(folder)
    return {"status": status, **({"error": error} if error else {}),
            "eval_loss": summary.get("eval_loss") if status == "ok" else None,
            "final_loss": summary.get("final_loss") if status == "ok" else None,
            "steps": summary.get("steps_done", summary.get("steps")) if summary else last.get("step", 0),
            "compute_cpu_s": summary.get("compute_cpu_s") if summary else last.get("compute_cpu_s", 0.0),
            "wall_s": round(wall_s, 3)}


def best(runs: list[dict]) -> int | None:
    """The index of the winning run: the lowest final eval loss among those that finished with
    finite losses (the lowest train loss when none has an eval loss); None when every run
    diverged or failed."""
    ok = [i for i, r in enumerate(runs) if r["status"] == "ok"]
    by_eval = [i for i in ok if finite(runs[i]["eval_loss"])]
    pool = by_eval or [i for i in ok if runs[i]["eval_loss"] is None]
    key = "eval_loss" if by_eval else "final_loss"
    return min(pool, key=lambda i: runs[i][key]) if pool else None


def cost(runs: list[dict]) -> dict:
    """What a sweep spent: runs, steps, compute CPU s and wall s (summed)."""
    return {"runs": len(runs), "steps": sum(r["steps"] or 0 for r in runs),
            "compute_cpu_s": round(sum(r["compute_cpu_s"] or 0.0 for r in runs), 3),
            "wall_s": round(sum(r["wall_s"] for r in runs), 3)}


def sweep(method: str, planned: dict, steps: int, run) -> dict:
    """Run ``method``'s points (``planned``: its entry of :func:`plan`) for ``steps`` steps each:
    ``run(point, folder_name)`` trains one and returns run_method's record. Returns the
    method's ``tuning`` record: the keys and their values, those not tuned, every run's
    outcome, the chosen point (None where every run diverged), its cost, and ``interrupted``
    when a stop ended it."""
    runs = []
    for point in planned["points"]:
        t0 = time.monotonic()
        record, folder = run(point, label(point))
        runs.append({"values": point, **outcome(record, folder, time.monotonic() - t0)})
        if record["status"] == "interrupted":
            break
    i = best(runs)
    return {"steps": steps, "keys": planned["keys"], "not_tuned": planned["not_tuned"],
            "runs": runs, "chosen": runs[i]["values"] if i is not None else None,
            "cost": cost(runs), "interrupted": runs[-1]["status"] == "interrupted" if runs else False}


def failure(tuning: dict) -> str:
    """The error of a method none of whose points finished with finite losses."""
    return "every tuned value diverged or failed (" + "; ".join(
        f"{label(r['values'])}: {r.get('error', r['status'])}" for r in tuning["runs"]) + ")"


def totals(results: list[dict]) -> dict:
    """The comparison's tuning cost: per method and summed."""
    per = {r["method"]: r["tuning"]["cost"] for r in results if r.get("tuning")}
    total = {k: sum(c[k] for c in per.values()) for k in ("runs", "steps", "compute_cpu_s", "wall_s")}
    return {"methods": per, "total": {k: v if isinstance(v, int) else round(v, 3)
                                      for k, v in total.items()}}


def table(results: list[dict]) -> str:
    """The tuning section of the comparison's table: per method the values chosen, every
    point's final eval loss (or why it lost), the keys not tuned, and the cost; then the total."""
    tuned = [r for r in results if r.get("tuning")]
    if not tuned:
        return ""
    steps = sorted({r["tuning"]["steps"] for r in tuned})
    rows = ["| method | chosen | sweep: value → final eval loss | not tuned | runs | steps | "
            "compute CPU s | wall s |", "|---" * 8 + "|"]
    for r in tuned:
        t = r["tuning"]
        chosen = label(t["chosen"]) if t["chosen"] is not None else \
            "none: the sweep was stopped" if t.get("interrupted") else \
            "none: every value diverged" if t["runs"] else "none tuned"
        cells = []
        for run in t["runs"]:
            val = run["eval_loss"] if finite(run["eval_loss"]) else run["final_loss"]
            shown = f"{val:.4f}" if run["status"] == "ok" else run["status"]
            mark = " ✓" if run["values"] == t["chosen"] else ""
            cells.append(f"{label(run['values'])}: {shown}{mark}")
        skipped = "; ".join(f"{k} ({why})" for k, why in t["not_tuned"].items()) or "–"
        c = t["cost"]
        rows.append(f"| {r['method']} | {chosen} | {', '.join(cells) or '–'} | {skipped} | "
                    f"{c['runs']} | {c['steps']} | {c['compute_cpu_s']:.1f} | {c['wall_s']:.1f} |")
    tot = totals(results)["total"]
    rows.append(f"| total | | | | {tot['runs']} | {tot['steps']} | {tot['compute_cpu_s']:.1f} | "
                f"{tot['wall_s']:.1f} |")
    return (f"\n\nTuning (--tune): each method's sweep, {'/'.join(map(str, steps))} steps a value, "
            "evaluated at its end; the lowest final eval loss (✓) won and the comparison above ran "
            "at it. A diverged or failed value never wins. The sweep's cost (compute CPU s: the "
            "slowest rank's; wall s: measured) is not in the methods' own columns.\n\n"
            + "\n".join(rows))


__all__ = ["applies", "best", "cost", "failure", "grid", "label", "outcome", "parse",
           "plan", "sets", "sweep", "table", "totals"]
