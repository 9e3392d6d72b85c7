#!/usr/bin/env bash
# A launcher for supervised runs under test: "-n N python -m lowcomm.cli ARGS..." runs
# tests/workers/faulty_train.py ARGS... on N local ranks instead (LOWCOMM_FAULT picks the fault).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ "$1" = "-n" ] || { echo "usage: $0 -n N python -m lowcomm.cli ARGS..." >&2; exit 2; }
n=$2; shift 2
py=$1; shift 3          # python -m lowcomm.cli
exec "$here/../../launchers/local.sh" -n "$n" "$py" "$here/../workers/faulty_train.py" "$@"
