"""Helpers to run multi-rank checks under real mpirun, each with a time bound.

Multi-rank checks are pytest files, tests/mpi/check_*.py, run under mpirun by
:func:`run_mpi_suite`: every rank runs the same test functions (a ``comm`` fixture gives the
world), a failure on any rank fails the case on every rank, and the launching test gets each
case's outcome, so a failure names the case and the rank, and a case can be selected with ``-k``
(see tests/mpi/under_mpi.py). What a pytest run would not survive stays a script
(tests/workers/*.py: a rank killed, stopped or signalled, a job the watchdog ends, the WAN
emulator's jobs), run by :func:`run_ranks`, or by :func:`run_worker` when it counts its checks
(``$LOWCOMM_TEST_REPORTS/rank<r>``; files, because the ranks' stdout lines interleave). In a
script a failing assert raises, and ``python -m mpi4py`` turns that into MPI_Abort, so the job
ends at once with a non-zero status.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "launchers" / "local.sh"
WORKERS = Path(__file__).resolve().parent / "workers"
# The suite never reads this machine's tuned all-reduce table (``lowcomm bench allreduce
# --autotune``) and never measures one on auto's first use (timings under the suite's load would
# make runs started together choose differently): algorithm=auto decides by the α–β model.
# tests/mpi/check_allreduce.py measures one on purpose.
os.environ["LOWCOMM_ALLREDUCE_TABLE"] = tempfile.mkdtemp(prefix="lowcomm-no-table-") + "/"
os.environ["LOWCOMM_AUTOTUNE"] = "0"


#: the most a measured slowdown scales a time limit by (a machine slower than that is broken)
MAX_SLOWDOWN = 12.0


def measure_slowdown(samples: int = 5, busy_s: float = 0.04) -> float:
    """How many times slower than on an idle core work runs here now: the median, over
    ``samples`` busy loops of ``busy_s`` CPU seconds each, of wall-clock over CPU seconds (1 on
    an idle core; about L/cores where L runnable processes share the cores), or the 1-minute
    load per core if larger (other processes' bursts between the samples); at least 1, at most
    :data:`MAX_SLOWDOWN`. ``$LOWCOMM_TEST_SLOWDOWN`` replaces the measurement."""
    forced = os.environ.get("LOWCOMM_TEST_SLOWDOWN")
    if forced:
        return max(1.0, float(forced))
    ratios = []
    for _ in range(samples):
        w0, c0 = time.perf_counter(), time.process_time()
        while time.process_time() - c0 < busy_s:
            sum(range(1000))
        ratios.append((time.perf_counter() - w0) / (time.process_time() - c0))
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(MAX_SLOWDOWN, max(1.0, sorted(ratios)[samples // 2], load))


@functools.cache
def slowdown() -> float:
    """The factor every time limit of the suite is scaled by (measured once, at the session's
    start: :func:`measure_slowdown`). A test asserts behaviour, not a margin the machine's load
    decides: its timeouts, watchdogs, deadlines and round lengths are ``limit × slowdown()``."""
    return measure_slowdown()


def scaled(seconds: float) -> float:
    """A time limit ``seconds`` set for an idle machine, scaled by :func:`slowdown`."""
    return seconds * slowdown()


def pytest_report_header(config):
    return f"lowcomm: time limits scaled by a measured slowdown of {slowdown():.2f} (load " \
           f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi_checks(*paths, np=None, timeout=300, case_timeout=120): "
                            "check files the test reads from the shared mpirun on np ranks "
                            "(conftest.shared_mpi_suite)")


def pytest_collection_modifyitems(config, items):
    """Every test's own time bound (pytest-timeout's: its ``timeout`` marker, else
    ``--timeout`` / setup.cfg's) scaled by :func:`slowdown`."""
    import pytest
    base = config.getoption("timeout", None) or config.getini("timeout")
    for item in items:
        m = item.get_closest_marker("timeout")
        limit = (m.args[0] if m.args else m.kwargs.get("timeout")) if m is not None else base
        if limit and float(limit) > 0:
            item.add_marker(pytest.mark.timeout(scaled(float(limit))), append=False)


class Ran(subprocess.CompletedProcess):
    @property
    def output(self) -> str:
        return f"--- exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_ranks(np: int, *cmd: str, timeout: float = 180, env: dict | None = None,
              launcher: Path = LOCAL, launcher_args: list[str] = ()) -> Ran:
    """Run ``cmd`` on ``np`` ranks; kill the whole job (and fail) after ``timeout`` seconds (an
    idle machine's: scaled by :func:`slowdown`)."""
    timeout = scaled(timeout)
    full_env = {**os.environ, **(env or {})}
    p = subprocess.Popen([str(launcher), "-n", str(np), *launcher_args, *map(str, cmd)], cwd=ROOT,
                         env=full_env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{cmd} on {np} ranks did not finish in {timeout} s\n{out}\n{err}")
    return Ran(p.args, p.returncode, out, err)


def run_worker(np: int, name: str, *args: str, timeout: float = 180, launcher: Path = LOCAL,
               launcher_args: list[str] = (), env: dict | None = None) -> dict[int, int]:
    """Run tests/workers/<name> on ``np`` ranks; require every rank to report OK."""
    with tempfile.TemporaryDirectory() as reports:
        r = run_ranks(np, sys.executable, WORKERS / name, *args, timeout=timeout,
                      env={**(env or {}), "LOWCOMM_TEST_REPORTS": reports}, launcher=launcher,
                      launcher_args=launcher_args)
        assert r.returncode == 0, r.output
        oks = {int(f.name[4:]): int(f.read_text()) for f in Path(reports).glob("rank*")}
    assert sorted(oks) == list(range(np)), r.output
    return oks


def cli(*args: str, env: dict | None = None) -> Ran:
    """``lowcomm ARGS`` in this process, for what fails before any rank starts (a bad key, a bad
    file, an occupied folder): the same ``main()`` a rank runs, without ~3 s of start-up per
    call. Returns the exit status and what it printed."""
    import contextlib
    import io
    from unittest import mock

    from lowcomm import cli as lowcomm_cli
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.dict(os.environ, env or {}), mock.patch.object(sys, "argv", ["lowcomm", *map(str, args)]), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            lowcomm_cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Ran(["lowcomm", *map(str, args)], code, out.getvalue(), err.getvalue())


def experiment(name: str):
    """``experiments/NAME.py`` imported as a module (the folder is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MPI_CHECKS = Path(__file__).resolve().parent / "mpi"
#: plugins a check run does not need, each a fraction of a second of every rank's start or end
#: (unraisableexception's end collects the garbage of torch's import graph several times)
UNUSED_PLUGINS = [a for p in ("cacheprovider", "anyio", "unraisableexception", "threadexception")
                  for a in ("-p", f"no:{p}")]


def _mpi_suite_job(np: int, paths: list[str], pytest_args, timeout: float, case_timeout: float,
                   env: dict | None) -> tuple[dict[int, dict[str, str]], Ran]:
    """One mpirun of pytest over ``tests/mpi/<paths>`` on ``np`` ranks: every rank's
    ``{case: outcome}`` and the job (see :func:`run_mpi_suite`)."""
    import json
    with tempfile.TemporaryDirectory() as reports:
        r = run_ranks(np, sys.executable, "-m", "pytest", "-q", *UNUSED_PLUGINS, "-p", "under_mpi",
                      "-o", "python_files=check_*.py", "-o", "addopts=",
                      f"--timeout={scaled(case_timeout):g}", "-o", "timeout_method=thread",
                      *[str(MPI_CHECKS / p) for p in paths], *pytest_args, timeout=timeout,
                      env={**(env or {}), "LOWCOMM_TEST_REPORTS": reports, "PYTHONPATH": os.pathsep.join(
                          [str(MPI_CHECKS), os.environ.get("PYTHONPATH", "")])})
        cases = {int(f.stem[4:]): {x["case"]: x["outcome"] for x in map(json.loads, f.read_text().splitlines())}
                 for f in Path(reports).glob("rank*.jsonl")}
    assert sorted(cases) == list(range(np)), f"reports from ranks {sorted(cases)}\n{r.output}"
    assert len({frozenset(c) for c in cases.values()}) == 1, "ranks ran different cases"
    return cases, r


def _failures(cases: dict[int, dict[str, str]], keep=lambda name: True) -> list[str]:
    return [f"{name} on rank {rank}: {out}" for rank, c in sorted(cases.items())
            for name, out in c.items() if out != "passed" and keep(name)]


def run_mpi_suite(np: int, path: str | list[str], *pytest_args: str, timeout: float = 300,
                  case_timeout: float = 120, env: dict | None = None,
                  each_case: bool = False) -> dict[str, str]:
    """Run the pytest file ``tests/mpi/<path>`` (or several, in one mpirun) on ``np`` ranks
    (see tests/mpi/under_mpi.py) and require every case collected to pass on every rank (a
    skipped case is a check not made: it fails too). Returns ``{"check_x.py::test_y[case]":
    outcome}``; a failure names the case and the ranks it failed on, and a job killed in a case
    (after ``case_timeout`` seconds: a hang) names the case each rank was in. ``pytest_args``
    select cases (``-k``); ``env`` is added to the ranks' environment. ``each_case``: the caller
    asserts case by case (one test of its own per case): the outcomes are returned as they are,
    rank 0's (which name the other ranks' failures too). Both time limits are an idle
    machine's, scaled by :func:`slowdown` (the job's by :func:`run_ranks`). Check files that
    need no arguments of their own share one mpirun per rank count: :func:`shared_mpi_suite`."""
    paths = [path] if isinstance(path, str) else path
    cases, r = _mpi_suite_job(np, paths, pytest_args, timeout, case_timeout, env)
    bad = _failures(cases)
    assert each_case or not bad, "\n".join(bad) + f"\n{r.output[-3000:]}"
    assert bad or r.returncode == 0, f"every case passed but the job exited {r.returncode}\n{r.output[-3000:]}"
    return cases[0]


#: what the collected tests' ``mpi_checks`` markers ask for: {np: {check file: (timeout,
#: case_timeout)}} and {np: environment}, filled once the session's tests are known
_PLAN: dict[int, dict[str, tuple[float, float]]] = {}
_PLAN_ENV: dict[int, dict[str, str]] = {}
#: the folder each shared job's ``{out}`` names (made when the job runs)
_SHARED_OUT: dict[int, Path] = {}
#: the shared job of each rank count once run: (every rank's cases, the job) or what it raised
_SHARED: dict[int, tuple[dict[int, dict[str, str]], Ran] | BaseException] = {}


def _checks_of(item) -> list[tuple[int, str, float, float, dict]]:
    """The (np, check file, timeout, case_timeout, env) a test's ``mpi_checks`` marker declares;
    its rank count is the marker's ``np`` or the test's own ``np``/``np_`` parameter."""
    out = []
    for m in item.iter_markers("mpi_checks"):
        params = getattr(getattr(item, "callspec", None), "params", {})
        np = m.kwargs.get("np", params.get("np", params.get("np_")))
        assert isinstance(np, int), f"{item.nodeid}: mpi_checks needs np= or an np parameter"
        out += [(np, p, m.kwargs.get("timeout", 300), m.kwargs.get("case_timeout", 120),
                 m.kwargs.get("env", {})) for p in m.args]
    return out


def pytest_collection_finish(session):
    """The plan of the shared jobs: the check files every selected test declares. A test that
    reads a shared job may be the one that runs it: its own time bound grows by the job's."""
    import pytest
    _PLAN.clear()
    _PLAN_ENV.clear()
    for item in session.items:
        for np, path, timeout, case_timeout, env in _checks_of(item):
            t, c = _PLAN.setdefault(np, {}).get(path, (0, 0))
            _PLAN[np][path] = (max(t, timeout), max(c, case_timeout))
            known = _PLAN_ENV.setdefault(np, {})
            clash = [k for k, v in env.items() if known.get(k, v) != v]
            assert not clash, f"{item.nodeid}: mpi_checks env {clash} differs from another test's"
            known.update(env)
    base = session.config.getoption("timeout", None) or session.config.getini("timeout")
    for item in session.items:
        nps = {np for np, *_ in _checks_of(item)}
        if nps and base and float(base) > 0:
            job = sum(t for np in nps for t, _ in _PLAN[np].values())
            item.add_marker(pytest.mark.timeout(scaled(float(base) + job)), append=False)
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if _PLAN and tr is not None and not session.config.option.collectonly:
        tr.write_line("lowcomm: one shared mpirun per rank count: " + "; ".join(
            f"{np} ranks: {len(files)} check files" for np, files in sorted(_PLAN.items())))


