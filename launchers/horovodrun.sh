#!/usr/bin/env bash
# The horovodrun equivalent of local.sh: Horovod's own launcher (MPI mode) on N local slots.
# usage: launchers/horovodrun.sh -n N [--] COMMAND [ARGS...]
set -euo pipefail
usage() { echo "usage: $0 -n N [--] COMMAND [ARGS...]" >&2; exit 2; }
N=""
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--np) [ $# -ge 2 ] || usage; N=$2; shift 2 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ -n "$N" ] && [ $# -gt 0 ] || usage
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] && export PATH="$ROOT/.venv/bin:$PATH"
command -v horovodrun >/dev/null || { echo "$0: horovodrun not found; run 'make setup' first" >&2; exit 127; }
export OMP_NUM_THREADS=1 LOWCOMM_NUM_THREADS=1
mpi_args="--oversubscribe"
[ "$(id -u)" = 0 ] && mpi_args="$mpi_args --allow-run-as-root"
exec horovodrun -np "$N" -H "localhost:$N" --mpi --mpi-args="$mpi_args" "$@"
