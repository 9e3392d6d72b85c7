"""Local SGD, DiLoCo and streaming DiLoCo (tests/mpi/check_outer.py, under real mpirun, each case
asserted on every rank)."""
import pytest

from conftest import shared_mpi_suite
from lowcomm.compress import COMPRESSORS
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.mpi_checks("check_outer.py", timeout=300)
def test_outer_loops_equal_their_references_resume_and_refuse_bad_arguments(np):
    """The equivalences on 2 and 3 ranks; the state_dict round trips and the argument errors
    (which do not depend on the rank count) on 2."""
    cases = shared_mpi_suite(np, "check_outer.py")
    for name in (n for n in COMPRESSORS if n != "none"):
        assert f"check_outer.py::test_every_compressor_compresses_the_pseudo_gradient[{name}]" in cases
        assert (f"check_outer.py::test_a_state_dict_round_trip_continues_bit_identically[streaming-{name}]"
                in cases) == (np == 2)
    assert any("argument_error" in name for name in cases) == (np == 2)


@pytest.mark.parametrize("overrides, key", [
    (["strategy.name=localsgd", "strategy.period=0"], "strategy.period"),
    (["strategy.name=diloco", "strategy.period=-3"], "strategy.period"),
    (["strategy.name=streaming-diloco", "strategy.period=8", "strategy.delay=8"], "strategy.delay"),
    (["strategy.name=streaming-diloco", "strategy.fragments=0"], "strategy.fragments"),
    (["strategy.name=streaming-diloco", "strategy.alpha=2"], "strategy.alpha"),
    (["strategy.name=streaming-diloco", "strategy.merge=avg"], "strategy.merge"),
    (["strategy.name=streaming-diloco", "strategy.merge=add-local", "strategy.alpha=0.5"], "strategy.alpha"),
    (["strategy.name=diloco", "strategy.outer_momentum=0"], "strategy.outer_momentum"),
    (["strategy.name=diloco", "strategy.outer_lr=0"], "strategy.outer_lr"),
    (["strategy.name=localsgd", "strategy.compressor=fp16"], "strategy.compressor"),
    (["strategy.name=diloco", "compressor.name=fp16"], "compressor.name"),
    (["strategy.name=diloco", "strategy.backend=horovod"], "strategy.backend"),
])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key, str(e.value)
    if "fp16" in COMPRESSORS and "compressor" in key:   # else: the unknown name, same key
        assert "diloco" in str(e.value) or "warmup_steps" in str(e.value), str(e.value)


def test_good_outer_configs_load():
    cfg = load_config(None, ["strategy.name=streaming-diloco", "strategy.period=100",
                             "strategy.fragments=4", "strategy.delay=5", "strategy.alpha=0.5"])
    assert (cfg.strategy["period"], cfg.strategy["fragments"], cfg.strategy["delay"]) == (100, 4, 5)
    load_config(None, ["strategy.name=diloco", "strategy.outer_optimizer=sgd",
                       "strategy.outer_lr=1", "strategy.outer_momentum=0"])
