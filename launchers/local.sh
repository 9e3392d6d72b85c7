#!/usr/bin/env bash
# Run COMMAND on N local ranks with the flags this machine needs:
#   oversubscription (more ranks than cores), no core binding, one torch/OpenMP thread per rank,
#   root allowed, and an uncaught exception on any rank ending the whole job (lowcomm's CLI calls
#   MPI_Abort; a "python ..." command is run as "python -m mpi4py ..." which does the same).
# A stop signal (SIGINT/Ctrl-C, SIGTERM, SIGHUP as SIGTERM) to this script goes to the ranks
# themselves, not to mpirun: Open MPI 4's mpirun, given one, SIGKILLs its ranks a second after
# passing a SIGTERM on (odls_base_sigkill_timeout), before a run with slow steps has written its
# final checkpoint. mpirun runs in its own process group (a terminal's Ctrl-C reaches this script
# alone) and dies with this script (Linux's parent-death signal, set by util-linux's setpriv);
# without setpriv, mpirun is exec'ed as before and gets the signals itself.
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
if ! setpriv --help 2>/dev/null | grep -q -- --pdeathsig; then
    # shellcheck disable=SC2086
    exec mpirun "${flags[@]}" ${LOWCOMM_MPIRUN_ARGS:-} "${CMD[@]}"
fi
# the ranks learn that a stop reaches them directly (lowcomm then does not warn about mpirun's grace)
export LOWCOMM_STOP_FORWARDED=1
flags+=(-x LOWCOMM_STOP_FORWARDED)
set -m
# shellcheck disable=SC2086
setpriv --pdeathsig KILL mpirun "${flags[@]}" ${LOWCOMM_MPIRUN_ARGS:-} "${CMD[@]}" &
job=$!
set +m
forward() {                 # $1: the signal; to mpirun's children (the ranks), else to mpirun
    local ranks
    ranks=$(pgrep -P "$job" || true)
    # shellcheck disable=SC2086
    if [ -n "$ranks" ]; then kill -s "$1" $ranks 2>/dev/null || true
    else kill -s "$1" "$job" 2>/dev/null || true; fi
}
trap 'forward INT' INT
trap 'forward TERM' TERM HUP
while :; do                 # a trapped signal cuts `wait` short: wait again until mpirun is gone
    wait "$job" || true
    kill -0 "$job" 2>/dev/null || break
done
rc=0
wait "$job" || rc=$?
exit "$rc"
