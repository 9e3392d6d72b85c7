import pytest

from conftest import run_worker

# 4 algorithms x (5 sizes x 4 dtypes x 5 checks + 2 random + 2 shape) + 2 closing checks
CHECKS = 4 * (5 * 4 * 5 + 2 + 2) + 2


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_allreduce_algorithms_match_mpi_allreduce(np):
    assert set(run_worker(np, "allreduce.py").values()) == {CHECKS}
