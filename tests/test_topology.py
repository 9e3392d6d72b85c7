"""Topology specs, the α–β model and config validation (the hierarchical all-reduce against
MPI_Allreduce under mpirun at 1–4 ranks over several topologies: tests/mpi/check_topology.py,
run by tests/test_collectives.py)."""
import pytest

from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError
from lowcomm.comm.topology import LinkModel, Topology
from lowcomm.tools.wan import model_seconds


def test_parse_levels_and_unequal_groups():
    t = Topology.parse("dc:2,node:2+1,rank:2")
    assert t.names == ("dc", "node", "rank") and t.size == 6
    assert t.units("dc") == [[0, 1, 2, 3], [4, 5]] and t.units("node") == [[0, 1], [2, 3], [4, 5]]
    assert t.spec() == "dc:2,node:2+1,rank:2"
    assert t.level_of(0, 1) == "rank" and t.level_of(1, 2) == "node" and t.level_of(3, 4) == "dc"
    u = Topology.parse("node:2,rank:3+1")
    assert u.units("node") == [[0, 1, 2], [3]] and u.group_size("rank") == 3


@pytest.mark.parametrize("bad", ["dc", "dc:0,rank:2", "dc:2,rank:x", "dc:2,rank:1+1+1",
                                 "dc:2,dc:2", "dc:2@fast,rank:2", "9x:2"])
def test_bad_specs_name_the_key(bad):
    with pytest.raises(ConfigError, match="topology"):
        Topology.parse(bad)
    with pytest.raises(ConfigError, match="'topology'"):
        load_config(None, [f"topology={bad}"])


def test_config_accepts_levels():
    cfg = load_config(None, ["topology=dc:2,rank:2", "strategy.algorithm=hierarchical"])
    assert cfg.topology == "dc:2,rank:2" and cfg.strategy["algorithm"] == "hierarchical"


def test_alpha_beta_model():
    t = Topology.parse("dc:2@25ms/100mbit,rank:2")
    link = t.link("dc")
    assert link.alpha_s == pytest.approx(0.025) and link.bytes_per_s == pytest.approx(12.5e6)
    assert link.source == "config" and t.link("rank").source == "assumed"
    # ring all-reduce of n on 2 ranks: 2 rounds, n bytes sent
    n = 16 << 20
    assert t.predict("allreduce.ring", n, "dc") == pytest.approx(2 * 0.025 + n / 12.5e6)
    assert t.predict("send", n, "dc") == pytest.approx(0.025 + n / 12.5e6)
    assert LinkModel.parse("2us/5gb").bytes_per_s == 5 * 2**30
    rows = [{"level": "dc", "op": "allreduce.ring", "calls": 3, "bytes_sent": 3 * n, "bytes_recv": 0,
             "seconds": 0.0},
            {"level": "rank", "op": "reduce_scatter.ring", "calls": 3, "bytes_sent": n, "bytes_recv": 0,
             "seconds": 0.0},
            {"level": "world", "op": "check", "calls": 9, "bytes_sent": 10, "bytes_recv": 0, "seconds": 0.0}]
    per = t.model_seconds(rows)
    assert per["dc"] == pytest.approx(3 * 2 * 0.025 + 3 * n / 12.5e6)
    assert per["rank"] == pytest.approx(3 * 2e-6 + n / 5e9)
    assert per["total"] == pytest.approx(per["dc"] + per["rank"])
    m = model_seconds(rows, delay_ms=25, rate_mbit=100)
    assert m["seconds"] == pytest.approx(per["dc"]) and m["calls"] == 3 and m["bytes_sent"] == 3 * n


def test_cli_hierarchical_on_the_environments_topology(tmp_path):
    """``strategy.algorithm=hierarchical`` with the levels from $LOWCOMM_TOPOLOGY: the run builds
    the topology's communicators, and traffic is filed per level."""
    import json

    from conftest import run_ranks
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--out", tmp_path, "--set", "steps=3",
                  "--set", "strategy.algorithm=hierarchical", "--set", "model.d_model=32",
                  "--set", "model.n_layers=1", "--set", "data.max_bytes=300000",
                  "--set", "eval_batches=1", env={"LOWCOMM_TOPOLOGY": "dc:2,rank:1"}, timeout=120)
    assert r.returncode == 0, r.output
    s = json.loads((tmp_path / "summary.json").read_text())
    # across 2 datacenters of one rank each: every step, each rank sends its whole gradient once,
    # with one 4-byte presence slot per tensor (which ranks gave it a gradient)
    from lowcomm.run.api import load_config
    from lowcomm.tasks import load_task
    cfg = load_config(None, ["model.d_model=32", "model.n_layers=1", "data.max_bytes=300000"])
    tensors = len(list(load_task(cfg.task.name).model(cfg).parameters()))
    assert s["bytes_by_level"]["dc"] == 3 * 2 * 4 * (s["params"] + tensors), s["bytes_by_level"]
    assert s["ranks_agree"] is True


def test_a_wrong_lowcomm_topology_is_reported_as_that_variable(monkeypatch, tmp_path):
    """Not as config key 'topology', which the user never set."""
    class Job:                  # what from_env asks of the communicator here: its size
        size = 2
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.setenv("LOWCOMM_TOPOLOGY", "dc:3,rank:1")
    with pytest.raises(ConfigError) as e:
        Topology.from_env(Job())
    assert str(e.value).startswith("environment variable LOWCOMM_TOPOLOGY='dc:3,rank:1': "
                                   "'dc:3,rank:1' places 3 ranks but the job has 2"), str(e.value)
    assert "config key" not in str(e.value)
    with pytest.raises(ConfigError, match="^config key 'topology': 'dc:2,rank:2' places 4"):
        Topology.from_env(Job(), "dc:2,rank:2")      # the config's key wins, and is named
    monkeypatch.delenv("LOWCOMM_TOPOLOGY")
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    monkeypatch.setenv("LOWCOMM_HOSTFILE", str(tmp_path / "hosts"))
    with pytest.raises(ConfigError, match=r"^environment variable LOWCOMM_HOSTFILE='.*hosts': .*"
                                          "places 4 ranks but the job has 2"):
        Topology.from_env(Job())
