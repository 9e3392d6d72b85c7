"""Compression at scale: bytes per rank per step of every compressor at K = 2, 4, 8, 16 ranks,
for the all-gather and the two-phase collective, beside the α–β-modelled step time on two links.

For each K it runs ``launchers/local.sh -n K`` on itself (``--worker``): every rank builds the
model of the given settings (``--set``, as for ``lowcomm train``), a :class:`lowcomm.Reducer`
with SyncDP's bucketing (``strategy.bucket_mb``), and reduces random gradients with each
compressor (PowerSGD with ``start_iter = 0``: its compressed steps); the bytes are the ledger's
(``bytes_sent`` of rank 0, one step after a first one), and the α–β time of that step is
``Σ rounds·α + bytes/β`` over its ledger rows (:func:`lowcomm.comm.ledger.alpha_beta_seconds`).
``auto`` marks the variant :func:`lowcomm.compress.twophase.choose` takes on that link
(A: all-gather, 2: two-phase).

    python experiments/compress_scaling.py --ranks 2,4,8,16 \\
        --set model.d_model=32 --set model.n_layers=1 --json docs/results/data/bytes-vs-ranks.json

16 ranks on 2 cores are fine: only byte counts are measured, not seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["none", "fp16", "bf16", "int8", "qsgd", "topk", "randomk", "sign", "sign-mv", "ef-sign",
         "powersgd"]
LINKS = {"25ms/100Mbit": (25e-3, 100e6 / 8), "20us/10Gbit": (20e-6, 10e9 / 8)}


def gathered(comp) -> bool:
    """Whether a compressor's payloads are gathered (so the two-phase exchange can run it)."""
    return comp is not None and not comp.summable and comp.codec.own_exchange is None


def worker(out: str, sets: list[str]) -> None:
    import dataclasses

    import torch

    import lowcomm
    from lowcomm.strategies.sync.reducer import Reducer, ReducerSettings
    from lowcomm.compress import build_compressor
    from lowcomm.run.config import load_config
    from lowcomm.comm.ledger import Ledger
    from lowcomm.tasks.tinygpt import build_model

    torch.set_num_threads(1)
    comm = lowcomm.init()
    cfg = load_config(None, sets)
    torch.manual_seed(0)
    model = build_model(cfg)
    named = [(n, p) for n, p in reversed(list(model.named_parameters()))]
    rows = []
    for name in NAMES:
        for coll in ("allgather", "two-phase"):
            c = dataclasses.replace(cfg.compressor, name=name, collective=coll, start_iter=0)
            comp = build_compressor(c)
            if coll == "two-phase" and not gathered(comp):
                continue
            run = comm.dup(Ledger())
            how = ReducerSettings(bucket_bytes=int(cfg.strategy.get("bucket_mb", 4.0) * 2**20),
                                  overlap=False)
            red = Reducer(run, named, how, compressor=comp)
            red._thread_comm.validate = False
            for step in range(2):
                run.ledger.reset()
                g = torch.Generator().manual_seed(100 * step + comm.rank)
                for n, p in named:
                    red.ready(n, torch.randn(p.shape, generator=g))
                red.flush()
            red.close()
            rows.append({"name": name, "collective": coll if gathered(comp)
                         else "all-reduce", "rows": run.ledger.rows(),
                         "bytes": sum(r["bytes_sent"] for r in run.ledger.rows()),
                         "buckets": [b.flat.numel() for b in red.buckets]})
    if comm.rank == 0:
        Path(out).write_text(json.dumps({"K": comm.size, "params": sum(p.numel() for _, p in named),
                                         "rows": rows}))


def measure(K: int, sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = [str(ROOT / "launchers" / "local.sh"), "-n", str(K), sys.executable, __file__,
                "--worker", out] + [a for s in sets for a in ("--set", s)]
        subprocess.run(args, check=True, cwd=ROOT, timeout=900)
        return json.loads(Path(out).read_text())


def auto_pick(name: str, sets: list[str], buckets: list[int], K: int, link) -> str:
    import dataclasses

    import torch

    from lowcomm.compress import build_compressor
    from lowcomm.compress.twophase import predicted_seconds
    from lowcomm.run.config import load_config
    cfg = load_config(None, sets)
    comp = build_compressor(dataclasses.replace(cfg.compressor, name=name))
    if not gathered(comp):
        return ""
    picks = set()
    for n in buckets:
        t = predicted_seconds(comp, n, torch.float32, K, link)
        picks.add("2" if t["two-phase"] < t["allgather"] else "A")
    return "/".join(sorted(picks))


def table(results: list[dict], sets: list[str]) -> str:
    from lowcomm.comm.ledger import alpha_beta_seconds
    head = ["compressor", "K", "all-gather B/rank", "two-phase B/rank", "dense ÷ two-phase",
            "8K ÷ 2K"] + [f"{lk} ms (A / 2; auto)" for lk in LINKS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(res["K"], r["name"], r["collective"]): r for res in results for r in res["rows"]}
    Ks = [res["K"] for res in results]
    for name in NAMES:
        for res in results:
            K = res["K"]
            dense = by[K, "none", "all-reduce"]["bytes"]
            ag = by.get((K, name, "allgather")) or by[K, name, "all-reduce"]
            tp = by.get((K, name, "two-phase"))
            flat = (tp or ag)["bytes"]
            ratio8 = ""
            if K == 8 and 2 in Ks:
                r2 = by.get((2, name, "two-phase")) or by.get((2, name, "allgather")) or \
                    by[2, name, "all-reduce"]
                ratio8 = f"{flat / r2['bytes']:.2f}"
            cells = [name, str(K), f"{ag['bytes']:,}", f"{tp['bytes']:,}" if tp else "–",
                     f"{dense / flat:.1f}", ratio8]
            for link in LINKS.values():
                ta = alpha_beta_seconds(ag["rows"], K, *link) * 1e3
                if tp:
                    t2 = alpha_beta_seconds(tp["rows"], K, *link) * 1e3
                    pick = auto_pick(name, sets, ag["buckets"], K, link)
                    cells.append(f"{ta:.2f} / {t2:.2f}; {pick}")
                else:
                    cells.append(f"{ta:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8,16")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--json", help="also write the measurements here (for the results page's plot)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.sets)
        return
    results = [measure(int(k), a.sets) for k in a.ranks.split(",")]
    if a.json:
        Path(a.json).write_text(json.dumps({"kind": "bytes-vs-ranks", "settings": a.sets,
                                            "results": results}, indent=1))
    print(f"parameters: {results[0]['params']:,} (float32), settings: {' '.join(a.sets) or 'defaults'}")
    print(table(results, a.sets))


if __name__ == "__main__":
    main()
