"""The results pages' data and plots (docs/results/).

    python experiments/results_pages.py export-compare runs/demo docs/results/data/methods-over-a-wan.json
    python experiments/results_pages.py plot          # docs/images/results-<name>.png from every data file

``export-compare`` bundles a ``lowcomm compare`` folder — its ``results.json`` and every method's
metrics lines that carry an eval loss — into one JSON file (kind ``compare``), so that the page's
plot can be drawn again without the run. ``plot`` draws one PNG per data file by its ``kind``:

* ``compare`` — eval loss against the modelled wall-clock on the run's link, and against bytes;
* ``bytes-vs-ranks`` — bytes per rank and step against the rank count, one line per compressor
  (``experiments/compress_scaling.py --json``);
* ``allreduce`` — bus bandwidth against message size, one line per algorithm (``lowcomm bench
  allreduce --json``, several runs: the median of the runs, with their range as error bars);
* ``projection`` — modelled seconds per step against the rank count, one line per method
  (``lowcomm project --json``; the first link);
* ``series`` — named lists of (x, y) points with axis labels, for measurements kept as tables.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "data"
IMAGES = ROOT / "docs" / "images"


def export_compare(folder: Path, dest: Path) -> None:
    results = json.loads((folder / "results.json").read_text())
    curves = {}
    for r in results:
        metrics = folder / r["method"] / "metrics.jsonl"
        if r.get("status") == "ok" and metrics.exists():
            lines = [json.loads(x) for x in metrics.read_text().splitlines()]
            curves[r["method"]] = [x for x in lines if "eval_loss" in x]
    dest.write_text(json.dumps({"kind": "compare", "results": results, "curves": curves}, indent=1))


def _modelled(line: dict, ranks: int, link: dict) -> float | None:
    """A metrics line's modelled wall-clock, by ``lowcomm compare``'s own rule."""
    from lowcomm.comm.ledger import Link
    from lowcomm.tools.compare import _line_modelled
    if "compute_cpu_s" not in line or "rounds" not in line:
        return None
    return _line_modelled({**line, "ranks": ranks}, Link(link["delay_ms"], link["rate_mbit"]))


def plot_compare(data: dict, ax_pair) -> str:
    ok = [r for r in data["results"] if r.get("status") == "ok"]
    link = ok[0]["link"]
    for r in ok:
        pts = data["curves"].get(r["method"], [])
        mod = [(_modelled(x, r["ranks"], link), x["eval_loss"]) for x in pts]
        mod = [p for p in mod if p[0] is not None]
        if mod:
            ax_pair[0].plot(*zip(*mod), marker="o", markersize=3, label=r["method"])
        if pts:
            ax_pair[1].plot([x["bytes"] for x in pts], [x["eval_loss"] for x in pts], marker="o",
                            markersize=3, label=r["method"])
    ax_pair[0].set_xlabel(f"modelled wall-clock s ({link['delay_ms']:g} ms, {link['rate_mbit']:g} Mbit/s)")
    ax_pair[1].set_xlabel("bytes sent, all ranks")
    ax_pair[1].set_xscale("log")
    for ax in ax_pair:
        ax.set_ylabel("eval loss")
    return f"{ok[0]['ranks']} ranks, {ok[0]['steps']} steps"


def plot_bytes(data: dict, ax) -> str:
    by: dict[str, list] = {}
    for res in data["results"]:
        rows = {(r["name"], r["collective"]): r["bytes"] for r in res["rows"]}
        for (name, coll), b in rows.items():
            flat = rows.get((name, "two-phase")) or rows.get((name, "all-reduce")) or b
            if coll in ("two-phase", "all-reduce") or (name, "two-phase") not in rows:
                by.setdefault(name, {})[res["K"]] = flat
    for name, pts in by.items():
        ks = sorted(pts)
        ax.plot(ks, [pts[k] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks K")
    ax.set_ylabel("bytes per rank per step")
    return f"{data['results'][0]['params']:,} parameters"


def plot_allreduce(data: dict, ax) -> str:
    runs = data["runs"]
    series: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            series.setdefault(row["algorithm"], {}).setdefault(row["bytes"], []).append(row["busbw_gbps"])
    for alg, pts in series.items():
        sizes = sorted(pts)
        med = [statistics.median(pts[s]) for s in sizes]
        lo = [m - min(pts[s]) for m, s in zip(med, sizes)]
        hi = [max(pts[s]) - m for m, s in zip(med, sizes)]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=alg)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("bus bandwidth, GB/s (median and range of the runs)")
    return f"{runs[0]['ranks']} ranks, {len(runs)} runs"


def plot_projection(data: dict, ax) -> str:
    link = data["projections"][0]["rows"][0]["link"]
    for p in data["projections"]:
        rows = [r for r in p["rows"] if r["link"] == link]
        ax.plot([r["ranks"] for r in rows], [r["seconds_per_step"] for r in rows], marker="o",
                label=p["name"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks K")
    ax.set_ylabel(f"modelled seconds per step ({link})")
    return f"{data['projections'][0]['params']:,.0f} parameters, projected"


def plot_series(data: dict, ax) -> str:
    for name, pts in data["series"].items():
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xlabel(data["x"])
    ax.set_ylabel(data["y"])
    for axis in ("x", "y"):
        if data.get(f"log{axis}"):
            getattr(ax, f"set_{axis}scale")("log")
    return data.get("title", "")


def plot_all() -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for f in sorted(DATA.glob("*.json")):
        data = json.loads(f.read_text())
        kind = data["kind"]
        fig, axes = plt.subplots(1, 2 if kind == "compare" else 1,
                                 figsize=(12 if kind == "compare" else 7, 4.5))
        title = {"compare": plot_compare, "bytes-vs-ranks": plot_bytes, "allreduce": plot_allreduce,
                 "projection": plot_projection, "series": plot_series}[kind](data, axes)
        for ax in (axes if kind == "compare" else [axes]):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        dest = IMAGES / f"results-{f.stem}.png"
        fig.savefig(dest, dpi=100)
        plt.close(fig)
        written.append(dest)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-compare")
    ex.add_argument("folder", type=Path)
    ex.add_argument("dest", type=Path)
    sub.add_parser("plot")
    a = ap.parse_args(argv)
    if a.cmd == "export-compare":
        export_compare(a.folder, a.dest)
    else:
        for p in plot_all():
            print(p.relative_to(ROOT))


if __name__ == "__main__":
    sys.exit(main())
