"""algorithm="auto" without MPI: the table's nearest size, its errors, and the α–β rule."""
import json

import pytest

from lowcomm.errors import LowcommError
from lowcomm.comm.topology import Topology
from lowcomm.comm.tuning import TABLE_ENV, Policy, load_table, table_path


class FakeLevels:      # what Policy reads of the topology's communicators
    def __init__(self, spec):
        self.topology = Topology.parse(spec)
        self.names, self.size = self.topology.names, self.topology.size


def test_table_nearest_size_and_availability(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"ranks": 4, "times_us": {
        "4096": {"mpi": 5, "tree": 3, "shm": 1}, "16777216": {"mpi": 9, "ring": 8, "hierarchical": 2}}}))
    p = Policy(4, True, 2e-6, 5e9, load_table(f, 4))
    assert p.choose(4096) == "shm" and p.choose(100) == "shm"
    assert p.choose(8 << 20) == "ring"                 # nearest is 16 MiB; no levels: no hierarchical
    assert p.choose(8 << 20, FakeLevels("node:2,rank:2")) == "hierarchical"
    remote = Policy(4, False, 2e-6, 5e9, load_table(f, 4))
    assert remote.choose(4096) == "tree"               # shm needs one node


def test_table_errors_name_the_file(tmp_path, monkeypatch):
    f = tmp_path / "t.json"
    assert load_table(f, 4) is None                    # no file: the model decides
    f.write_text("{not json")
    with pytest.raises(LowcommError, match="malformed"):
        load_table(f, 4)
    f.write_text(json.dumps({"ranks": 4, "times_us": {"4096": {"butterfly": 1}}}))
    with pytest.raises(LowcommError, match="butterfly"):
        load_table(f, 4)
    monkeypatch.setenv(TABLE_ENV, str(tmp_path))
    assert table_path(4, "h") == tmp_path / "allreduce-h-4.json"
    monkeypatch.setenv(TABLE_ENV, str(f))
    assert table_path(4, "h") == f


def test_alpha_beta_rule():
    local = Policy(4, True, 2e-6, 5e9)
    # on paper shm beats the vendor (fewer rounds, the same bytes), but the model never picks it
    # (only a measured table does): the vendor reduces through shared memory too, in C
    assert local.model_seconds("shm", 4096) < local.model_seconds("mpi", 4096)
    assert local.choose(4096) == "mpi" and local.choose(16 << 20) == "mpi"
    assert local.choose(64 << 20) == "mpi"
    assert Policy(4, False, 2e-6, 5e9).choose(16 << 20) == "mpi"     # vendor unless it lacks one
    assert Policy(1, True, 2e-6, 5e9).choose(1 << 20) == "mpi"
    # two datacenters of two ranks on a 25 ms / 100 Mbit/s link: hierarchical sends n/2 across
    levels = FakeLevels("dc:2,rank:2")
    wan = Policy(4, False, 25e-3, 100e6 / 8)
    assert wan.choose(16 << 20, levels) == "hierarchical"
    assert wan.model_seconds("hierarchical", 16 << 20, levels) < wan.model_seconds("mpi", 16 << 20, levels)
