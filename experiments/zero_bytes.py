"""Bytes per rank per step of SyncDP, ZeRO-1/2 and ZeRO++ on the default task, from the ledger.

Run under mpirun at each rank count (byte counts do not depend on the machine's load):

    for K in 2 4 8; do launchers/local.sh -n $K python experiments/zero_bytes.py \
        --json docs/results/data/zero-bytes-np$K.json; done

Prints, per method, the bytes each rank sent per step (all levels), the ratio to SyncDP's, and
the paper's formula for it (Wang et al. 2023: reduce-scatter + all-gather = 2(K−1)/K·4N dense;
qgZ replaces the reduce-scatter's 4 bytes per element by 1 (int8) or 1/2 (int4) plus a 4-byte
scale per 2048 elements, qwZ the all-gather's by 1 plus the scales).
"""
import argparse
import json

import lowcomm
from lowcomm.comm.ledger import Ledger

METHODS = {"syncdp": (4, 4), "zero1": (4, 4), "zero2": (4, 4), "zero2:qgz=int8": (1, 4),
           "zero2:qgz=int4": (0.5, 4), "zero2:qgz=int8,qwz=int8": (1, 1),
           "zero2:qgz=int4,qwz=int8": (0.5, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = lowcomm.init()
    K, rows = comm.size, []
    for spec in METHODS:            # two runs: what the longer one sent more is its extra steps'
        total = []                  # (the start's broadcast and the end cancel out)
        for steps in (args.steps, 2 * args.steps):
            s = lowcomm.train("lowcomm.tasks.bytelm", strategy=spec, steps=steps,
                              set=["eval_batches=0", f"log_every={args.steps}", "optimizer.name=adamw"],
                              comm=comm.dup(Ledger()))          # a ledger of its own
            total.append(s["bytes_total"])
        rows.append({"method": spec, "ranks": K,
                     "sent_per_step": (total[1] - total[0]) / K / args.steps})
    N = 437_760
    base = rows[0]["sent_per_step"]
    for r in rows:
        g, w = METHODS[r["method"]]
        scales = 4 / 2048 if g < 4 else 0
        wscales = 4 / 2048 if w < 4 else 0
        r["formula"] = (K - 1) / K * N * (g + scales + w + wscales)
        r["vs_syncdp"] = r["sent_per_step"] / base
    if comm.rank == 0:
        print(f"| method | K | sent B/rank/step | paper's formula | ÷ syncdp |\n|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['method']} | {K} | {r['sent_per_step']:,.0f} | {r['formula']:,.0f} | {r['vs_syncdp']:.3f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
