import pytest

import lowcomm
from conftest import run_worker

N_PARAMS = 8   # parameter tensors of the worker's Net (unused layer included)
BASE = ((len(lowcomm.ALGORITHMS) - 1) * 2 + 2) * N_PARAMS + 2   # every algorithm but hierarchical
# (it needs a topology: tests/test_topology.py), overlap on and off
HOROVOD = 2 * N_PARAMS + 1


@pytest.mark.parametrize("np", [1, 3, 4])   # 3: uneven chunks, 4: a power of two
def test_syncdp_equals_single_process_large_batch(np):
    assert set(run_worker(np, "syncdp.py").values()) == {BASE}


def test_horovod_backend_gives_the_same_parameters():
    assert set(run_worker(3, "syncdp.py", "--horovod").values()) == {BASE + HOROVOD}
