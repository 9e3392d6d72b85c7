"""The suite's time limits scale with the machine's measured slowdown (tests/conftest.py), so
that a test asserts behaviour and not a margin the load decides."""
import os
import subprocess
import sys
import time

import pytest

import conftest
from conftest import MAX_SLOWDOWN, measure_slowdown, scaled, slowdown


def test_the_slowdown_is_measured_once_within_its_bounds_and_can_be_forced(monkeypatch):
    first = slowdown()
    assert 1.0 <= first <= MAX_SLOWDOWN
    assert slowdown() == first and conftest.slowdown.cache_info().currsize == 1, "measured once"
    assert scaled(10) == pytest.approx(10 * slowdown())
    monkeypatch.setenv("LOWCOMM_TEST_SLOWDOWN", "3.5")
    assert measure_slowdown() == 3.5
    monkeypatch.setenv("LOWCOMM_TEST_SLOWDOWN", "0.2")
    assert measure_slowdown() == 1.0, "a limit is never shortened"


def test_every_tests_own_time_bound_is_scaled(request):
    """setup.cfg's timeout (300 s) on this test, scaled by the session's slowdown."""
    m = request.node.get_closest_marker("timeout")
    assert m is not None and m.args[0] == pytest.approx(300 * slowdown()), m


def test_busy_processes_on_every_core_raise_the_measured_slowdown(monkeypatch):
    """Two busy loops per core for 4 s: the busy loop's wall over CPU seconds reaches at least
    1.5 (three runnable processes per core, this one included, give about 3)."""
    monkeypatch.delenv("LOWCOMM_TEST_SLOWDOWN", raising=False)
    n = 2 * (os.cpu_count() or 1)
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 4\n"
                              "while time.time() < t: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        under_load = measure_slowdown()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert under_load >= 1.5, f"slowdown {under_load:.2f} with {n} busy processes on {os.cpu_count()} cores"
