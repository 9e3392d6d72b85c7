"""ZeRO-1/2 and ZeRO++ (tests/mpi/check_zero.py) on 2 and on 4 ranks, each case asserted on every
rank."""
from conftest import run_mpi_suite


def test_zero_equals_syncdp_on_two_ranks_with_half_the_optimizer_state():
    cases = run_mpi_suite(2, "check_zero.py", timeout=400)
    assert "check_zero.py::test_equals_syncdp_with_a_quarter_or_half_of_the_optimizer_state[zero2]" in cases


def test_zero_on_four_ranks():
    cases = run_mpi_suite(4, "check_zero.py", timeout=400)
    assert "check_zero.py::test_ledger_bytes_are_the_papers_formulas" in cases
