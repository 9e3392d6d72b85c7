#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + MPI) for the torch of one Python environment and install it
# there; lowcomm's `horovod` extra and backend ("syncdp:backend=horovod") need it.
#   usage: scripts/build_horovod.sh [PYTHON]        (default: the python first on PATH)
# Horovod 0.28.1 is the last release and ships no wheels: it is built from its PyPI sdist with
#   * the C++ standard torch's headers ask for instead of its C++14 (torch 2.1-2.13: C++17,
#     torch 2.14: C++20; read from ATen/ATen.h; two CMakeLists.txt lines),
#   * a Release build instead of RelWithDebInfo (measured here: 160 s and a 0.9 MB wheel against
#     197 s and 15 MB, 2 cores),
#   * --no-build-isolation, so that it compiles against the torch already installed.
# Needs cmake, a C++ compiler and the MPI's mpicxx on PATH (`module load openmpi cmake gcc` on a
# cluster; `apt-get install openmpi-bin libopenmpi-dev cmake` on Debian). The wheel is cached per
# torch version in $LOWCOMM_CACHE/wheels/torch-<version>/ (a wheel built against one torch does
# not load beside another). HOROVOD_* variables set by the caller win over the defaults below,
# e.g. HOROVOD_GPU_OPERATIONS=NCCL for NCCL on a CUDA machine (Horovod's own install docs).
set -euo pipefail

HOROVOD_VERSION=0.28.1
PY=${1:-python}
CACHE=${LOWCOMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lowcomm}
log() { printf '[build_horovod] %s\n' "$*" >&2; }

command -v "$PY" >/dev/null || { log "no Python '$PY'"; exit 2; }
for tool in cmake mpicxx; do
    command -v "$tool" >/dev/null || { log "$tool is not on PATH: load it (module load ...) or install it (apt-get install cmake libopenmpi-dev)"; exit 1; }
done
TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) \
    || { log "$PY has no torch: install torch first (Horovod compiles against it)"; exit 1; }
ATEN=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include', 'ATen', 'ATen.h'))" 2>/dev/null)
CXX_STD=$(sed -n 's/.*#error C++\([0-9][0-9]\) or later.*/\1/p' "$ATEN" | head -1)
[ -n "$CXX_STD" ] || { log "cannot tell which C++ standard torch $TORCH needs (no '#error C++NN or later' in $ATEN)"; exit 1; }
TORCH_CUDA=$("$PY" -c "import torch; print(torch.version.cuda or '')" 2>/dev/null)
if [ -n "$TORCH_CUDA" ]; then
    # a CUDA build of torch makes Horovod compile its CUDA part: it needs the CUDA toolkit
    [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
    [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ] || { log "torch $TORCH is a CUDA $TORCH_CUDA build, so Horovod compiles CUDA code, which needs the CUDA toolkit: set CUDA_HOME to it (module load cuda), or use a CPU build of torch"; exit 1; }
fi
if "$PY" -c "import horovod.torch" 2>/dev/null; then
    log "horovod.torch imports already in $PY's environment"
    exit 0
fi
# pip's exit status is kept; only the machine's noise about missing local index folders is dropped.
pipq() { "$PY" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# setup.py imports pkg_resources, which setuptools 81 removed
pipq install "setuptools<81" wheel packaging

DIR=$CACHE/wheels/torch-${TORCH//+/-}
mkdir -p "$DIR"
WHEEL=$(ls "$DIR"/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ] && [ "$TORCH" = 2.13.0+cpu ]; then
    # where scripts/bootstrap.sh cached the wheel it built against the pinned torch before
    WHEEL=$(ls "$CACHE"/wheels/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -1 || true)
fi
if [ -z "$WHEEL" ]; then
    log "building Horovod $HOROVOD_VERSION against torch $TORCH with C++$CXX_STD (3 minutes on 2 cores for a CPU torch, 10 or more for a CUDA one; once per torch)"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    pipq download --no-deps --no-binary :all: -d "$WORK" "horovod==$HOROVOD_VERSION"
    tar -xzf "$WORK"/horovod-$HOROVOD_VERSION.tar.gz -C "$WORK"
    SRC=$WORK/horovod-$HOROVOD_VERSION
    sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $CXX_STD)/" \
        "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q "CMAKE_CXX_STANDARD $CXX_STD" "$SRC/horovod/torch/CMakeLists.txt" || { log "C++$CXX_STD patch did not apply"; exit 1; }
    sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$SRC/setup.py"
    grep -q "else 'Release'" "$SRC/setup.py" || { log "Release build patch did not apply"; exit 1; }
    LOG=$DIR/horovod-build.log
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_GLOO=${HOROVOD_WITHOUT_GLOO-1} HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-MPI} MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --no-deps --no-build-isolation -w "$DIR" "$SRC" > "$LOG" 2>&1 \
        || { log "Horovod build failed; see $LOG"; tail -30 "$LOG" >&2; exit 1; }
    WHEEL=$(ls "$DIR"/horovod-$HOROVOD_VERSION-*.whl | head -1)
fi
log "installing $(basename "$WHEEL") (torch $TORCH)"
pipq install "$WHEEL"
"$PY" -c "import horovod.torch as hvd; assert hvd.mpi_built(), 'Horovod was built without MPI'" \
    || { log "the installed Horovod does not import with MPI"; exit 1; }
