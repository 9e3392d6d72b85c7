"""ZeRO-1/2 and ZeRO++ (tests/mpi/check_zero.py) on 2 and on 4 ranks, each case asserted on every
rank."""
import pytest

from conftest import shared_mpi_suite


@pytest.mark.mpi_checks("check_zero.py", np=2, timeout=400)
def test_zero_equals_syncdp_on_two_ranks_with_half_the_optimizer_state():
    cases = shared_mpi_suite(2, "check_zero.py")
    assert "check_zero.py::test_equals_syncdp_with_a_quarter_or_half_of_the_optimizer_state[zero2]" in cases


@pytest.mark.mpi_checks("check_zero.py", np=4, timeout=400)
def test_zero_on_four_ranks():
    """At 4 ranks: the sums ordered otherwise (to 1e-6), the formulas at another K, reshard,
    and what needs 4 ranks (a dc:2,rank:2 policy, hpZ on node:2,rank:2); check_zero.py marks
    the cases 4 ranks add nothing to as 2-rank ones."""
    cases = shared_mpi_suite(4, "check_zero.py")
    assert "check_zero.py::test_hpz_shards_inside_the_node_and_equals_syncdp" in cases
    assert "check_zero.py::test_ledger_bytes_are_the_papers_formulas" in cases
