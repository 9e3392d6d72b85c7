#!/usr/bin/env bash
# The horovodrun equivalent of local.sh: Horovod's own launcher (MPI mode) on N local slots.
# usage: launchers/horovodrun.sh -n N [--] COMMAND [ARGS...]
set -euo pipefail
source "$(dirname "$0")/common.sh"
command -v horovodrun >/dev/null || { echo "$0: horovodrun not found; run 'make setup' first" >&2; exit 127; }
mpi_args="--oversubscribe"
[ "$(id -u)" = 0 ] && mpi_args="$mpi_args --allow-run-as-root"
exec horovodrun -np "$N" -H "localhost:$N" --mpi --mpi-args="$mpi_args" "${CMD[@]}"
