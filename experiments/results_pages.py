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
* ``step``, ``compress`` — median step time per method, compressor cost ÷ the time its bytes
  save (``scripts/bench.sh``'s runs, bundled by ``bundle-bench``: medians and ranges);
* ``projection`` — modelled seconds per step against the rank count, one line per method
  (``lowcomm project --json``; the first link);
* ``series`` — named lists of (x, y) points with axis labels, for measurements kept as tables;
  ``export-bubble FILE... DEST`` makes one from ``experiments/pipeline_bubble.py``'s outputs (one
  file a run): each schedule's measured bubble against the micro-batches, the median of the
  runs, beside the schedule's formula; ``export-largest FILE... DEST`` one from the largest-shape
  searches of ``lowcomm bench memory --max-memory-gib`` (``memory_bench.largest``'s rows, a later
  file's composition replacing an earlier's): each composition's peak per rank against the
  model's parameters, the shapes that trained and the first refused, beside the cap;

``bench-table FILE`` prints a bundled bench file's ratios as a Markdown table, each the median
of the runs with their range: all-reduce rows vs vendor MPI and vs the memcpy floor per size,
step rows vs the no-communication floor (``local``) and vs their DDP peer, compressors' cost
over the time their bytes save.
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
    from lowcomm.tools.compare_report import _line_modelled
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


def bundle_bench(folder: Path, dest: Path) -> list[Path]:
    """``scripts/bench.sh``'s runs (``<bench>-np<N>-run<I>.json`` and ``load.txt``) as one data
    file per bench and rank count: ``{"kind": bench, "ranks": N, "runs": [{"load", "rows"}]}``."""
    loads = {}
    for line in (folder / "load.txt").read_text().splitlines():
        head, _, up = line.partition(": ")
        loads[head] = up.split("load average:")[-1].strip()
    written = []
    for first in sorted(folder.glob("*-run1.json")):
        bench, np_ = first.stem.rsplit("-", 1)[0].split("-np")
        runs = []
        for f in sorted(folder.glob(f"{bench}-np{np_}-run*.json")):
            i = f.stem.rsplit("run", 1)[1]
            runs.append({"load": loads.get(f"np={np_} run={i} {bench}", "?"),
                         "rows": json.loads(f.read_text())})
        out = dest / f"bench-{bench}-np{np_}.json"
        out.write_text(json.dumps({"kind": bench, "ranks": int(np_), "runs": runs}, indent=1))
        written.append(out)
    return written


def _median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _cell(values: list[float], fmt: str = ".2f") -> str:
    if not values:
        return ""
    m, lo, hi = _median_range(values)
    return f"{m:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"


def _ratios(data: dict, key: str, ref_of, value) -> dict:
    """``{row key: {column: [one ratio per run]}}``: ``value(row) / value(ref)`` where
    ``ref_of(row, rows of the run)`` names each column's reference row (None: no column)."""
    out: dict = {}
    for run in data["runs"]:
        rows = run["rows"]
        for row in rows:
            cols = out.setdefault(key(row), {})
            for col, ref in ref_of(row, rows).items():
                if ref is not None and value(row):
                    cols.setdefault(col, []).append(value(ref) / value(row))
    return out


