#!/usr/bin/env bash
# The speed benchmarks, each side by side with its references in one run: all-reduce (lowcomm's
# algorithms and auto against vendor MPI, Horovod, gloo and a memcpy), the training step (SyncDP,
# fp16, int8, PowerSGD against torch DDP on gloo and its hooks, Horovod, and the no-communication
# floor) and the compressors (GB/s beside a memcpy, cost against the time their bytes save).
# RUNS runs (default 3) at each rank count in RANKS (default "2 4": 2 is the reference, one core
# per rank on a 2-core machine; at 4 the ranks share cores), each run's `uptime` load recorded.
# Writes runs/bench/<bench>-np<N>-run<I>.json and runs/bench/load.txt, then one data file per
# bench and rank count in $OUT (default runs/bench/data) for experiments/results_pages.py.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
RANKS=${RANKS:-"2 4"}
DIR=runs/bench
OUT=${OUT:-$DIR/data}
mkdir -p "$DIR" "$OUT"
: > "$DIR/load.txt"
for np in $RANKS; do
    for i in $(seq 1 "$RUNS"); do
        for bench in allreduce step; do
            echo "np=$np run=$i $bench: $(uptime)" | tee -a "$DIR/load.txt"
            launchers/local.sh -n "$np" lowcomm bench "$bench" --json "$DIR/$bench-np$np-run$i.json"
        done
    done
done
for i in $(seq 1 "$RUNS"); do        # one process: the compressors' own arithmetic
    echo "np=1 run=$i compress: $(uptime)" | tee -a "$DIR/load.txt"
    OMP_NUM_THREADS=1 LOWCOMM_NUM_THREADS=1 lowcomm bench compress --json "$DIR/compress-np1-run$i.json"
done
python experiments/results_pages.py bundle-bench "$DIR" "$OUT"
