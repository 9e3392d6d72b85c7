# Sourced by the launchers: reads "-n N [--] COMMAND..." into $N and $@ (as CMD array), and puts
# the repository's .venv first on PATH when it exists.
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
CMD=("$@")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] && export PATH="$ROOT/.venv/bin:$PATH"
export OMP_NUM_THREADS=1 LOWCOMM_NUM_THREADS=1
