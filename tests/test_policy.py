"""Per-level policies under real mpirun (tests/mpi/check_policy.py, each case asserted on every
rank) and their config errors."""
import pytest

from conftest import shared_mpi_suite
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError


@pytest.mark.parametrize("np, specs", [(4, ["dc:2,rank:2", "node:2,rank:2"]), (3, ["dc:2,rank:2+1"])])
@pytest.mark.mpi_checks("check_policy.py", timeout=300)
def test_policies_equal_their_single_process_references(np, specs):
    cases = shared_mpi_suite(np, "check_policy.py")
    for spec in specs:
        assert f"check_policy.py::test_syncdp_at_every_level_is_minibatch_sgd[{spec}]" in cases, spec


@pytest.mark.parametrize("overrides, key", [
    (["topology=dc:2,rank:2", "policy.dc=diloco:perod=5"], "policy.dc.perod"),
    (["topology=dc:2,rank:2", "policy.dc=gossip"], "policy.dc"),
    (["topology=dc:2,rank:2", "policy.dc=diloco:period"], "policy.dc"),
    (["topology=dc:2,rank:2", "policy.dc=diloco:compressor=zip"], "policy.dc.compressor"),
    (["topology=dc:2,rank:2", "policy.dc=streaming-diloco:period=4,delay=4"], "policy.dc.delay"),
    (["topology=dc:2,rank:2", "policy.rank=localsgd:period=2"], "policy.dc"),
    (["topology=dc:2,rank:2", "policy.rack=syncdp"], "policy.rack"),
    (["topology=dc:2,rank:2", "strategy.name=diloco", "policy.dc=diloco"], "policy"),
    (["topology=dc:2,rank:2", "policy.dc=3"], "policy.dc"),
    (["topology=dc:2,rank:2", "compressor.name=fp16", "policy.rank=localsgd:period=2",
      "policy.dc=localsgd:period=4"], "compressor.name"),      # no syncdp level to use it
    (["topology=dc:2,rank:2", "policy.rank=diloco:period=2", "policy.dc=diloco:period=4"],
     "policy.rank"),                                        # an anchor below another outer loop
    (["topology=dc:2,rank:2", "policy.rank=streaming-diloco:period=2",
      "policy.dc=localsgd:period=4"], "policy.rank"),
    (["topology=dc:2,rank:2", "policy.rank=localsgd:period=2",
      "policy.dc=streaming-diloco:period=4,fragments=2,delay=1,merge=add-local"], "policy.dc.merge"),
])
def test_bad_policy_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key, str(e.value)


def test_policy_from_toml_table(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('topology = "dc:2,rank:2"\n[policy]\nrank = "syncdp"\n'
                 'dc = {name = "diloco", period = 50, compressor = "int8"}\n')
    cfg = load_config(f)
    assert cfg.policy == {"rank": "syncdp", "dc": "diloco:period=50,compressor=int8"}
    assert cfg.method == "policy(rank=syncdp;dc=diloco:period=50,compressor=int8)"


@pytest.mark.parametrize("below, above", [
    ("localsgd:period=2", "diloco:period=4"),
    ("localsgd:period=2", "streaming-diloco:period=4,fragments=2,delay=1,merge=mix"),
    ("localsgd:period=2", "streaming-diloco:period=4,fragments=2,delay=0,merge=add-local"),
    ("syncdp", "streaming-diloco:period=4,fragments=2,delay=1,merge=add-local"),
])
def test_the_outer_loop_nests_that_stay_allowed(below, above):
    cfg = load_config(None, ["topology=dc:2,rank:2", f"policy.rank={below}", f"policy.dc={above}"])
    assert cfg.policy == {"rank": below, "dc": above}
