"""``lowcomm plan``: the memory and step model of split GPTs against hand-worked figures, and
the command's table and errors."""
import pytest

from lowcomm.tools.plan import SHAPES, Setting, Shape, Split, memory_gb, plan, step_seconds, wan_seconds


def test_memory_per_rank_is_megatrons_mixed_precision_adam_plus_dilocos_state_and_activations():
    shape, st = Shape("t", 2, 1024, seq=1024, vocab=1000), Setting()
    P = 12 * 2 * 1024 ** 2 + 1000 * 1024
    want = (P / 4 * (2 + 2 + 12 / 2 + 8) + 2 * 34 * 1024 * 1024 / 2) / 1e9
    assert memory_gb(shape, Split(tp=2, pp=2, dp=2), st) == pytest.approx(want)


def test_a_step_is_1f1bs_micro_batches_plus_the_bubble_and_a_round_crosses_the_shared_wan():
    shape, st = Shape("t", 4, 1024, seq=1024, vocab=1000), Setting(batch=24, dcs=3)
    step, busy = step_seconds(shape, Split(tp=1, pp=2, dp=2), st)
    micro = 24 / (3 * 2)
    compute = 6 * shape.params / 2 * 1024 / (st.flops * st.efficiency)
    assert busy == pytest.approx(micro * compute)
    assert step > (micro + 1) * compute          # the bubble (PP − 1 micro-batches) and DP
    assert wan_seconds(shape, Split(1, 2, 2), st) == pytest.approx(
        2 * 2 / 3 * shape.params * 8 / 1e9)


def test_neither_shape_fits_syncdp_on_80gb_and_the_70b_needs_16_way_splits():
    st = Setting()
    for shape in SHAPES.values():
        p = plan(shape, 96, st)
        assert p["syncdp_gb"] > st.memory_gb and p["fits"] >= 1
    best = plan(SHAPES["70b"], 96, st)["best"]["split"]
    assert best.tp * best.pp >= 16


def test_the_command_prints_each_shape_and_names_a_bad_option():
    from click.testing import CliRunner

    from lowcomm.cli.main import cli
    r = CliRunner().invoke(cli, ["plan", "--ranks", "96"])
    assert r.exit_code == 0 and "| 10B | 9.9 B | 96 (32) |" in r.output and "| 70B |" in r.output
    assert "assumed:" in r.output
    r = CliRunner().invoke(cli, ["plan", "--ranks", "97"])
    assert r.exit_code != 0 and "not multiples of --dcs 3" in r.output
    r = CliRunner().invoke(cli, ["plan", "--shapes", "huge"])
    assert r.exit_code != 0 and "'huge' is no shape" in r.output
