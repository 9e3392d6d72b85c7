# The two commands a newcomer needs: `make demo` and `make test`. Both set up everything first
# (Open MPI, .venv with torch 2.13.0, mpi4py, Horovod 0.28.1 built once per machine, lowcomm).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
NP    ?= 4
DEMO_OUT ?= runs/demo

.PHONY: setup demo test test-install test-gpu test-slurm bench docs clean

setup:
	@bash scripts/bootstrap.sh

DEMO_METHODS ?= main
DEMO_BUDGET ?= 30
DEMO_STEPS ?= 3000
DEMO_ARGS ?=
# each method at its own learning rate: the best of these after DEMO_TUNE_STEPS steps
# (DEMO_TUNE= leaves every method at its registry settings and skips the sweep)
DEMO_TUNE ?= lr=3e-4,1e-3,3e-3
DEMO_TUNE_STEPS ?= 100

# The main job: every main method on the default workload (Python stdlib corpus), one mpirun
# each, each at the learning rate its own short sweep chose (--tune; the table states what the
# sweep cost), then for $(DEMO_BUDGET) modelled seconds on a 25 ms / 100 Mbit/s link (at most
# $(DEMO_STEPS) steps); results.json, tuning.json, table.md and eval-loss plots in $(DEMO_OUT).
demo: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH lowcomm compare --np $(NP) --methods $(DEMO_METHODS) \
		--budget $(DEMO_BUDGET) --steps $(DEMO_STEPS) --out $(DEMO_OUT) \
		$(if $(DEMO_TUNE),--tune $(DEMO_TUNE) --tune-steps $(DEMO_TUNE_STEPS)) $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q tests

# lowcomm as a user installs it (never part of `make test`: about 6 GB, 5-10 minutes): its wheel
# into a clean venv (build/test-install/venv) beside torch $(TEST_TORCH) instead of the pinned one,
# mpi4py compiled against the MPI on PATH (HOROVOD=1: Horovod built against that torch); then `lowcomm info`
# and a 2-rank training run under mpirun, and tests/mpi/check_every_method.py on 3 ranks
# (scripts/test_install.sh; docs/install.md). Needs no `make setup`, only Open MPI and cmake.
TEST_TORCH ?= 2.14.1
test-install:
	TORCH=$(TEST_TORCH) bash scripts/test_install.sh

# On a machine with CUDA (never part of `make test`): every all-reduce algorithm on CUDA tensors
# and every method training on the GPU, 2 ranks (tests/mpi/check_gpu.py; it fails without CUDA).
# Set up with a CUDA build of torch: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126.
# On a GPU image whose python3 already has a CUDA torch: bash scripts/gpu_check.sh (same checks,
# plus FSDP2 over NCCL; it installs mpi4py and Open MPI from wheels in .gpu-wheels/ if missing).
test-gpu: setup
	PYTHON=$(PY) PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/gpu_check.sh

# launchers/slurm.sbatch on a throw-away single-node Slurm started on this machine (root, Debian):
# installs slurm-wlm + munge when missing, starts munged/slurmctld/slurmd under /tmp/lowcomm-slurm,
# runs a 20-step job on $(NP) ranks, checks its summary.json, and stops the daemons again.
test-slurm: setup
	NP=$(NP) bash scripts/slurm_test.sh

# The documentation site (Sphinx: MyST pages, the API from docstrings, the configuration reference
# generated from the settings dataclasses), warnings as errors; the test suite builds it too.
docs: setup
	$(PY) -m sphinx -W --keep-going -E -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

# The speed benchmarks (scripts/bench.sh): all-reduce, training step and compressors beside their
# references in one run each, 3 runs at 2 ranks (one core per rank: the reference) and at 4, with
# each run's load; runs/bench/*.json and one data file per bench in runs/bench/data.
bench: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/bench.sh

clean:
	rm -rf runs .pytest_cache
