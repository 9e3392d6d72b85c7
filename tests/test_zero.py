"""ZeRO-1/2 and ZeRO++ (tests/mpi/check_zero.py) on 2 and on 4 ranks, each case asserted on every
rank."""
from conftest import run_mpi_suite


def test_zero_equals_syncdp_on_two_ranks_with_half_the_optimizer_state():
    cases = run_mpi_suite(2, "check_zero.py", timeout=400)
    assert "check_zero.py::test_equals_syncdp_with_a_quarter_or_half_of_the_optimizer_state[zero2]" in cases


def test_zero_on_four_ranks():
    """At 4 ranks: the sums ordered otherwise (to 1e-6), the formulas at another K, reshard,
    and what needs 4 ranks (a dc:2,rank:2 policy, hpZ on node:2,rank:2)."""
    cases = run_mpi_suite(4, "check_zero.py", "-k", "zero2] or tensor] or ledger or outer or hpz "
                          "or reshard or qgz", timeout=400)
    assert "check_zero.py::test_hpz_shards_inside_the_node_and_equals_syncdp" in cases
    assert "check_zero.py::test_ledger_bytes_are_the_papers_formulas" in cases
