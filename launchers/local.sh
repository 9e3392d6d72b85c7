#!/usr/bin/env bash
# Run COMMAND on N local ranks with the flags this machine needs:
#   oversubscription (more ranks than cores), no core binding, one torch/OpenMP thread per rank,
#   root allowed, and an uncaught exception on any rank ending the whole job (lowcomm's CLI calls
#   MPI_Abort; a "python ..." command is run as "python -m mpi4py ..." which does the same).
# usage: launchers/local.sh -n N [--] COMMAND [ARGS...]
# extra mpirun flags: LOWCOMM_MPIRUN_ARGS="--mca btl self,tcp" launchers/local.sh -n 2 ...
set -euo pipefail
source "$(dirname "$0")/common.sh"
command -v mpirun >/dev/null || { echo "$0: mpirun not found; run 'make setup' first" >&2; exit 127; }
if [[ "$(basename "${CMD[0]}")" == python* ]] && [ "${CMD[*]:1:2}" != "-m mpi4py" ]; then
    CMD=("${CMD[0]}" -m mpi4py "${CMD[@]:1}")
fi
flags=(-n "$N" --oversubscribe --bind-to none -x OMP_NUM_THREADS -x LOWCOMM_NUM_THREADS -x PATH)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
# shellcheck disable=SC2086
exec mpirun "${flags[@]}" ${LOWCOMM_MPIRUN_ARGS:-} "${CMD[@]}"
