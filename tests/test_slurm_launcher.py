"""launchers/slurm.sbatch without a Slurm: how it finds the checkout and what it hands to srun.

sbatch runs a spooled copy of the script, so each test runs a copy from another folder, with a
stand-in `srun` on PATH that prints what it got. `make test-slurm` runs it under a real Slurm.
"""
import os
import shutil
import subprocess

import pytest

from conftest import ROOT

FAKE_SRUN = """#!/usr/bin/env bash
echo "PATH0=${PATH%%:*}"
echo "PYTHONPATH=$PYTHONPATH"
echo "ARGS=$*"
"""


@pytest.fixture
def spooled(tmp_path):
    spool = tmp_path / "spool"
    bindir = tmp_path / "bin"
    spool.mkdir()
    bindir.mkdir()
    shutil.copy(ROOT / "launchers" / "slurm.sbatch", spool / "slurm_script")
    (bindir / "srun").write_text(FAKE_SRUN)
    (bindir / "srun").chmod(0o755)
    venv = os.path.join(str(ROOT), ".venv", "bin")
    path = ":".join(p for p in os.environ["PATH"].split(":") if os.path.normpath(p) != venv)

    def run(submit_dir, **env):
        e = {k: v for k, v in os.environ.items()
             if k not in ("VIRTUAL_ENV", "PYTHONPATH", "LOWCOMM_ROOT", "LOWCOMM_SLURM_LAUNCH")}
        e.update(PATH=f"{bindir}:{path}", SLURM_SUBMIT_DIR=str(submit_dir), **env)
        return subprocess.run(["bash", str(spool / "slurm_script"), "--set", "steps=3"], cwd=submit_dir,
                              env=e, capture_output=True, text=True, timeout=60)
    return run


def _srun_saw(r):
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and line[0].isupper())


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="needs make setup")
@pytest.mark.parametrize("sub", [".", "experiments"])
def test_finds_checkout_from_submit_dir_and_puts_venv_first(spooled, sub):
    r = spooled(ROOT / sub)
    assert r.returncode == 0, r.stderr
    saw = _srun_saw(r)
    assert saw["PATH0"] == str(ROOT / ".venv" / "bin")
    assert saw["PYTHONPATH"] == str(ROOT)
    assert saw["ARGS"].startswith("--export=ALL --mpi=pmix ")
    assert saw["ARGS"].endswith("python -m lowcomm.cli train --set steps=3")


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="needs make setup")
def test_lowcomm_root_from_elsewhere(spooled, tmp_path):
    r = spooled(tmp_path, LOWCOMM_ROOT=str(ROOT))
    assert r.returncode == 0, r.stderr
    assert _srun_saw(r)["PATH0"] == str(ROOT / ".venv" / "bin")


def test_no_checkout_is_a_clear_error(spooled, tmp_path):
    r = spooled(tmp_path)
    assert r.returncode == 2 and "ARGS=" not in r.stdout
    assert "no lowcomm checkout in or above the submit folder" in r.stderr
    assert "LOWCOMM_ROOT" in r.stderr


def test_bad_lowcomm_root_is_a_clear_error(spooled, tmp_path):
    r = spooled(ROOT, LOWCOMM_ROOT=str(tmp_path))
    assert r.returncode == 2 and "ARGS=" not in r.stdout
    assert f"LOWCOMM_ROOT={tmp_path} is no lowcomm checkout" in r.stderr
