"""A pytest plugin for pytest under mpirun, where every rank runs the same test functions.

The test functions take the world ``comm``. The plugin is loaded with ``-p under_mpi`` by
:func:`tests.conftest.run_mpi_suite` (``mpirun -n K python -m pytest ...``; a plugin, not a
conftest.py, so that the one-process suite never meets it). After each test the ranks exchange
their outcomes, so a test that failed on any rank fails on every rank, naming the ranks and their
first line of error; each rank logs its outcomes, case by case, to
``$LOWCOMM_TEST_REPORTS/rank<r>.jsonl``, which the launching test reads: a line when a case
starts (``unfinished``), when this rank's outcome is known and after the exchange, so a job that
is killed (a hang: one rank failed between two collectives the others still wait in) still says
which case each rank was in and which rank failed first.

``SIZE`` and ``RANK`` are known at import (from the launcher's environment, without an MPI
call), so a check file can parametrize its cases by the world size; a case that applies to some
sizes only is marked ``@pytest.mark.mpi(min_size=2)`` or ``@pytest.mark.mpi(sizes=(2, 3))`` and
is not collected at the others. Every case collected applies, and none needs to skip. Files here
are named ``check_*.py`` so that the outer suite (one process) never collects them. To run one
file, or some of its cases, by hand::

    PYTHONPATH=tests/mpi launchers/local.sh -n 3 .venv/bin/python -m pytest -p under_mpi \\
        -o python_files='check_*.py' -p no:cacheprovider tests/mpi/check_allreduce.py -k 'ring and float16'
"""
import json
import os

import pytest
import torch

import lowcomm

torch.set_num_threads(1)


def _env_int(*names: str, default: int) -> int:
    return next((int(os.environ[n]) for n in names if n in os.environ), default)


RANK = _env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
SIZE = _env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi(min_size=1, sizes=None): the world sizes a case "
                            "applies to; at other sizes it is not collected")


def pytest_collection_modifyitems(config, items):
    """Deselect the cases whose ``mpi`` marker excludes this world size."""
    keep, drop = [], []
    for item in items:
        m = item.get_closest_marker("mpi")
        fits = m is None or (SIZE >= m.kwargs.get("min_size", 1) and
                             SIZE in m.kwargs.get("sizes", (SIZE,)))
        (keep if fits else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def comm():
    return lowcomm.init()


#: what a check may set on the one world Comm of the process (a Topology sets its link, the
#: auto all-reduce caches its choice, a loop its timeouts) and a fresh process would not have
WORLD_SETTINGS = ("link", "validate", "auto_policy", "idle")
WATCHDOG_SETTINGS = ("timeout_s", "factor", "outage_s")


@pytest.fixture(scope="module", autouse=True)
def fresh_world():
    """Each check file finds the world Comm as a process of its own would: several files share
    one mpirun (tests/conftest.py: shared_mpi_suite), so what one file set is put back after it."""
    world = lowcomm.init()
    saved = [getattr(world, a) for a in WORLD_SETTINGS]
    dog = [getattr(world.watchdog, a) for a in WATCHDOG_SETTINGS]
    yield
    for a, v in zip(WORLD_SETTINGS, saved):
        setattr(world, a, v)
    for a, v in zip(WATCHDOG_SETTINGS, dog):
        setattr(world.watchdog, a, v)


@pytest.fixture(scope="module")
def shared_dir(comm, tmp_path_factory, request):
    """A folder every rank sees, one per check file: rank 0's (each rank's ``tmp_path`` is its
    own)."""
    return comm.bcast_object(tmp_path_factory.mktemp(request.module.__name__) if RANK == 0 else None)


def _record(name: str, outcome: str) -> None:
    """One line ``{"case": name, "outcome": outcome}`` more in this rank's report (the last line
    of a case says how it ended); flushed, so a killed job leaves it behind."""
    global _REPORT
    reports = os.environ.get("LOWCOMM_TEST_REPORTS")
    if reports:
        if _REPORT is None:
            _REPORT = open(os.path.join(reports, f"rank{RANK}.jsonl"), "a")
        _REPORT.write(json.dumps({"case": name, "outcome": outcome}) + "\n")
        _REPORT.flush()


def _name(item) -> str:
    """``check_x.py::test_y[case]``."""
    return f"{item.path.name}::{item.name}"


def _first_line(excinfo) -> str:
    return (str(excinfo.value).splitlines() or [excinfo.typename])[0][:300]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _record(_name(item), "unfinished")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup" and report.failed:     # no exchange: the others are elsewhere
        _record(_name(item), f"failed in setup: {_first_line(call.excinfo)}")
    if report.when != "call":
        return
    mine = None if report.passed or report.skipped else _first_line(call.excinfo)
    _record(_name(item), "skipped" if report.skipped else "passed" if mine is None else f"failed: {mine}")
    every = lowcomm.init().allgather_object(mine)
    failed = {r: m for r, m in enumerate(every) if m is not None}
    if failed and report.passed:
        report.outcome = "failed"
        report.longrepr = "failed on other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    _record(_name(item), "skipped" if report.skipped else "passed" if report.passed else
            f"failed: {mine or report.longrepr}")


_REPORT = None
