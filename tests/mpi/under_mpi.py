"""A pytest plugin for pytest under mpirun: every rank runs the same test functions, which take
the world ``comm``.

Loaded with ``-p under_mpi`` by :func:`tests.conftest.run_mpi_suite` (``mpirun -n K python -m
pytest ...``; a plugin, not a conftest.py, so that the one-process suite never meets it). After
each test the ranks exchange their outcomes, so a test that failed on any rank fails on every
rank, naming the ranks and their first line of error; each rank keeps its outcomes, case by case,
in ``$LOWCOMM_TEST_REPORTS/rank<r>.json`` (rewritten after every case, so a job that is killed
still says how far it got), which the launching test reads. Files here are named
``check_*.py`` so that the outer suite (one process) never collects them.
"""
import json
import os

import pytest
import torch

import lowcomm

torch.set_num_threads(1)


RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


@pytest.fixture(scope="session")
def comm():
    return lowcomm.init()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    mine = None if report.passed or report.skipped else \
        (str(call.excinfo.value).splitlines() or [call.excinfo.typename])[0][:300]
    every = lowcomm.init().allgather_object(mine)
    failed = {r: m for r, m in enumerate(every) if m is not None}
    if failed and report.passed:
        report.outcome = "failed"
        report.longrepr = "failed on other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    _OUTCOMES[item.name] = "skipped" if report.skipped else "passed" if report.passed else \
        f"failed: {mine or report.longrepr}"
    reports = os.environ.get("LOWCOMM_TEST_REPORTS")
    if reports:
        with open(os.path.join(reports, f"rank{RANK}.json"), "w") as f:
            json.dump(_OUTCOMES, f)


_OUTCOMES: dict[str, str] = {}
