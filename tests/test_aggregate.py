"""Robust aggregation of pseudo-gradients (lowcomm/strategies/outer/aggregate.py) against its
equations, the member score, the corruption a fault injects (lowcomm/run/fleet/corrupt.py),
and the settings a method or fleet cannot carry — in-process; the rules through an MPI job's
all-gather in the shared 3-rank job (tests/mpi/check_aggregate.py)."""
import pytest
import torch

from conftest import shared_mpi_suite
from lowcomm.comm.round_tag import RoundTag
from lowcomm.errors import ConfigError
from lowcomm.run.fleet.corrupt import Corruptor, CorruptError, parse_kind, write_fault
from lowcomm.strategies.outer.aggregate import (Aggregator, Strikes, clipped_mean,
                                                coordinate_median, trimmed_mean)


def rows(k=5, n=7, seed=0):
    return torch.randn(k, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_clipped_mean_is_its_equation():
    x = rows()
    x[3] *= 50                                       # one far out
    c = 1.5
    norms = [float(r.norm()) for r in x]
    m = sorted(norms)[2]                             # median of 5
    want = sum(min(1.0, c * m / nk) * r for nk, r in zip(norms, x)) / 5
    got, factor = clipped_mean(x, c)
    assert torch.allclose(got, want)
    assert factor[3] == pytest.approx(c * m / norms[3]) and factor[3] < 1
    # even K: the median norm is the mean of the two middle ones
    y = x[:4]
    m4 = sum(sorted(float(r.norm()) for r in y)[1:3]) / 2
    want4 = sum(min(1.0, c * m4 / float(r.norm())) * r for r in y) / 4
    assert torch.allclose(clipped_mean(y, c)[0], want4)


def test_trimmed_mean_and_median_per_coordinate():
    x = rows(6, 9, 1)
    for j in range(9):
        col = sorted(x[:, j].tolist())
        assert trimmed_mean(x, 2)[j].item() == pytest.approx(sum(col[2:4]) / 2)
        assert trimmed_mean(x, 1)[j].item() == pytest.approx(sum(col[1:5]) / 4)
        assert coordinate_median(x)[j].item() == pytest.approx((col[2] + col[3]) / 2)
        assert coordinate_median(x[:5])[j].item() == pytest.approx(sorted(x[:5, j].tolist())[2])


@pytest.mark.parametrize("rule", ["clip", "trim", "median"])
def test_one_bad_member_is_kept_out(rule):
    """Four members, one sending 100 × its pseudo-gradient (or NaN): the rule's result stays
    within the honest members' spread; ``mean`` does not."""
    honest = torch.ones(3, 4, dtype=torch.float64) + 0.01 * rows(3, 4)
    for bad in (100 * honest[0], torch.full((4,), float("nan"), dtype=torch.float64)):
        x = torch.cat([honest, bad[None]])
        agg = Aggregator(rule, clip=2.0, trim=1, strikes=3)(x, [0, 1, 2, 3])
        assert torch.isfinite(agg).all()
        assert (agg - 1).abs().max() < 0.1 if rule != "clip" else (agg - 1).abs().max() < 0.6
    assert (x.mean(0) - 1).abs().max() > 10 or not torch.isfinite(x.mean(0)).all()


def test_non_finite_never_applied():
    agg = Aggregator("mean")
    assert agg.mean_of(torch.tensor([1.0, float("inf")])) is None
    only_bad = torch.full((3, 2), float("nan"))
    assert Aggregator("median")(only_bad, [0, 1, 2]) is None


def test_strikes_fence_and_clear():
    s = Strikes(limit=2)
    assert s.score([0, 1], [True, False]) == [1] and 1 not in s.fenced
    s.score([0, 1], [True, False])
    assert s.fenced == {1} and s.count[1] == 2
    s.score([0, 1], [True, True])                    # sane again: back in
    assert s.fenced == set() and s.count[1] == 0 and s.clipped[1] == 2
    s.score([0, 1], [True, False], [1.0, 0.25])      # how far: 1 − its clip factor
    assert s.cut[1] == pytest.approx(2 + 0.75)
    s2 = Strikes(limit=2)
    s2.load_state_dict(s.state_dict())
    assert (s2.count, s2.clipped, s2.cut, s2.fenced) == (s.count, s.clipped, s.cut, s.fenced)


def test_fenced_member_left_out_of_the_rule():
    agg = Aggregator("clip", clip=2.0, strikes=2)
    x = torch.ones(4, 3, dtype=torch.float64)
    x[2] *= 100
    agg(x, [0, 1, 2, 3])
    assert agg.last.struck == [2] and agg.last.used == [0, 1, 2, 3]
    agg(x, [0, 1, 2, 3])
    assert agg.last.fenced == [2] and agg.last.used == [0, 1, 3]
    assert torch.equal(agg(x, [0, 1, 2, 3]), torch.ones(3, dtype=torch.float64))


def test_corruption_kinds(tmp_path):
    x = torch.arange(1.0, 5.0)
    c = Corruptor(tmp_path, 1)
    tag = lambda t: RoundTag.sync(t, 0)              # noqa: E731
    assert torch.equal(c(x, tag(1)), x)              # no fault file
    for kind, want in (("nan", None), ("scale=100", 100 * x), ("signflip", -x),
                       ("zero", torch.zeros(4))):
        write_fault(tmp_path, 1, kind, 1)
        got = c(x, tag(2))
        assert torch.isnan(got).all() if want is None else torch.equal(got, want)
    write_fault(tmp_path, 1, "noise=0.5", 1)
    noisy = c(x, tag(3))
    assert 0 < (noisy - x).abs().max() < 5
    write_fault(tmp_path, 1, "stale=2", 1)
    sent = [c(x + i, tag(10 + i)) for i in range(4)]
    assert torch.equal(sent[3], x + 1)               # two rounds older than x + 3
    c2 = Corruptor(tmp_path, 1)
    write_fault(tmp_path, 1, "signflip", 3)
    assert [torch.equal(c2(x, tag(i)), x) for i in range(4)] == [True, True, False, False]


@pytest.mark.parametrize("kind", ["bogus", "scale", "nan=1", "stale=0", "noise=-1", "scale=x"])
def test_bad_kind_is_named(kind):
    with pytest.raises(CorruptError, match="--kind"):
        parse_kind(kind)


def test_rules_a_method_or_fleet_cannot_carry():
    from lowcomm.run.config import load_config as load
    from lowcomm.run.fleet.plan import plan
    from lowcomm.strategies.outer.aggregate import check_rule
    from lowcomm.strategies.outer.async_diloco import AsyncSettings
    from lowcomm.strategies.outer.diloco import DiLoCoSettings
    from lowcomm.strategies.outer.dylu import DyLUSettings
    from lowcomm.strategies.outer.localsgd import LocalSGDSettings
    from lowcomm.strategies.outer.sparseloco import SparseLoCoSettings
    with pytest.raises(ConfigError, match="localsgd averages"):
        LocalSGDSettings(aggregate="median").validate("strategy.")
    with pytest.raises(ConfigError, match="diloco-async"):
        AsyncSettings(aggregate="clip").validate("strategy.")
    with pytest.raises(ConfigError, match="aggregate.*unknown|unknown.*aggregate"):
        DiLoCoSettings(aggregate="mode").validate("strategy.")
    with pytest.raises(ConfigError, match="strategy.aggregate.*PowerSGD"):
        DiLoCoSettings(aggregate="trim", compressor="powersgd").validate("strategy.")
    DiLoCoSettings(aggregate="trim", compressor="int8").validate("strategy.")
    with pytest.raises(ConfigError, match="sparseloco reduces"):
        SparseLoCoSettings(aggregate="clip").validate("strategy.")
    with pytest.raises(ConfigError, match="diloco-dylu"):
        DyLUSettings(aggregate="clip").validate("strategy.")
    with pytest.raises(ConfigError, match="median of 2"):
        check_rule("median", 2, 1)
    cfg = load(None, ["strategy.name=diloco", "strategy.aggregate=median", "fleet.dcs=2"])
    with pytest.raises(ConfigError, match="policy.dc.aggregate.*median of 2"):
        plan(cfg, 2, 2)
    plan(load(None, ["strategy.name=diloco", "strategy.aggregate=median", "fleet.dcs=3"]), 3, 3)


@pytest.mark.mpi_checks("check_aggregate.py", np=3, timeout=120)
def test_the_rules_through_an_mpi_all_gather():
    """tests/mpi/check_aggregate.py in the shared 3-rank job: each rule's outer step is its
    equation over what the ranks sent (dense and int8), NaN under mean is never applied, the
    all-gather's bytes are charged, PowerSGD is refused."""
    cases = shared_mpi_suite(3, "check_aggregate.py")
    assert "check_aggregate.py::test_int8_payloads_are_decoded_each_then_aggregated" in cases
    assert sum("test_one_outer_step_is_the_rules_equation" in c for c in cases) == 3
