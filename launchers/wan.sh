#!/usr/bin/env bash
# Run COMMAND on N ranks spread over D emulated datacenters (network namespaces lowcomm-dc<i>
# joined by lowcomm's delaying, rate-limiting forwarder; see lowcomm/tools/wan.py). Ranks of one
# datacenter share its namespace and hostname (so Open MPI uses shared memory inside it) and
# talk TCP over the emulated WAN to the others. Datacenter i gets the ranks of block i
# (N/D each, the first N%D one more); $LOWCOMM_TOPOLOGY is set to match unless already set.
#
# If no WAN is up, this brings one up with --delay-ms/--rate-mbit/--link/--mtu and takes it
# down again when COMMAND ends, fails or is interrupted; a WAN already up (lowcomm wan up) is
# used as it is and left up. Needs root. --fault KIND:LINK[:...] (repeatable) schedules a fault
# from the moment the WAN is up (e.g. down:0-1:at=20s:for=10s; see 'lowcomm wan up --help').
# usage: launchers/wan.sh -n N --dcs D [--delay-ms 25] [--rate-mbit 100] [--link a,b,ms,mbit]...
#                         [--mtu 9000] [--fault SPEC]... [--] COMMAND [ARGS...]
set -euo pipefail
usage() { echo "usage: $0 -n N --dcs D [--delay-ms MS] [--rate-mbit MBIT] [--link a,b,ms,mbit]... [--mtu B] [--fault SPEC]... [--] COMMAND..." >&2; exit 2; }
N="" D="" UPARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--np) [ $# -ge 2 ] || usage; N=$2; shift 2 ;;
        --dcs) [ $# -ge 2 ] || usage; D=$2; shift 2 ;;
        --delay-ms|--rate-mbit|--link|--mtu|--queue-kb|--fault) [ $# -ge 2 ] || usage; UPARGS+=("$1" "$2"); shift 2 ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ -n "$N" ] && [ -n "$D" ] && [ $# -gt 0 ] || usage
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "$0: -n needs a positive rank count, got '$N'" >&2; exit 2; }
[[ "$D" =~ ^[1-9][0-9]*$ ]] && [ "$D" -ge 2 ] || { echo "$0: --dcs needs 2 or more datacenters, got '$D'" >&2; exit 2; }
[ "$N" -ge "$D" ] || { echo "$0: -n $N ranks cannot fill --dcs $D datacenters" >&2; exit 2; }
EAGER=${LOWCOMM_WAN_EAGER_BYTES:-4194304}
[[ "$EAGER" =~ ^[0-9]+$ ]] || { echo "$0: LOWCOMM_WAN_EAGER_BYTES must be a byte count, got '$EAGER'" >&2; exit 2; }
if [ "$(id -u)" != 0 ]; then
    echo "$0: WAN emulation needs root (network namespaces, TUN devices); use 'lowcomm compare --wan model' for the α–β virtual clock instead" >&2
    exit 1
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] && export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS=1 LOWCOMM_NUM_THREADS=1
PY=$(command -v python3)
command -v mpirun >/dev/null || { echo "$0: mpirun not found; run 'make setup' first" >&2; exit 127; }
CMD=("$@")
if [[ "$(basename "${CMD[0]}")" == python* ]] && [ "${CMD[*]:1:2}" != "-m mpi4py" ]; then
    CMD=("${CMD[0]}" -m mpi4py "${CMD[@]:1}")
fi

TMP=$(mktemp -d /tmp/lowcomm-wan.XXXXXX)
CREATED=0
cleanup() {
    rc=$?
    trap - EXIT INT TERM
    if [ "$CREATED" = 1 ]; then
        (cd "$ROOT" && "$PY" -m lowcomm.cli wan down >/dev/null) || echo "$0: 'lowcomm wan down' failed" >&2
    fi
    rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

up_dcs=$(cd "$ROOT" && "$PY" -c 'import lowcomm.tools.wan as w; s = w.state(); print(s["dcs"] if s else 0)')
if [ "$up_dcs" = 0 ]; then
    CREATED=1
    (cd "$ROOT" && "$PY" -m lowcomm.cli wan up --dcs "$D" "${UPARGS[@]}" >&2)
elif [ "$up_dcs" != "$D" ]; then
    echo "$0: an emulated WAN with $up_dcs datacenters is up, not $D (lowcomm wan down first)" >&2
    exit 2
elif [[ " ${UPARGS[*]} " == *" --fault "* ]]; then
    echo "$0: a WAN is already up, so --fault cannot be scheduled with it; use 'lowcomm wan fault'" >&2
    exit 2
elif [ ${#UPARGS[@]} -gt 0 ]; then
    echo "$0: a WAN is already up; ignoring ${UPARGS[*]} (lowcomm wan status shows its links)" >&2
fi

counts=()
for ((i = 0; i < D; i++)); do counts+=($(( N / D + (i < N % D ? 1 : 0) ))); done
for ((i = 0; i < D; i++)); do echo "lowcomm-dc$i slots=${counts[$i]}"; done >"$TMP/hostfile"
joined=$(IFS=+; echo "${counts[*]}")
export LOWCOMM_TOPOLOGY=${LOWCOMM_TOPOLOGY:-dc:$D,rank:$joined}
# Open MPI starts its daemon on "host" lowcomm-dc<i> through this agent: inside the namespace,
# with the namespace's own hostname.
cat >"$TMP/agent" <<'AGENT'
#!/bin/sh
host=$1; shift
exec ip netns exec "$host" unshare --uts -- /bin/sh -c "hostname $host; $*"
AGENT
chmod +x "$TMP/agent"
flags=(-n "$N" --hostfile "$TMP/hostfile" --oversubscribe --bind-to none --allow-run-as-root
       --mca plm_rsh_agent "$TMP/agent" --mca btl self,vader,tcp --mca mpi_yield_when_idle 1
       --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24
       -x OMP_NUM_THREADS -x LOWCOMM_NUM_THREADS -x PATH -x LOWCOMM_TOPOLOGY)
# TCP messages up to $LOWCOMM_WAN_EAGER_BYTES (default 4 MiB; 0: Open MPI's own 64 KiB) go
# eagerly. Above the eager limit a message waits for its rendezvous (request to send, clear to
# send: a WAN round trip) before its data moves: at 25 ms one way that doubled a 109 KB int8
# all-gather between two datacenters (107 -> 51 ms per call).
if [ "$EAGER" -gt 0 ]; then
    flags+=(--mca btl_tcp_eager_limit "$EAGER" --mca btl_tcp_rndv_eager_limit "$EAGER"
            --mca btl_tcp_max_send_size "$(( EAGER > 131072 ? EAGER : 131072 ))")
fi
for v in LOWCOMM_TEST_REPORTS LOWCOMM_TIMEOUT_S LOWCOMM_WATCHDOG_FACTOR LOWCOMM_WATCHDOG_OUTAGE_S \
         LOWCOMM_WAN_RESULT PYTHONPATH; do
    [ -n "${!v:-}" ] && flags+=(-x "$v")
done
# mpirun itself runs in datacenter 0 (its daemons must reach it over the emulated WAN)
# shellcheck disable=SC2086
ip netns exec lowcomm-dc0 unshare --uts -- /bin/sh -c 'hostname lowcomm-dc0; exec "$@"' sh \
    mpirun "${flags[@]}" ${LOWCOMM_MPIRUN_ARGS:-} "${CMD[@]}"
