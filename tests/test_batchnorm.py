"""BatchNorm's running statistics recomputed on training batches (``bn_recompute``):
:func:`lowcomm.strategies.buffers.recompute_statistics` against torch's ``update_bn`` here, the
outer loops on 2 ranks under mpirun (tests/mpi/check_batchnorm.py, each case on every rank)."""
import pytest
import torch
from torch.optim.swa_utils import update_bn

from conftest import shared_mpi_suite
from lowcomm.errors import ArgumentError, ConfigError
from lowcomm.strategies.buffers import recompute_statistics
from lowcomm.strategies.outer.diloco import DiLoCoSettings


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4, momentum=0.3),
                               torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 10))


def batches(n=5):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 1, 8, 8, generator=g) * 3 + 1, torch.zeros(8, dtype=torch.long))
            for _ in range(n)]


def test_recomputed_statistics_are_update_bns_and_touch_neither_modes_nor_random_state():
    mine, ref = cnn(), cnn()
    mine.eval()
    update_bn(batches()[:4], ref)
    rng = torch.get_rng_state()
    assert recompute_statistics(mine, iter(batches()), 4) == 4
    assert torch.equal(torch.get_rng_state(), rng), "the recompute drew random numbers"
    bn, want = mine[1], ref[1]
    assert torch.allclose(bn.running_mean, want.running_mean) and \
        torch.allclose(bn.running_var, want.running_var)
    assert int(bn.num_batches_tracked) == 4 and bn.momentum == 0.3
    assert not any(m.training for m in mine.modules()), "training modes not restored"


def test_no_batch_is_an_error_naming_the_batches_that_leaves_the_statistics():
    m = cnn()
    m(batches()[0][0])
    before = m[1].running_mean.clone(), m[1].running_var.clone()
    with pytest.raises(ArgumentError, match="context.batches"):
        recompute_statistics(m, iter([]), 4)
    assert torch.equal(m[1].running_mean, before[0]) and torch.equal(m[1].running_var, before[1])
    assert m[1].momentum == 0.3 and m.training


@pytest.mark.parametrize("options, key", [({"bn_recompute": -1}, "strategy.bn_recompute"),
                                          ({"bn_recompute_at": "sync"}, "strategy.bn_recompute_at"),
                                          ({"bn_recompute": 4, "bn_recompute_at": "epoch"},
                                           "strategy.bn_recompute_at")])
def test_bad_settings_name_the_key(options, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DiLoCoSettings(period=2, **options).validate("strategy.")


@pytest.mark.mpi_checks("check_batchnorm.py", np=2, timeout=400, case_timeout=300)
def test_outer_loops_recompute_batchnorm_statistics_on_two_ranks():
    cases = shared_mpi_suite(2, "check_batchnorm.py")
    assert "check_batchnorm.py::test_diloco_with_recomputed_statistics_is_within_2_points_of_syncdp" in cases
