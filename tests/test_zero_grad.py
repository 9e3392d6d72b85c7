"""Parameters whose gradient is zero on every rank stay where they are, under every compressor
and 1-bit Adam; 1-bit Adam against its equations and the paper's (tests/mpi/check_zero_grad.py,
each case asserted on every rank)."""
import math

import pytest
import torch

from conftest import shared_mpi_suite
from lowcomm.compress import COMPRESSORS, build_compressor
from lowcomm.compress.base import Segment
from lowcomm.run.config import CompressorConfig

LOSSY = [n for n in COMPRESSORS if n != "none"]


def layout(*shapes):
    out, off = [], 0
    for i, s in enumerate(shapes):
        out.append(Segment(f"p{i}", torch.Size(s), off, off + math.prod(s)))
        off += math.prod(s)
    return out, off


@pytest.mark.parametrize("name", LOSSY)
def test_a_parameter_that_is_all_zero_decodes_as_zero_and_keeps_no_error(name):
    """One rank alone: a weight, a bias whose gradient is zero, an unused layer's weight (zeros,
    as the Reducer fills it) and another weight; over three rounds (error feedback on where the
    method has it) the zero ones decode as exactly 0 and their residuals stay 0."""
    segs, n = layout((12, 10), (10,), (8, 9), (7, 5))
    c = build_compressor(CompressorConfig(name=name, start_iter=0, ratio=0.2))
    for step in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(step))
        for s in segs[1:3]:
            x[s.start:s.stop] = 0.0
        payload, ctx = c.compress(x, "b", segs)
        y = c.decompress(payload, ctx)
        for s in segs[1:3]:
            assert torch.equal(y[s.start:s.stop], torch.zeros(s.stop - s.start)), (name, s.name, step)
        assert bool(y[:segs[1].start].any()), "the other parameters are sent (the check can fail)"
        if c.error_feedback:
            for s in segs[1:3]:
                assert not bool(c.encoder.residuals[s.name].any()), (name, s.name, step)


@pytest.mark.parametrize("np_", [2, 3])   # even K: sign-mv's owners send base-3 digits; odd: flags
@pytest.mark.mpi_checks("check_zero_grad.py", timeout=300)
def test_zero_gradient_parameters_stay_put_and_onebit_adam_equals_its_equations(np_):
    """SyncDP with every compressor (both collectives where payloads are gathered) and 1-bit
    Adam past its warm-up: an unused layer and a layer behind a dead ReLU (exactly zero
    gradients for its weight and bias) are bit-for-bit where they started; before, they moved
    under sign, sign-mv, ef-sign (2e-2, 3e-2, 2e-3 after 10 steps) and 1-bit Adam (1e4). 1-bit
    Adam equals its equations, and Tang et al.'s Algorithm 1 where the variance is uniform. On
    2 ranks also 1-bit Adam on the built-in task (d_model 32, one layer, freeze_step 10): before,
    the key bias (gradient zero up to rounding, ~1e-12) reached |4e5| and the run died with a
    NaN by step 100."""
    cases = shared_mpi_suite(np_, "check_zero_grad.py")
    for name in COMPRESSORS:
        assert any(case.startswith("check_zero_grad.py::test_unused_and_dead_layers_stay_put_under_a_compressor"
                                   f"[{name}-") for case in cases), name
    assert any("builtin_task" in case for case in cases) == (np_ == 2)
