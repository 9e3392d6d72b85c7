"""lowcomm inside training code it did not write: the Hugging Face Trainer, accelerate and
Lightning under mpirun (tests/mpi/check_transformers.py, check_accelerate.py,
check_lightning.py) and a plain torch DDP script ported in 10 lines."""
import difflib
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run_ranks, shared_mpi_suite

PORT = ROOT / "experiments" / "ddp_port"
RESULT = re.compile(r"rank (\d+): eval loss ([0-9.]+) state ([0-9a-f]{16})")


@pytest.mark.mpi_checks("check_transformers.py", np=2, timeout=400)
def test_transformers_trainer_under_mpirun_with_lowcomm_methods():
    cases = shared_mpi_suite(2, "check_transformers.py")
    assert any("async-ps" in name for name in cases) and any("int8" in name for name in cases)


@pytest.mark.mpi_checks("check_accelerate.py", np=2, timeout=150)
def test_accelerate_under_mpirun_with_lowcomm_methods():
    cases = shared_mpi_suite(2, "check_accelerate.py")
    assert any("diloco" in name for name in cases) and any("int8" in name for name in cases)


@pytest.mark.mpi_checks("check_lightning.py", np=2, timeout=200)
def test_lightning_under_mpirun_with_lowcomm_methods():
    cases = shared_mpi_suite(2, "check_lightning.py")
    assert any("diloco" in name for name in cases) and any("int8" in name for name in cases)


def test_a_ddp_script_ported_in_ten_lines_trains_the_same_model_as_ddp():
    ddp, ours = (PORT / "train_ddp.py").read_text(), (PORT / "train_lowcomm.py").read_text()
    changed = [line for line in difflib.unified_diff(ddp.splitlines(), ours.splitlines(), n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len(changed) <= 10, "\n".join(changed)
    r = run_ranks(2, sys.executable, PORT / "train_lowcomm.py", "syncdp", timeout=120)
    assert r.returncode == 0, r.output
    lines = sorted(RESULT.findall(r.stdout))       # (rank, eval loss, state hash); the ranks'
    assert len(lines) == 2 and lines[0][1:] == lines[1][1:], r.stdout   # lines may interleave
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(PORT / "train_ddp.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert ref.returncode == 0, ref.stderr
    ddp0 = next(line for line in RESULT.findall(ref.stdout) if line[0] == "0")
    # SyncDP is DDP's update and DDP's buffer rule: rank 0's model is bit-identical
    assert lines[0] == ddp0, (lines, ddp0)