def bench_table(data: dict) -> str:
    """A bundled bench file's ratios (see the module's docstring), one Markdown table."""
    kind = data["kind"]
    if kind == "allreduce":
        def refs(row, rows):
            same = {r["algorithm"]: r for r in rows if r["size"] == row["size"]}
            return {"time µs": row, "vs mpi (busbw)": same.get("mpi"), "vs memcpy": same.get("memcpy")}
        table = _ratios(data, lambda r: (r["size"], r["algorithm"]), refs, lambda r: r["time_us"])
        for (size, alg), cols in table.items():       # time µs: the row's own time, not a ratio
            cols["time µs"] = [r["time_us"] for run in data["runs"] for r in run["rows"]
                               if (r["size"], r["algorithm"]) == (size, alg)]
        head = ["size", "algorithm", "time µs", "vs mpi (busbw)", "vs memcpy"]
    elif kind == "step":
        from lowcomm.tools.bench import step_peer

        def refs(row, rows):
            by = {r["strategy"]: r for r in rows}
            return {"step ms": row, "local ÷ this": by.get("local"),
                    "ddp peer ÷ this": by.get(step_peer(row["strategy"]) or "")}
        table = _ratios(data, lambda r: (r["strategy"],), refs, lambda r: r["step_ms"])
        for (name,), cols in table.items():
            cols["step ms"] = [r["step_ms"] for run in data["runs"] for r in run["rows"]
                               if r["strategy"] == name]
        head = ["strategy", "step ms", "local ÷ this", "ddp peer ÷ this"]
    elif kind == "compress":
        table = {(r["method"],): {"cost ÷ saved": [], "compress GB/s": []}
                 for r in data["runs"][0]["rows"]}
        for run in data["runs"]:
            for r in run["rows"]:
                if r.get("cost_vs_saved") is not None:
                    table[(r["method"],)]["cost ÷ saved"].append(r["cost_vs_saved"])
                table[(r["method"],)]["compress GB/s"].append(r["compress_GBps"])
        head = ["method", "compress GB/s", "cost ÷ saved"]
    else:
        raise SystemExit(f"bench-table: a bundled bench file of kind allreduce, step or compress, "
                         f"not {kind!r}")
    keys = len(next(iter(table)))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, cols in table.items():
        lines.append("| " + " | ".join([*map(str, key), *(_cell(cols.get(c, [])) for c in head[keys:])]) + " |")
    loads = ", ".join(run["load"] for run in data["runs"])
    return "\n".join(lines) + f"\n\n{data.get('ranks', 1)} ranks; median (range) of {len(data['runs'])} " \
        f"runs; load averages (1, 5, 15 min) at each run's start: {loads}"


def plot_step(data: dict, ax) -> str:
    by: dict[str, list[float]] = {}
    for run in data["runs"]:
        for row in run["rows"]:
            by.setdefault(row["strategy"], []).append(row["step_ms"])
    names = list(by)
    med, lo, hi = zip(*(_median_range(by[n]) for n in names))
    ax.barh(names, med, xerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
            capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("median step ms (bars: median of the runs, whiskers: their range)")
    return f"{data['ranks']} ranks, {len(data['runs'])} runs"


def plot_compress(data: dict, ax) -> str:
    by: dict[str, list[float]] = {}
    for run in data["runs"]:
        for row in run["rows"]:
            if row.get("cost_vs_saved") is not None:
                by.setdefault(row["method"], []).append(row["cost_vs_saved"])
    names = list(by)
    med, lo, hi = zip(*(_median_range(by[n]) for n in names))
    ax.barh(names, med, xerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
            capsize=3)
    ax.axvline(1.0, color="grey", linestyle="--", label="costs what it saves")
    ax.invert_yaxis()
    ax.set_xlabel("compress + decompress time ÷ the time its saved bytes take at 10 Gbit/s")
    return f"one process, {len(data['runs'])} runs"


def plot_allreduce(data: dict, ax) -> str:
    runs = data["runs"]
    series: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            series.setdefault(row["algorithm"], {}).setdefault(row["size"], []).append(row["busbw_GBps"])
    for alg, pts in series.items():
        sizes = sorted(pts)
        med = [statistics.median(pts[s]) for s in sizes]
        lo = [m - min(pts[s]) for m, s in zip(med, sizes)]
        hi = [max(pts[s]) - m for m, s in zip(med, sizes)]
        ax.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=alg)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size, bytes")
    ax.set_ylabel("bus bandwidth, GB/s (median and range of the runs)")
    return f"{data['ranks']} ranks, {len(runs)} runs"


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
        if "kind" not in data:          # a table's data (lowcomm bench memory --json): no plot
            continue
        kind = data["kind"]
        fig, axes = plt.subplots(1, 2 if kind == "compare" else 1,
                                 figsize=(12 if kind == "compare" else 7, 4.5))
        title = {"compare": plot_compare, "bytes-vs-ranks": plot_bytes, "allreduce": plot_allreduce,
                 "projection": plot_projection, "series": plot_series, "step": plot_step,
                 "compress": plot_compress}[kind](data, axes)
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


