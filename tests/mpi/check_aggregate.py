"""Robust aggregation through an MPI job's all-gather (lowcomm/strategies/outer/aggregate.py), every
rank asserting, on 3 ranks whose last one sends 100 × its pseudo-gradient:

  * one outer step (SGD, lr 1, no momentum) moves θ by exactly the rule's equation over the
    pseudo-gradients the ranks sent (gathered here with the vendor all-gather), dense and
    through int8 (each rank's payload decoded on its own);
  * the clipped mean with nothing past its line is the plain mean;
  * a NaN pseudo-gradient under ``mean`` is never applied: θ stays, every rank returns to it;
  * the ledger charges the all-gather of one pseudo-gradient from each other rank;
  * the member score travels in the state dict;
  * a compressor whose payloads cannot be decoded alone (PowerSGD) is refused naming the setting.
"""
import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import assert_models_close, random_batch, seeded_mlp
from lowcomm.compress import build_compressor
from lowcomm.errors import ConfigError
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies import DiLoCo
from lowcomm.strategies.outer.aggregate import clipped_mean, coordinate_median, trimmed_mean
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(3,))
K, B, BAD = SIZE, 4, SIZE - 1
SGD1 = dict(period=3, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)


def train(steps, corrupt=None, **kw):
    """``steps`` steps of DiLoCo on the world; rank BAD's pseudo-gradient goes through
    ``corrupt``; returns the strategy (closed), θ before its first round, what each sent and the
    bytes its all-gathers received."""
    model = seeded_mlp(10, 16, 3)
    st = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), lowcomm.init(), **kw)
    before = st.comm.ledger.get("allgather", "world").bytes_recv      # (after the layout check)
    theta0 = st.outer_params[0].detach().clone()
    sent, own = [], st._outgoing

    def outgoing(f, local):
        out = own(f, local)
        out = corrupt(out) if corrupt is not None and RANK == BAD else out
        sent.append(out.clone())
        return out
    st._outgoing = outgoing
    for step in range(steps):
        x, y = random_batch(step, K * B)
        st.zero_grad()
        F.cross_entropy(model(x[RANK * B:(RANK + 1) * B]), y[RANK * B:(RANK + 1) * B]).backward()
        st.step()
    st.close()
    return st, theta0, sent, st.comm.ledger.get("allgather", "world").bytes_recv - before


def rows_sent(sent):
    return lowcomm.init().allgather(sent[0].contiguous())


@pytest.mark.parametrize("rule, equation", [
    ("clip", lambda r: clipped_mean(r, 2.0)[0]), ("median", coordinate_median),
    ("trim", lambda r: trimmed_mean(r, 1))])
def test_one_outer_step_is_the_rules_equation(rule, equation):
    st, theta0, sent, got = train(3, lambda x: 100 * x, aggregate=rule, clip=2.0, **SGD1)
    want = theta0 - equation(rows_sent(sent))
    assert torch.allclose(st.outer_params[0].detach(), want, atol=1e-6), rule
    assert st.route.aggregator.last.struck == [BAD] and st.route.aggregator.last.used == list(range(K))
    assert got == (K - 1) * theta0.numel() * 4, got


def test_int8_payloads_are_decoded_each_then_aggregated():
    comp = build_compressor(CompressorConfig(name="int8", start_iter=0, collective="allgather"))
    st, theta0, sent, got = train(3, lambda x: 100 * x, aggregate="median", compressor=comp, **SGD1)
    decoded = torch.stack([comp.decompress(*comp.compress(r, "w")) for r in rows_sent(sent)])
    assert torch.allclose(st.outer_params[0].detach(), theta0 - coordinate_median(decoded), atol=1e-6)
    assert 0 < got < (K - 1) * theta0.numel() * 4 / 3, got      # int8: about a quarter


def test_clip_with_nothing_past_its_line_is_the_mean():
    a = train(9, aggregate="clip", clip=1e6, period=3)[0]
    b = train(9, period=3)[0]
    assert_models_close(a.model, b.model, "clip with an unreachable line vs mean")


def test_a_nan_pseudo_gradient_is_never_applied_under_mean():
    st, theta0, _, _ = train(3, lambda x: torch.full_like(x, float("nan")), **SGD1)
    assert torch.equal(st.outer_params[0].detach(), theta0)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in st.model.parameters()]), theta0)


def test_powersgd_is_refused_naming_the_setting():
    comp = build_compressor(CompressorConfig(name="powersgd", start_iter=0))
    with pytest.raises(ConfigError, match="aggregate.*powersgd"):
        train(0, aggregate="clip", compressor=comp, period=3)


def test_the_member_score_is_saved_and_loaded():
    st = train(3, lambda x: 100 * x, aggregate="clip", **SGD1)[0]
    saved = st.state_dict()["aggregate"]
    assert saved["clipped"] == {str(BAD): 1} and saved["count"][str(BAD)] == 1, saved
    fresh = train(0, aggregate="clip", **SGD1)[0]
    fresh.load_state_dict(st.state_dict())
    assert fresh.route.aggregator.strikes.clipped == {BAD: 1}
