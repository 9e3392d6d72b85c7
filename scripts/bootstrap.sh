#!/usr/bin/env bash
# Set up everything lowcomm needs on a fresh Debian machine, idempotently:
#   1. Open MPI from Debian's packages (openmpi-bin, libopenmpi-dev), when mpirun/mpicxx are missing;
#   2. .venv/ in the repository with the releases constraints/fresh-machine.txt pins (torch 2.13.0,
#      the CPU wheel), mpi4py, numpy, click, ...;
#   3. Horovod 0.28.1 with PyTorch + MPI (scripts/build_horovod.sh: built once per machine and
#      torch from the PyPI sdist with C++17, cached as a wheel);
#   4. lowcomm itself, editable, with the constraints (pip keeps the pinned torch).
# Into an environment you already have (your torch, your MPI), install with pip instead:
# docs/install.md.
# A stamp file records the inputs, so a second call costs a second.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LOWCOMM_VENV:-$ROOT/.venv}
CACHE=${LOWCOMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lowcomm}
PY=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
PINS=$ROOT/constraints/fresh-machine.txt
TORCH_VERSION=$(sed -n 's/^torch==//p' "$PINS")
[ -n "$TORCH_VERSION" ] || { echo "[bootstrap] $PINS pins no torch (a line torch==X.Y.Z)" >&2; exit 1; }
STAMP=$VENV/.lowcomm-bootstrap
STAMP_KEY="torch=$TORCH_VERSION${TORCH_INDEX_URL:+@$TORCH_INDEX_URL} horovod=$HOROVOD_VERSION $(cat "$ROOT/setup.cfg" "$PINS" "$ROOT/scripts/build_horovod.sh" | sha256sum | cut -c1-16)"

log() { printf '[bootstrap] %s\n' "$*" >&2; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_KEY" ] && command -v mpirun >/dev/null; then
    exit 0
fi

# 1. Open MPI ------------------------------------------------------------------------------------
if ! command -v mpirun >/dev/null || ! command -v mpicxx >/dev/null || ! command -v cmake >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        log "Open MPI or cmake is missing and installing them needs root: run 'sudo apt-get install openmpi-bin libopenmpi-dev cmake'"
        exit 1
    fi
    log "installing Open MPI (and cmake) from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev cmake >/dev/null
fi

# 2. virtual environment --------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
# pip's exit status is kept; only the machine's noise about missing local index folders is dropped.
pipq() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# torch first and pinned: the local CPU wheel; any other torch would pull a multi-GB CUDA build.
# On a GPU machine (make test-gpu) TORCH_INDEX_URL names the CUDA wheels' index instead, e.g.
# https://download.pytorch.org/whl/cu126.
pipq install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

# 3. Horovod --------------------------------------------------------------------------------------
PATH="$VENV/bin:$PATH" bash "$ROOT/scripts/build_horovod.sh" "$VENV/bin/python"

# 4. lowcomm -------------------------------------------------------------------------------------
# The constraints keep the torch installed above (a CUDA build from TORCH_INDEX_URL included:
# its local version label, +cu126, satisfies torch==2.13.0).
pipq install -c "$PINS" -e "$ROOT[test,docs]"
"$VENV/bin/python" -c "import torch, mpi4py, horovod.torch, lowcomm" \
    || { log "installed packages do not import"; exit 1; }
echo "$STAMP_KEY" > "$STAMP"
log "ready: $VENV"
