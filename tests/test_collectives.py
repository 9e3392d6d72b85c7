import pytest

from conftest import run_worker

# 5 algorithms x (5 sizes x 4 dtypes x 5 checks + 2 random + 2 shape) + shm segmented (5 sizes
# x 2 dtypes x 2) + auto (4 table choices x 2, 4 runs x 2, wrong table, 2 model choices)
# + 2 closing checks
CHECKS = 5 * (5 * 4 * 5 + 2 + 2) + 5 * 2 * 2 + (4 * 2 + 4 * 2 + 1 + 2) + 2


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_allreduce_algorithms_match_mpi_allreduce(np):
    assert set(run_worker(np, "allreduce.py").values()) == {CHECKS}
