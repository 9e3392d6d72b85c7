#!/usr/bin/env bash
# `make test-install`: lowcomm installed as a user installs it into an environment of their own,
# beside a torch other than the pinned one (never part of `make test`: it costs about 6 GB).
#   1. build lowcomm's wheel from this checkout (pip wheel, isolated build);
#   2. a clean venv with torch $TORCH (default 2.14.1, a CUDA build: pip takes it from this
#      machine's disk where it lies there, else from the index), then mpi4py compiled from its
#      sdist against the MPI on PATH (MPICC=mpicc; docs/install.md), with HOROVOD=1 Horovod built against
#      that torch and MPI (scripts/build_horovod.sh; wheel cached per torch), then the wheel
#      with its `test` and `horovod` extras, holding that torch (-c keep-torch.txt, as
#      docs/install.md says); pip must keep it;
#   3. `lowcomm info` on 2 ranks: lowcomm from the venv, not from the checkout, the torch asked for;
#   4. a 2-rank smoke run (`lowcomm train`, 6 steps of DiLoCo): summary.json with a finite eval
#      loss and every rank holding the same model;
#   5. tests/mpi/check_every_method.py on 3 ranks (as `make test` runs it: every registered
#      method through the loop, one model on every rank at the end), from a copy of tests/mpi
#      and experiments/ outside the checkout, so only the installed lowcomm can be imported.
# Knobs: TORCH=2.14.1 TEST_INSTALL_DIR=build/test-install MPI4PY=source|wheel HOROVOD=0|1 PYTHON=python3
# HOROVOD=0 (the default: Horovod 0.28.1 did not build against torch 2.14.1's CUDA build here) deselects
# the two cases that train on the horovod backend, and says so; HOROVOD=1 builds it first.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${TORCH:-2.14.1}
DIR=${TEST_INSTALL_DIR:-$ROOT/build/test-install}
MPI4PY=${MPI4PY:-source}
HOROVOD=${HOROVOD:-0}
PY=${PYTHON:-python3}
VENV=$DIR/venv
STARTED=$SECONDS
step() { printf '\n[test-install %3ds] %s\n' "$((SECONDS - STARTED))" "$*"; }
fail() { printf '[test-install] FAILED: %s\n' "$*" >&2; exit 1; }
pipq() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
command -v mpirun >/dev/null && command -v mpicc >/dev/null \
    || fail "mpirun and mpicc must be on PATH (module load openmpi; or apt-get install openmpi-bin libopenmpi-dev)"
# as on a fresh machine (and as tests/conftest.py runs the suite): no tuned all-reduce table of
# this machine (~/.cache/lowcomm, written by whichever lowcomm ran `bench allreduce --autotune`)
export LOWCOMM_ALLREDUCE_TABLE=$DIR/no-table/
# mpirun as a user runs it on one machine: more ranks than cores, no binding, a thread per rank
MPIRUN=(mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -x LOWCOMM_NUM_THREADS=1 -x PATH
        -x LOWCOMM_ALLREDUCE_TABLE)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)

step "1. the wheel, from $ROOT"
rm -rf "$DIR"
mkdir -p "$DIR/dist" "$DIR/work" "$LOWCOMM_ALLREDUCE_TABLE"
"$PY" -m venv "$VENV"
pipq wheel --no-deps -w "$DIR/dist" "$ROOT"
WHEEL=$(ls "$DIR"/dist/lowcomm-*.whl)
echo "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) kB)"
"$VENV/bin/python" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = sorted({n.split("/")[0] for n in names})
assert all(t == "lowcomm" or t.startswith("lowcomm-") for t in tops), f"the wheel holds more than lowcomm: {tops}"
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith("METADATA"))).decode()
print("requires:", "; ".join(l.split(": ", 1)[1] for l in meta.splitlines() if l.startswith("Requires-Dist") and "extra" not in l))
EOF

step "2. a clean venv with torch $TORCH, mpi4py ($MPI4PY) against $(command -v mpicc), Horovod=$HOROVOD, then the wheel"
pipq install "torch==$TORCH"
if [ "$MPI4PY" = source ]; then
    # compiled here against the MPI whose mpicc is on PATH (no cached wheel built elsewhere)
    MPICC=$(command -v mpicc) pipq install --no-binary mpi4py --no-cache-dir "mpi4py>=4.0"
else
    pipq install "mpi4py>=4.0"
