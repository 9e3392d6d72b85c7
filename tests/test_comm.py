import pytest

from conftest import run_worker


@pytest.mark.parametrize("np", [1, 3, 4])   # 3: uneven splits, 4: a power of two
def test_comm_calls_on_every_rank(np):
    expected = 10 + (5 if np > 1 else 0)
    assert set(run_worker(np, "comm.py").values()) == {expected}