def export_bubble(runs: list[Path], dest: Path) -> None:
    """``pipeline_bubble.py``'s JSON lines of several runs as one ``series`` file: the median
    measured bubble per schedule and micro-batch count, and the formula."""
    rows = [json.loads(x) for f in runs for x in f.read_text().splitlines() if x.strip()]
    by: dict[tuple[str, int], list[float]] = {}
    formula: dict[int, float] = {}
    for r in rows:
        by.setdefault((r["schedule"], r["microbatches"]), []).append(r["bubble"])
        formula[r["microbatches"]] = r["formula"]
    series = {f"{s} measured (median of {len(v)})": [] for (s, _), v in by.items()}
    for (s, m), v in sorted(by.items(), key=lambda kv: kv[0][1]):
        series[f"{s} measured (median of {len(v)})"].append([m, statistics.median(v)])
    series["formula (P-1)/(M+P-1)"] = [[m, f] for m, f in sorted(formula.items())]
    P = rows[0]["ranks"]
    dest.write_text(json.dumps({"kind": "series", "x": "micro-batches M", "y": "bubble",
                                "title": f"pipeline bubble, {P} stages",
                                "series": series}, indent=1) + "\n")


def _gpt_params(shape: str, seq_len: int = 64) -> int:
    """The parameters of the byte LM's GPT of ``shape`` (``D_MODEL:N_LAYERS``), built on the meta
    device (what ``lowcomm bench memory --shapes`` trains: its 64-byte sequences)."""
    import torch

    from lowcomm.tasks.tinygpt import MODELS
    d, layers = map(int, shape.split(":"))
    with torch.device("meta"):
        model = MODELS["tinygpt"](seq_len, d, layers, max(1, d // 64))
    return sum(p.numel() for p in model.parameters())


def export_largest(files: list[Path], dest: Path) -> None:
    """The largest-shape searches as one ``series`` file (see the module docstring)."""
    import re
    rows = {r["method"]: r for f in files for r in json.loads(f.read_text())}
    params = {t["shape"]: t["params"] for r in rows.values() for t in r["tried"] if "params" in t}
    series, cap = {}, None
    for method, r in rows.items():
        cap = r["max_memory_gib"]
        pts = [[t["params"] / 1e6, t["peak_bytes"] / 2**30] for t in r["tried"] if "peak_bytes" in t]
        refused = r.get("refused") or {}
        peak = re.search(r"peak memory ([0-9.]+) GiB", refused.get("error", ""))
        if peak and refused.get("shape"):                  # the first refused: its peak
            shape = refused["shape"]
            n = params[shape] if shape in params else _gpt_params(shape)
            pts.append([n / 1e6, float(peak.group(1))])
        series[f"{method} (K={r['ranks']})"] = sorted(pts)
    xs = [x for pts in series.values() for x, _ in pts]
    series[f"cap {cap:g} GiB"] = [[min(xs), cap], [max(xs), cap]]
    dest.write_text(json.dumps({"kind": "series", "x": "parameters (millions)",
                                "y": "peak GiB per rank", "logx": True, "series": series,
                                "title": "the largest GPT each composition trains under the cap"},
                               indent=1) + "\n")


def parser() -> argparse.ArgumentParser:
    """The command line: ``export-compare FOLDER DEST``, ``plot``, ``bundle-bench FOLDER DEST``,
    ``bench-table FILE`` (the results pages' commands; tests/test_results_pages.py parses them)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-compare")
    ex.add_argument("folder", type=Path)
    ex.add_argument("dest", type=Path)
    sub.add_parser("plot")
    bb = sub.add_parser("bundle-bench")
    bb.add_argument("folder", type=Path)
    bb.add_argument("dest", type=Path)
    bt = sub.add_parser("bench-table")
    bt.add_argument("file", type=Path)
    el = sub.add_parser("export-largest")
    el.add_argument("files", type=Path, nargs="+")
    el.add_argument("dest", type=Path)
    eb = sub.add_parser("export-bubble")
    eb.add_argument("files", type=Path, nargs="+")
    eb.add_argument("dest", type=Path)
    return ap


#: what each command reads, by its argument's name (it must exist when the command runs)
READS = {"export-compare": "folder", "bundle-bench": "folder", "bench-table": "file"}


def main(argv=None) -> None:
    a = parser().parse_args(argv)
    if a.cmd == "export-compare":
        export_compare(a.folder, a.dest)
    elif a.cmd == "bench-table":
        print(bench_table(json.loads(a.file.read_text())))
    elif a.cmd == "export-largest":
        export_largest(a.files, a.dest)
    elif a.cmd == "export-bubble":
        export_bubble(a.files, a.dest)
    elif a.cmd == "bundle-bench":
        for p in bundle_bench(a.folder, a.dest):
            print(p)
    else:
        for p in plot_all():
            print(p.relative_to(ROOT))


if __name__ == "__main__":
    sys.exit(main())
