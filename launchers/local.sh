#!/usr/bin/env bash
# Run COMMAND on N local ranks with the flags this machine needs:
#   oversubscription (more ranks than cores), no core binding, one torch/OpenMP thread per rank,
#   root allowed, and an uncaught exception on any rank ending the whole job (lowcomm's CLI calls
#   MPI_Abort; a "python ..." command is run as "python -m mpi4py ..." which does the same).
# usage: launchers/local.sh -n N [--] COMMAND [ARGS...]
# extra mpirun flags: LOWCOMM_MPIRUN_ARGS="--mca btl self,tcp" launchers/local.sh -n 2 ...
set -euo pipefail
usage() { echo "usage: $0 -n N [--] COMMAND [ARGS...]" >&2; exit 2; }
N=""
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--np) [ $# -ge 2 ] || usage; N=$2; shift 2 ;;
        -h|--help) usage ;;
        --) shift; break ;;
        *) break ;;
    esac
done
[ -n "$N" ] && [ $# -gt 0 ] || usage
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "$0: -n needs a positive rank count, got '$N'" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] && export PATH="$ROOT/.venv/bin:$PATH"
command -v mpirun >/dev/null || { echo "$0: mpirun not found; run 'make setup' first" >&2; exit 127; }

cmd=("$@")
if [[ "$(basename "${cmd[0]}")" == python* ]] && [ "${cmd[*]:1:2}" != "-m mpi4py" ]; then
    cmd=("${cmd[0]}" -m mpi4py "${cmd[@]:1}")
fi
flags=(-n "$N" --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -x LOWCOMM_NUM_THREADS=1 -x PATH)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
# shellcheck disable=SC2086
exec mpirun "${flags[@]}" ${LOWCOMM_MPIRUN_ARGS:-} "${cmd[@]}"