def shared_mpi_suite(np: int, path: str | list[str]) -> dict[str, str]:
    """The cases of ``tests/mpi/<path>`` (one file or several) from the session's one mpirun on
    ``np`` ranks that runs every check file the selected tests declare for ``np`` with
    ``@pytest.mark.mpi_checks(PATH, ..., timeout=T, case_timeout=C, env=E)`` (what
    :func:`run_mpi_suite` does per file, with one start-up of the ranks instead of one per file;
    ``E``'s values may name the job's own folder as ``{out}``: :func:`shared_mpi_out`). The job runs when
    the first test asks for it; its time limit is the sum of the files' ``timeout``, its case
    limit their largest ``case_timeout``. Requires every case of ``path`` to pass on every rank
    (the others' failures are their own tests'), and returns ``{case: outcome}`` of ``path``."""
    paths = [path] if isinstance(path, str) else path
    plan = _PLAN.get(np, {})
    missing = [p for p in paths if p not in plan]
    assert not missing, f"{missing} at {np} ranks: the test needs @pytest.mark.mpi_checks for them"
    if np not in _SHARED:
        out = _SHARED_OUT[np] = Path(tempfile.mkdtemp(prefix=f"lowcomm-shared-{np}-"))
        env = {k: v.format(out=out) for k, v in _PLAN_ENV.get(np, {}).items()}
        try:
            _SHARED[np] = _mpi_suite_job(np, sorted(plan), (), sum(t for t, _ in plan.values()),
                                         max(c for _, c in plan.values()), env)
        except BaseException as e:      # noqa: BLE001 (kept: every test of the job reports it)
            _SHARED[np] = e
    got = _SHARED[np]
    if isinstance(got, BaseException):
        raise AssertionError(f"the shared {np}-rank job of {sorted(plan)} failed") from got
    cases, r = got
    mine = lambda name: name.split("::")[0] in paths     # noqa: E731
    bad = _failures(cases, mine)
    assert not bad, "\n".join(bad) + f"\n{r.output[-3000:]}"
    assert _failures(cases) or r.returncode == 0, \
        f"every case passed but the job exited {r.returncode}\n{r.output[-3000:]}"
    found = {name: out for name, out in cases[0].items() if mine(name)}
    assert found, f"no case of {paths} ran on {np} ranks\n{r.output[-3000:]}"
    return found


def shared_mpi_out(np: int) -> Path:
    """The folder of the shared job on ``np`` ranks (``{out}`` in its markers' ``env``), where its
    checks leave what the launching tests read; :func:`shared_mpi_suite` first."""
    assert np in _SHARED_OUT, f"the shared {np}-rank job has not run: call shared_mpi_suite first"
    return _SHARED_OUT[np]


def pytest_sessionfinish(session):
    import shutil
    for out in _SHARED_OUT.values():
        shutil.rmtree(out, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """No test initialises MPI in the pytest process: a singleton MPI job's variables, set in
    its C environment, would reach every child started without an explicit ``env`` (an
    ``mpirun`` then fails to start its ranks, and every later test that launches one fails)."""
    mpi = sys.modules.get("mpi4py.MPI")
    before = mpi is not None and mpi.Is_initialized()
    result = yield
    mpi = sys.modules.get("mpi4py.MPI")
    if not before and mpi is not None and mpi.Is_initialized():
        raise AssertionError(f"{item.nodeid} initialised MPI in the pytest process (through "
                             "lowcomm.init() or a command run by conftest.cli() that got past "
                             "its checks): run it under mpirun instead")
    return result
