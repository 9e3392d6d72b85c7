"""Local SGD, DiLoCo and streaming DiLoCo (tests/workers/outer.py, under real mpirun)."""
import pytest

from conftest import run_worker
from lowcomm.compress import COMPRESSORS
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError


@pytest.mark.parametrize("np", [2, 3])
def test_outer_loops_equal_their_references(np):
    oks = run_worker(np, "outer.py", "equivalence", timeout=150)
    assert len(set(oks.values())) == 1 and min(oks.values()) > 100, oks


def test_state_dict_round_trip_is_bit_identical():
    oks = run_worker(2, "outer.py", "resume", timeout=120)
    assert len(set(oks.values())) == 1 and min(oks.values()) >= 4 * 8, oks


def test_bad_arguments_are_config_errors_before_any_communication():
    assert set(run_worker(2, "outer.py", "errors", timeout=60).values()) == {10}


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