fi
extras=test
if [ "$HOROVOD" = 1 ]; then
    PATH="$VENV/bin:$PATH" bash "$ROOT/scripts/build_horovod.sh" "$VENV/bin/python"
    extras=test,horovod
fi
# as docs/install.md tells a user: hold the torch the environment has, then install the wheel
"$VENV/bin/python" -m pip freeze 2>/dev/null | grep '^torch==' > "$DIR/keep-torch.txt"
echo "holding $(cat "$DIR/keep-torch.txt")"
pipq install -c "$DIR/keep-torch.txt" "$WHEEL[$extras]"
"$VENV/bin/python" -m pip check 2> >(grep -v "^WARNING: Location" >&2)
"$VENV/bin/python" -c "import sys, torch; v = torch.__version__; print('torch', v); sys.exit(0 if v.split('+')[0] == '$TORCH' else 'pip replaced torch $TORCH by ' + v)"
echo "venv: $(du -sh "$VENV" | cut -f1)"

cd "$DIR/work"       # outside the checkout: nothing imports the repository's lowcomm
step "3. lowcomm info on 2 ranks"
"${MPIRUN[@]}" -n 2 "$VENV/bin/lowcomm" info | tee info.txt
grep -q "^lowcomm .*($VENV/lib/" info.txt || fail "lowcomm was not imported from $VENV"
grep -q "^torch $TORCH" info.txt || fail "the ranks did not run torch $TORCH"

step "4. smoke: lowcomm train, DiLoCo, 6 steps on 2 ranks"
"${MPIRUN[@]}" -n 2 "$VENV/bin/lowcomm" train --quiet --out run --set strategy.name=diloco \
    --set strategy.period=3 --set steps=6 --set model.d_model=32 --set model.n_layers=1 \
    --set eval_batches=2 --set batch_size=4
"$VENV/bin/python" - <<'EOF'
import json, math
s = json.load(open("run/summary.json"))
assert math.isfinite(s["eval_loss"]), f"eval loss {s['eval_loss']}"
assert s["ranks_agree"] is True, "the ranks ended with different models"
print(f"summary.json: eval_loss {s['eval_loss']:.4f}, ranks_agree {s['ranks_agree']}, state_sha256 {s['state_sha256'][:16]}")
EOF

step "5. every method through the loop on 3 ranks (tests/mpi/check_every_method.py)"
mkdir -p tests experiments
cp -r "$ROOT/tests/mpi" tests/
cp "$ROOT"/experiments/*.py experiments/
select=()
if [ "$HOROVOD" != 1 ]; then
    select=(-k "not horovod")
    echo "HOROVOD=0: the two horovod-backend cases are deselected (not run)"
fi
# as tests/conftest.py runs it: reports per rank
export LOWCOMM_TEST_REPORTS=$DIR/work/reports
mkdir -p "$LOWCOMM_TEST_REPORTS"
rc=0
PYTHONPATH=$DIR/work/tests/mpi "${MPIRUN[@]}" -x PYTHONPATH -x LOWCOMM_TEST_REPORTS \
    -n 3 "$VENV/bin/python" -m mpi4py -m pytest -q -p under_mpi -o python_files='check_*.py' \
    -o addopts= -p no:cacheprovider --timeout=900 tests/mpi/check_every_method.py "${select[@]}" \
    > every_method.log 2>&1 || rc=$?
tail -4 every_method.log
"$VENV/bin/python" - "$LOWCOMM_TEST_REPORTS" <<'EOF'
import json, pathlib, sys
ranks = {}
for f in pathlib.Path(sys.argv[1]).glob("rank*.jsonl"):
    ranks[int(f.stem[4:])] = {x["case"]: x["outcome"] for x in map(json.loads, f.read_text().splitlines())}
assert sorted(ranks) == [0, 1, 2], f"reports from ranks {sorted(ranks)}"
bad = [f"{c} on rank {r}: {o}" for r, cs in sorted(ranks.items()) for c, o in cs.items() if o != "passed"]
assert not bad, "\n".join(bad)
assert len({frozenset(c) for c in ranks.values()}) == 1, "ranks ran different cases"
print(f"{len(ranks[0])} cases passed on each of 3 ranks")
EOF
[ "$rc" = 0 ] || fail "every case passed but the job exited $rc (see $DIR/work/every_method.log)"
step "passed: lowcomm's wheel beside torch $TORCH, mpi4py compiled against $(mpirun --version | head -1)"
