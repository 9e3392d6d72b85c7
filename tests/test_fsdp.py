"""FSDP (torch FSDP2 behind lowcomm's method interface) under real mpirun
(tests/mpi/check_fsdp.py, each case asserted on every rank), and its config errors."""
import pytest

from conftest import run_mpi_suite
from lowcomm.errors import ConfigError
from lowcomm.run.api import load_config


def test_fsdp_on_two_ranks():
    cases = run_mpi_suite(2, "check_fsdp.py", timeout=300)
    assert "check_fsdp.py::test_fsdp_equals_syncdp_bit_for_bit_at_two_ranks[gpt2]" in cases
    assert "check_fsdp.py::test_resume_on_one_rank_continues_the_two_rank_run" in cases


@pytest.mark.parametrize("overrides, key, words", [
    (["topology=dc:2,rank:2", "policy.dc=fsdp", "policy.rank=fsdp"], "policy.dc",
     "fsdp would shard across the 'dc' level, a wide-area link"),
    (["topology=dc:2,rank:2", "strategy.name=fsdp"], "strategy.name", "across the 'dc' level"),
    (["topology=dc:2,rank:2", "policy.rank=fsdp", "policy.dc=diloco:period=4"], "policy.dc",
     "diloco over policy.rank=fsdp is not supported"),
    (["topology=dc:2,rank:2", "policy.rank=fsdp", "policy.dc=localsgd:period=4"], "policy.dc",
     "localsgd over policy.rank=fsdp is not supported"),
    (["topology=dc:2,rank:2", "policy.rank=fsdp"], "policy.dc",       # policy.dc is syncdp
     "dc=syncdp, rank=fsdp run as one strategy"),
    (["strategy.name=fsdp", "strategy.wrap= "], "strategy.wrap", "is empty"),
    (["strategy.name=fsdp", "strategy.param_dtype=fp8"], "strategy.param_dtype", "unknown value"),
])
def test_bad_fsdp_settings_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_fsdp_inside_a_datacenter_is_accepted():
    cfg = load_config(None, ["topology=node:2,rank:2", "policy.node=fsdp:wrap=Linear",
                             "policy.rank=fsdp:wrap=Linear"])
    assert cfg.policy["node"].startswith("fsdp")
