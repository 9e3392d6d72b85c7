#!/usr/bin/env bash
# `make test-slurm`: run launchers/slurm.sbatch on a real, throw-away, single-node Slurm on this
# machine, and check that the job succeeds and writes its summary. Needs root (Debian 12).
#   1. installs Debian's slurm-wlm 22.05, munge and libpmix-dev when missing (Slurm's mpi/pmix
#      plugin dlopens libpmix.so, which only the -dev package provides);
#   2. writes slurm.conf for this host (its real name, CPUs and memory, from `slurmd -C`) and a
#      munge key under $LOWCOMM_SLURM_DIR (default /tmp/lowcomm-slurm), and starts its own munged
#      (own socket), slurmctld and slurmd on ports $LOWCOMM_SLURM_PORT and +1 (default
#      16817/16818). Nothing under /etc is read or written; all of it is stopped on exit, failure
#      or Ctrl-C included. With fewer CPUs than $NP (default 4) the node is declared with $NP CPUs,
#      so that $NP ranks fit, oversubscribed;
#   3. submits, from the repository root and with .venv NOT on PATH (as a user would),
#        sbatch -N1 -n$NP launchers/slurm.sbatch --set steps=$STEPS --quiet --out runs/slurm/run
#      (plus --set task=$SLURM_TEST_TASK when that is set), waits at most $SLURM_TEST_TIMEOUT
#      seconds (default 600), then checks JobState=COMPLETED, ExitCode=0:0, and
#      runs/slurm/run/summary.json with ranks=$NP and steps=$STEPS (default 20);
#   4. submits once from a folder that is no lowcomm checkout and checks that the job fails with
#      the launcher's own error (not a Python traceback).
# Idempotent: each run starts from a clean Slurm state; the logs stay in $LOWCOMM_SLURM_DIR/log
# until the next run.
#   scripts/slurm_test.sh up     only starts that Slurm and leaves it running, to try things in:
#                                  export SLURM_CONF=/tmp/lowcomm-slurm/slurm.conf; sinfo; sbatch ...
#   scripts/slurm_test.sh down   stops it.
set -euo pipefail
MODE=${1:-test}
case "$MODE" in test|up|down) ;; *) echo "usage: $0 [test|up|down]" >&2; exit 2 ;; esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
D=${LOWCOMM_SLURM_DIR:-/tmp/lowcomm-slurm}
PORT=${LOWCOMM_SLURM_PORT:-16817}
NP=${NP:-4}
STEPS=${STEPS:-20}
TIMEOUT=${SLURM_TEST_TIMEOUT:-600}
OUT=${SLURM_TEST_OUT:-$ROOT/runs/slurm}

log() { printf '[slurm-test] %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (it installs packages and runs slurmd as root)"
[ -x "$ROOT/.venv/bin/python" ] || die "$ROOT/.venv is missing: run 'make setup' first"
case "$D" in /|/etc*|/usr*|/var*|"$HOME") die "LOWCOMM_SLURM_DIR=$D: choose a folder of its own" ;; esac

# 1. packages -------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null || ! dpkg -s libpmix-dev >/dev/null 2>&1; then
    log "installing slurm-wlm, munge and libpmix-dev from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge libpmix-dev >/dev/null
fi

# 2. a private Slurm ------------------------------------------------------------------------------
CONF=$D/slurm.conf
export SLURM_CONF=$CONF

