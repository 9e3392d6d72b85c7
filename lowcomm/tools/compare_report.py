"""What a comparison reports: modelled wall-clock, eval-loss curves, time to a target, the
table and the plots (:mod:`lowcomm.tools.compare` runs the methods)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import tune as tuning
from ..comm.ledger import Link


def _compute(record: dict, what: str) -> float:
    c = record.get("compute_cpu_s")
    if c is None or c != c:
        raise ValueError(f"{what} has no compute_cpu_s (the CPU seconds of its computation, written "
                         f"since lowcomm records them); rerun it to model its wall-clock")
    return float(c)


def modelled_wall(summary: dict, link: Link) -> float:
    """The run's computation (``compute_cpu_s``, CPU seconds: see the module docstring) plus its
    (rank 0) traffic's α–β time on ``link``. Measured wall-clock is not used."""
    rows = summary["ledger_rank0"]
    return _compute(summary, f"the summary of {summary.get('method', '?')!r}") + \
        link.seconds(rows, summary["ranks"])


def _line_modelled(line: dict, link: Link) -> float:
    ranks = line.get("ranks", 1)     # bytes are summed over the ranks, rounds their mean
    return _compute(line, f"metrics line of step {line.get('step')}") + \
        link.traffic_seconds(line["rounds"], line["bytes"] / ranks)


