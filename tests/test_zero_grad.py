"""Parameters whose gradient is zero on every rank stay where they are, under every compressor
and 1-bit Adam; 1-bit Adam against its equations and the paper's (tests/workers/zero_grad.py)."""
import pytest

from conftest import run_worker


@pytest.mark.parametrize("np_", [2, 3])
def test_onebit_adam_equals_its_equations_and_the_paper_where_the_variance_is_uniform(np_):
    # two updates x 4 steps, and the masked parameters
    assert set(run_worker(np_, "zero_grad.py", "onebit", timeout=120).values()) == {9}


def test_onebit_adam_on_the_builtin_task_keeps_the_key_bias_put_and_no_nan():
    """d_model 32, one layer, freeze_step 10: before, the key bias (gradient zero up to
    rounding, ~1e-12) reached |4e5| and the run died with a NaN by step 100."""
    assert set(run_worker(2, "zero_grad.py", "task", timeout=180).values()) == {2}