# Stop what a pid file in $D names, if that process is still the daemon we started.
stop_pidfile() {
    local f=$1 name=$2 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null || true)
    if [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$name" ]; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}
stop_all() {
    if [ -f "$CONF" ] && [ -f "$D/run/slurmctld.pid" ]; then
        scancel --user=root >/dev/null 2>&1 || true
        # let the jobs' steps end (slurmstepd kills their ranks) before slurmd goes
        for _ in $(seq 45); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 1; done
    fi
    stop_pidfile "$D/run/slurmd.pid" slurmd
    stop_pidfile "$D/run/slurmctld.pid" slurmctld
    stop_pidfile "$D/run/munged.pid" munged
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    log "stopping slurmd, slurmctld and munged (logs stay in $D/log)"
    stop_all
    exit "$rc"
}

stop_all                     # leftovers of an interrupted earlier run
[ "$MODE" = down ] && { log "stopped"; exit 0; }
trap cleanup EXIT
trap 'exit 130' INT TERM
rm -rf "$D/state" "$D/spool" "$D/run" "$D/tmp" "$D/log"
mkdir -p "$D/state" "$D/spool" "$D/run" "$D/tmp" "$D/log" "$D/munge"
chmod 755 "$D" "$D/run"      # munged wants its socket folder searchable by all
chmod 700 "$D/munge"

if [ ! -s "$D/munge/munge.key" ]; then
    dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 400 "$D/munge/munge.key"
MUNGE_SOCKET=$D/run/munge.socket
munged --socket="$MUNGE_SOCKET" --key-file="$D/munge/munge.key" --pid-file="$D/run/munged.pid" \
       --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed" \
    || die "munged did not start; see $D/log/munged.log"

NODE=$(slurmd -C | head -1)            # NodeName=<host> CPUs=... RealMemory=... (this machine)
HOST=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$NODE")
CPUS=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$NODE")
MEM=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE")
[ -n "$HOST" ] && [ -n "$CPUS" ] && [ -n "$MEM" ] || die "cannot read 'slurmd -C': $NODE"
OVERRIDE=""
if [ "$CPUS" -lt "$NP" ]; then
    # The launcher asks for --ntasks-per-node=N --cpus-per-task=1, which no option (not even
    # --overcommit) fits on fewer than N CPUs: declare N CPUs, and let slurmd accept the
    # difference (config_overrides) instead of draining the node.
    NODE="NodeName=$HOST CPUs=$NP RealMemory=$MEM"
    OVERRIDE="SlurmdParameters=config_overrides"
    log "this machine has $CPUS CPUs; the node is declared with $NP so that $NP ranks fit (oversubscribed)"
fi
: > "$D/plugstack.conf"
cat > "$CONF" <<EOF
# Written by scripts/slurm_test.sh: a single-node Slurm for lowcomm's launcher test.
ClusterName=lowcomm-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
TmpFS=$D/tmp
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
PlugStackConfig=$D/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=600
$OVERRIDE
$NODE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=lowcomm Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

slurmctld -i || die "slurmctld did not start; see $D/log/slurmctld.log"
slurmd || die "slurmd did not start; see $D/log/slurmd.log"
for i in $(seq 60); do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
    [ "$state" = idle ] && break
    [ "$i" = 60 ] && die "node $HOST is '${state:-unreachable}' after 30 s; see $D/log/slurm*.log"
    sleep 0.5
done
log "Slurm up: $(sinfo -h -o '%P %D %T %c cpus %m MB' | head -1); srun --mpi=list: $(srun --mpi=list 2>&1 | tr -s '\n ' ' ')"

if [ "$MODE" = up ]; then
    trap - EXIT INT TERM
    log "left running: export SLURM_CONF=$CONF; stop it with: $0 down"
    exit 0
fi

# 3. the launcher with a training job -------------------------------------------------------------
# A user's shell: no .venv on PATH, no active virtualenv, no PYTHONPATH.
USER_PATH=$(tr ':' '\n' <<<"$PATH" | grep -v -e '/\.venv/bin$' -e "^${VIRTUAL_ENV:-/nonexistent}/bin\$" | paste -sd: -)
RUN=$OUT/run
rm -rf "$OUT"
mkdir -p "$OUT"
args=(--set "steps=$STEPS" --quiet --out "$RUN")
[ -n "${SLURM_TEST_TASK:-}" ] && args+=(--set "task=$SLURM_TEST_TASK")

# Wait for job $1 to end (at most $TIMEOUT s); set STATE and CODE (its JobState and ExitCode).
wait_job() {
    local id=$1 t0=$SECONDS info
    while :; do
        info=$(scontrol show job "$id" 2>/dev/null || true)
        STATE=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | cut -d= -f2 || true)
        CODE=$(grep -o ' ExitCode=[0-9:]*' <<<"$info" | cut -d= -f2 || true)
        case "$STATE" in
            PENDING|CONFIGURING|RUNNING|COMPLETING|"") ;;
            *) return 0 ;;
        esac
        if [ $((SECONDS - t0)) -ge "$TIMEOUT" ]; then
            scancel "$id" || true
            STATE="TIMEOUT(${TIMEOUT}s)" CODE=-
            return 0
        fi
        sleep 2
    done
}

cd "$ROOT"
log "submitting: sbatch -N1 -n$NP launchers/slurm.sbatch ${args[*]}"
JOB=$(env -u VIRTUAL_ENV -u PYTHONPATH PATH="$USER_PATH" sbatch --parsable -N1 -n"$NP" \
      --job-name=lowcomm-test --output="$OUT/slurm-%j.out" launchers/slurm.sbatch "${args[@]}")
wait_job "$JOB"
log "job $JOB: JobState=$STATE ExitCode=$CODE; its output ($OUT/slurm-$JOB.out), last 25 lines:"
tail -n 25 "$OUT/slurm-$JOB.out" >&2 || true
[ "$STATE" = COMPLETED ] && [ "$CODE" = 0:0 ] || die "job $JOB ended $STATE $CODE (logs: $D/log, $OUT)"
[ -s "$RUN/summary.json" ] || die "job $JOB completed but wrote no $RUN/summary.json"
"$ROOT/.venv/bin/python" - "$RUN/summary.json" "$NP" "$STEPS" <<'EOF' || die "bad summary"
import json, math, sys
s = json.load(open(sys.argv[1]))
want = {"ranks": int(sys.argv[2]), "steps": int(sys.argv[3])}
bad = {k: (s.get(k), v) for k, v in want.items() if s.get(k) != v}
assert not bad, f"summary.json (got, want): {bad}"
assert math.isfinite(s["final_loss"]), s["final_loss"]
print(f"[slurm-test] summary.json: method={s['method']} ranks={s['ranks']} steps={s['steps']} "
      f"final_loss={s['final_loss']:.4f} bytes_total={s['bytes_total']}", file=sys.stderr)
EOF

# 4. no checkout to be found: the launcher's own error ------------------------------------------
ELSEWHERE=$D/elsewhere
mkdir -p "$ELSEWHERE"
BAD=$(cd "$ELSEWHERE" && env -u VIRTUAL_ENV -u PYTHONPATH -u LOWCOMM_ROOT PATH="$USER_PATH" sbatch --parsable -N1 -n1 \
      --job-name=lowcomm-test-nocheckout --output="$OUT/slurm-%j.out" "$ROOT/launchers/slurm.sbatch" --quiet)
wait_job "$BAD"
grep -q 'no lowcomm checkout' "$OUT/slurm-$BAD.out" && [ "$STATE" = FAILED ] \
    || die "job $BAD submitted outside a checkout ended $STATE $CODE without the launcher's error: $(cat "$OUT/slurm-$BAD.out")"
log "job $BAD (submitted from $ELSEWHERE): $STATE as expected: $(head -1 "$OUT/slurm-$BAD.out")"

log "PASS: launchers/slurm.sbatch on $NP ranks under Slurm ($OUT)"