def curves(out: Path, result: dict) -> list[dict]:
    lines = [json.loads(x) for x in (out / result["method"] / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line["ranks"] = result["ranks"]
    return lines


def eval_curve(out: Path, result: dict, link: Link) -> list[tuple[float, float]]:
    """(modelled seconds on ``link``, eval loss) at every evaluation of a finished method, its
    final model's last."""
    pts = [(_line_modelled(ln, link), ln["eval_loss"]) for ln in curves(out, result)
           if "eval_loss" in ln and "compute_cpu_s" in ln]
    end = result.get("modelled_wall_s")
    if end is not None and tuning.finite(result.get("eval_loss")):
        pts.append((max([end, *(t for t, _ in pts)]), result["eval_loss"]))
    return pts


def time_to_target(points: list[tuple[float, float]], target: float) -> float | None:
    """The first modelled time at which the curve ``points`` reaches eval loss ``target``
    (linear between evaluations); None where it never does."""
    for i, (t, e) in enumerate(points):
        if e <= target:
            if i == 0 or points[i - 1][1] <= e:
                return t
            t0, e0 = points[i - 1]
            return t0 + (t - t0) * (e0 - target) / (e0 - e)
    return None


def add_time_to_target(out: Path, results: list[dict], link: Link, target: float | None) -> float | None:
    """Set ``time_to_target_s`` of every finished method (``target``: ddp's final eval loss
    where None and ddp finished); returns the target used."""
    ok = [r for r in results if r["status"] == "ok"]
    if target is None:
        target = next((r["eval_loss"] for r in ok if r["method"] == "ddp"), None)
    for r in ok:
        if target is not None and (out / r["method"] / "metrics.jsonl").exists():
            r["time_to_target_s"] = time_to_target(eval_curve(out, r, link), target)
    return target


def plot(out: Path, results: list[dict], link: Link, budget: float = 0.0,
         target: float | None = None) -> list[Path]:
    """Eval loss against bytes, measured and modelled wall-clock, and steps: one PNG each (the
    modelled one with the budget and the target drawn)."""
    import logging

    import matplotlib
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    axes = [("bytes", "bytes sent, all ranks", "eval_loss_vs_bytes.png", lambda ln: ln["bytes"], True),
            ("wall", "wall-clock s (measured)", "eval_loss_vs_wall.png", lambda ln: ln["wall_s"], False),
            ("modelled", f"wall-clock s (modelled, {link})", "eval_loss_vs_modelled_wall.png",
             lambda ln: _line_modelled(ln, link), False),
            ("steps", "step", "eval_loss_vs_steps.png", lambda ln: ln["step"], False)]
    written = []
    for _, xlabel, fname, x_of, logx in axes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        modelled = fname == "eval_loss_vs_modelled_wall.png"
        for r in ok:
            if modelled:            # the parameter server's lines have no CPU clock: no curve
                pts = eval_curve(out, r, link)
            else:
                pts = [(x_of(ln), ln["eval_loss"]) for ln in curves(out, r) if "eval_loss" in ln]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=r["method"])
        if modelled and budget:
            ax.axvline(budget, color="grey", linestyle=":", label=f"budget {budget:g} s")
        if modelled and target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8,
                       label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:     # no finished method: no legend to draw
            ax.legend(fontsize=8)
        ax.set_title(f"{ok[0]['ranks'] if ok else '?'} ranks, " +
                     (f"{budget:g} modelled s each" if budget else
                      f"{ok[0]['steps'] if ok else '?'} steps"))
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(out / fname)
    return written


def _spread(values: list[float], digits: int) -> str:
    """``median`` alone, or ``median (min–max)`` of several values."""
    med = f"{statistics.median(values):.{digits}f}"
    return med if len(values) < 2 else f"{med} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(results: list[dict], link: Link, budget: float = 0.0, target: float | None = None) -> str:
    """Markdown table, best eval loss first; failed and interrupted methods last with their
    error. ``budget``: the methods ran for that many modelled seconds; ``target``: the eval loss
    of the time-to-target column (``time_to_target_s`` of each result); a wall-clock ratio
    column where the results have one (``wall_ratio``, see :func:`add_wall_ratios`)."""
    ok = [r for r in results if r["status"] == "ok"]
    by_train = not any(tuning.finite(r["eval_loss"]) for r in ok)    # the task has no held-out batches
    ok.sort(key=lambda r: (r["final_loss"],) if by_train else
            (not tuning.finite(r["eval_loss"]), r["eval_loss"] if tuning.finite(r["eval_loss"]) else 0.0))
    base = next((r for r in ok if r["method"] == "ddp"), None)
    per_step = lambda r: r["bytes_total"] / r.get("steps_done", r["steps"])   # noqa: E731
    to = f" | modelled s to eval ≤ {target:.4f}²" if target is not None else ""
    ref = next((r["wall_ratio"]["to"] for r in ok if "wall_ratio" in r), None)
    by = f" | wall ÷ {ref}'s³" if ref else ""
    runs = max((len(r.get("wall_s_runs", ())) for r in ok), default=1)
    wall = f"wall s{f' (median of {runs} runs: min–max)' if runs > 1 else ''}"
    extra = bool(to) + bool(by)
    head = (f"| # | method | eval loss{f' at {budget:g} s' if budget else ''} | train loss | steps | "
            f"MB sent | ddp bytes/step ÷ bytes/step | {wall}{by} | compute CPU s | "
            f"modelled s ({link})¹{to} |\n" + "|---" * (10 + extra) + "|")
    rows = []
    for i, r in enumerate(ok, 1):
        ratio = f"{per_step(base) / per_step(r):.1f}×" if base and r["bytes_total"] else "–"
        reach = r.get("time_to_target_s")
        reach = (f" | {reach:.1f}" if reach is not None else " | not reached") if to else ""
        rel = (f" | {_spread(r['wall_ratio']['runs'], 3)}" if "wall_ratio" in r else " | –") if by else ""
        ev = f"{r['eval_loss']:.4f}" if tuning.finite(r["eval_loss"]) else "–"
        capped = "⁴" if _capped(r, budget) else ""
        rows.append(f"| {i} | {r['method']} | {ev} | {r['final_loss']:.4f} | "
                    f"{r.get('steps_done', r['steps'])}{capped} | {r['bytes_total'] / 1e6:.1f} | {ratio} | "
                    f"{_spread(r.get('wall_s_runs') or [r['wall_s']], 1)}{rel} | "
                    f"{r['compute_cpu_s']:.1f} | {r['modelled_wall_s']:.1f}{reach} |")
    rows += [f"| – | {r['method']} | {r['status']}: {r['error']} |" + " |" * (7 + extra)
             for r in results if r["status"] != "ok"]
    foot = (f"\n¹ modelled s = compute CPU s + the α–β time of the run's traffic on {link}. Compute "
            "CPU s: the slowest rank's CPU seconds of computation in its training steps (process CPU "
            "time minus the CPU time of its communication calls), which other processes on the "
            "machine do not inflate; wall s is measured and does depend on the machine's load.")
    budget_note, ranking = _ranking_notes(ok, budget, by_train)
    foot += budget_note
    if to:
        foot += (f"\n² the modelled time at which the method's eval loss first reached {target:.4f}"
                 f"{' (ddp’s final eval loss)' if base and base['eval_loss'] == target else ''}, "
                 "linear between its evaluations.")
    if by:
        foot += (f"\n³ each run's wall-clock divided by {ref}'s in the same round (the methods ran "
                 "in turn, round after round): the median ratio (min–max).")
    return "\n".join([head, *rows]) + "\n" + foot + ranking


def _capped(r: dict, budget: float) -> bool:
    """Whether the steps cap stopped a budgeted method before its modelled s reached the budget."""
    return bool(budget) and r.get("steps_done", r["steps"]) >= r["steps"] and \
        r.get("modelled_wall_s", budget) < budget


def _ranking_notes(ok: list[dict], budget: float, by_train: bool) -> tuple[str, str]:
    """The table's notes on what the ranking compares: the budget (a sentence of note ¹), and
    the notes after the others: the methods the steps cap stopped first, a task without
    held-out batches."""
    capped = [r["method"] for r in ok if _capped(r, budget)]
    reached = "Every method" if not capped else "Every method but those marked ⁴"
    budget_note = (f" {reached} trained until its modelled s reached the budget of {budget:g} s "
                   "(the final synchronisation of an outer loop can pass it).") if budget else ""
    notes = ""
    if capped:
        notes += (f"\n⁴ stopped by the steps cap ({', '.join(capped)}) before its modelled s "
                  f"reached the budget of {budget:g} s: its eval loss is not at the budget; raise "
                  "--steps.")
    if by_train and ok:
        notes += ("\nNo eval loss: the task gives no held-out batches (eval_batches), so the "
                  "methods are ranked by their final train loss.")
    elif any(not tuning.finite(r["eval_loss"]) for r in ok):
        notes += "\nMethods without an eval loss are ranked last."
    return budget_note, notes


def add_wall_ratios(results: list[dict], relative_to: str | None, ran: list[str]) -> None:
    """Set ``wall_ratio`` of every finished method of ``ran`` (the methods that ran now) that
    ran as many rounds as ``relative_to``: each round's wall-clock divided by
    ``relative_to``'s of that round. Results kept from an earlier comparison lose theirs: their
    rounds were not this comparison's."""
    for r in results:
        if r["method"] not in ran:
            r.pop("wall_ratio", None)
    ref = next((r for r in results if r["method"] == relative_to and r["status"] == "ok"), None)
    if ref is None or relative_to not in ran:
        return
    walls = ref.get("wall_s_runs") or [ref["wall_s"]]
    for r in results:
        mine = r.get("wall_s_runs") or [r.get("wall_s")]
        if r["method"] in ran and r["status"] == "ok" and len(mine) == len(walls):
            runs = [a / b for a, b in zip(mine, walls)]
            r["wall_ratio"] = {"to": relative_to, "runs": runs, "median": statistics.median(runs)}


__all__ = ["add_time_to_target", "add_wall_ratios", "curves", "eval_curve", "modelled_wall", "plot",
           "table", "time_to_target"]
