"""Every method is a torch optimizer where one is expected (tests/mpi/check_optimizer.py, on
2 ranks under mpirun, each case asserted on every rank)."""
from conftest import run_mpi_suite


def test_every_method_keeps_the_optimizer_contract_on_two_ranks():
    cases = run_mpi_suite(2, "check_optimizer.py", timeout=400)
    assert "check_optimizer.py::test_syncdp_buffers_follow_torch_ddp_broadcast_buffers" in cases
    assert any(name.endswith("[async-ps]") for name in cases)
