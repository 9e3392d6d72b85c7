"""Every method is a torch optimizer where one is expected (tests/mpi/check_optimizer.py, on
2 ranks under mpirun, each case asserted on every rank)."""
import pytest

from conftest import shared_mpi_suite


@pytest.mark.mpi_checks("check_optimizer.py", np=2, timeout=400)
def test_every_method_keeps_the_optimizer_contract_on_two_ranks():
    cases = shared_mpi_suite(2, "check_optimizer.py")
    assert "check_optimizer.py::test_syncdp_buffers_follow_torch_ddp_broadcast_buffers" in cases
    from lowcomm.run.registry import in_one_job       # every registered method (derived)
    for name in in_one_job():
        assert f"check_optimizer.py::test_is_an_optimizer_that_lr_schedulers_drive[{name}]" in cases, name


@pytest.mark.mpi_checks("check_own_loop.py", np=2, timeout=400)
def test_methods_in_the_users_own_loop_refuse_what_would_diverge_on_two_ranks():
    """tests/mpi/check_own_loop.py: parameters outside the model or added after build, progressive
    unfreezing (trained from then on, or refused by the methods that do not take it in),
    shapes that differ between ranks, another method's or another rank's state, sparse
    gradients, a second method on one optimizer, a model cast after build."""
    cases = shared_mpi_suite(2, "check_own_loop.py")
    assert any("unfrozen_after_build" in name and name.endswith("[gossip]") for name in cases)
    assert any("unfrozen_after_build" in name and name.endswith("[syncdp-int8]") for name in cases)
    assert any("another_shape_on_one_rank" in name and name.endswith("[zeroone-adam]") for name in cases)
