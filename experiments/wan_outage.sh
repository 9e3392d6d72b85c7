#!/usr/bin/env bash
# DiLoCo over 2 emulated datacenters x 2 ranks (25 ms one-way, 100 Mbit/s)
# survives a 10 s outage of the inter-datacenter link mid-run with no person acting.
#
# Brings a WAN up, trains the same DiLoCo run twice through launchers/wan.sh — once untouched
# ("ref"), once with the link 0-1 taken down for 10 s (`lowcomm wan fault --link 0-1 --down 10s`,
# its packets dropped: TCP retransmits once it is back) as soon as the run's metrics reach step
# FAULT_AT — and prints both runs' eval loss, wall-clock, state_sha256, the packets the outage
# dropped and `uptime`. Takes the WAN down at the end (also on failure or Ctrl-C). Root.
#
# usage: flock /tmp/lowcomm-wan-helper.lock experiments/wan_outage.sh [OUT] [--set KEY=VALUE]...
#   (default OUT runs/wan-outage; STEPS=300 PERIOD=50 FAULT_AT=100 DOWN=10s in the environment)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ -x .venv/bin/python ] && export PATH="$ROOT/.venv/bin:$PATH"
OUT=${1:-runs/wan-outage}
[ $# -gt 0 ] && shift
STEPS=${STEPS:-300} PERIOD=${PERIOD:-50} FAULT_AT=${FAULT_AT:-100} DOWN=${DOWN:-10s}
SETS=(--set strategy.name=diloco --set "strategy.period=$PERIOD" --set "steps=$STEPS" --set log_every=10 "$@")
LC=(python -m lowcomm.cli)

[ -e "$OUT/ref" ] || [ -e "$OUT/fault" ] && { echo "$0: $OUT already holds runs; choose another OUT" >&2; exit 2; }
mkdir -p "$OUT"
"${LC[@]}" wan up --dcs 2 --delay-ms 25 --rate-mbit 100 >&2
trap '"${LC[@]}" wan down >/dev/null' EXIT

echo "ref: $(uptime)" | tee "$OUT/uptime.txt"
t0=$SECONDS
launchers/wan.sh -n 4 --dcs 2 lowcomm train --quiet --out "$OUT/ref" "${SETS[@]}"
echo "ref: process wall $((SECONDS - t0)) s" | tee -a "$OUT/uptime.txt"

echo "fault: $(uptime)" | tee -a "$OUT/uptime.txt"
t0=$SECONDS
launchers/wan.sh -n 4 --dcs 2 lowcomm train --quiet --out "$OUT/fault" "${SETS[@]}" &
run=$!
# the outage starts once the run is FAULT_AT steps in: mid-run, whatever the machine's load
until [ -f "$OUT/fault/metrics.jsonl" ] && \
      python -c "import json,sys; sys.exit(0 if any(json.loads(l)['step'] >= $FAULT_AT for l in open('$OUT/fault/metrics.jsonl') if l.strip()) else 1)" 2>/dev/null; do
    kill -0 "$run" 2>/dev/null || { echo "$0: the run ended before step $FAULT_AT" >&2; exit 1; }
    sleep 0.5
done
"${LC[@]}" wan fault --link 0-1 --down "$DOWN" | tee "$OUT/fault.txt"
wait "$run"
echo "fault: process wall $((SECONDS - t0)) s" | tee -a "$OUT/uptime.txt"
"${LC[@]}" wan status > "$OUT/wan_status.json"

python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
ref, got = (json.loads((out / r / "summary.json").read_text()) for r in ("ref", "fault"))
faults = json.loads((out / "wan_status.json").read_text())["faults"]
print(f"{'run':6} {'eval loss':>10} {'wall s':>8} {'state_sha256':>16}")
for name, s in (("ref", ref), ("fault", got)):
    print(f"{name:6} {s['eval_loss']:10.4f} {s['wall_s']:8.1f} {s['state_sha256'][:16]:>16}")
print(f"eval loss difference: {abs(got['eval_loss'] - ref['eval_loss']) / ref['eval_loss'] * 100:.3f} %; "
      f"parameters {'identical' if got['state_sha256'] == ref['state_sha256'] else 'DIFFERENT'}; "
      f"outage: {faults[0]['what']}, {faults[0]['packets']} packets dropped")
EOF
cat "$OUT/uptime.txt"
