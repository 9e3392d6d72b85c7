#!/usr/bin/env bash
# Set up everything lowcomm needs on a fresh Debian machine, idempotently:
#   1. Open MPI from Debian's packages (openmpi-bin, libopenmpi-dev), when mpirun/mpicxx are missing;
#   2. .venv/ in the repository with torch 2.13.0 (the CPU wheel), mpi4py, numpy, click, ...;
#   3. Horovod 0.28.1 with PyTorch + MPI, built once per machine from the PyPI sdist with
#      C++17 (torch 2.13's headers need it; 0.28.1 asks for C++14) and cached as a wheel;
#   4. lowcomm itself, editable.
# A stamp file records the inputs, so a second call costs a second.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LOWCOMM_VENV:-$ROOT/.venv}
CACHE=${LOWCOMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lowcomm}
PY=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
STAMP=$VENV/.lowcomm-bootstrap
STAMP_KEY="torch=$TORCH_VERSION${TORCH_INDEX_URL:+@$TORCH_INDEX_URL} horovod=$HOROVOD_VERSION setup.cfg=$(sha256sum "$ROOT/setup.cfg" | cut -c1-16)"

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
pipq install "setuptools<81" wheel packaging

# 3. Horovod --------------------------------------------------------------------------------------
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
    mkdir -p "$CACHE/wheels"
    WHEEL=$(ls "$CACHE"/wheels/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$WHEEL" ]; then
        log "building Horovod $HOROVOD_VERSION with PyTorch + MPI (about 3 minutes on 2 cores, once per machine)"
        WORK=$(mktemp -d)
        trap 'rm -rf "$WORK"' EXIT
        pipq download --no-deps --no-binary :all: -d "$WORK" "horovod==$HOROVOD_VERSION"
        tar -xzf "$WORK"/horovod-$HOROVOD_VERSION.tar.gz -C "$WORK"
        SRC=$WORK/horovod-$HOROVOD_VERSION
        # torch >= 2.1 headers use C++17; Horovod 0.28.1 pins C++14 in two places.
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || { log "C++17 patch did not apply"; exit 1; }
        # A Release build (setup.py hard-codes RelWithDebInfo): no debug info, measured here
        # 160 s and a 0.9 MB wheel against 197 s and 15 MB (2 cores, one build each).
        sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$SRC/setup.py"
        grep -q "else 'Release'" "$SRC/setup.py" || { log "Release build patch did not apply"; exit 1; }
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
        MAKEFLAGS="-j$(nproc)" \
            "$VENV/bin/python" -m pip wheel --no-deps --no-build-isolation -w "$CACHE/wheels" "$SRC" \
            > "$CACHE/horovod-build.log" 2>&1 || { log "Horovod build failed; see $CACHE/horovod-build.log"; tail -30 "$CACHE/horovod-build.log" >&2; exit 1; }
        WHEEL=$(ls "$CACHE"/wheels/horovod-$HOROVOD_VERSION-*.whl | head -1)
    fi
    log "installing $(basename "$WHEEL")"
    pipq install "$WHEEL"
fi

# 4. lowcomm -------------------------------------------------------------------------------------
pipq install -e "$ROOT[test,docs]"
"$VENV/bin/python" -c "import torch, mpi4py, horovod.torch, lowcomm" \
    || { log "installed packages do not import"; exit 1; }
echo "$STAMP_KEY" > "$STAMP"
log "ready: $VENV"
