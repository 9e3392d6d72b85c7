"""Comm, the all-reduce algorithms, the hierarchical all-reduce over topologies and SyncDP under
real mpirun, one mpirun per rank count for the four check files (each case asserted on every
rank): tests/mpi/check_comm.py, check_allreduce.py (against vendor MPI_Allreduce),
check_topology.py (against vendor MPI_Allreduce, bytes per level) and check_syncdp.py (against
one process on the whole batch)."""
import pytest

import lowcomm
from conftest import shared_mpi_suite

FILES = ["check_comm.py", "check_allreduce.py", "check_topology.py", "check_syncdp.py"]


@pytest.mark.parametrize("np", [1, 2, 3, 4])   # 3: uneven chunks, 4: a power of two
@pytest.mark.mpi_checks(*FILES, timeout=400)
def test_comm_collectives_topologies_and_syncdp_under_mpirun(np):
    cases = shared_mpi_suite(np, FILES)
    ran = {name.split("::")[0] for name in cases}
    assert ran == set(FILES) - ({"check_syncdp.py"} if np == 2 else set()), ran
    for alg in lowcomm.ALGORITHMS:      # every algorithm, against the vendor's
        assert any(f"[{alg}-" in name or f"-{alg}]" in name or alg == "hierarchical"
                   and name.startswith("check_topology.py::test_equals_vendor") for name in cases), alg
    assert any("mismatched" in name for name in cases) == (np > 1)
    assert any("horovod" in name for name in cases) == (np == 3)
