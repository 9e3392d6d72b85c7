"""Resume on another number of ranks: every method, 4 → 2 and 2 → 4, in one
4-rank mpirun (tests/mpi/check_resize.py, one case per method asserted on every rank): the merged
parameters equal the average of the old ranks' parameters recomputed from the checkpoint files,
and the resumed run finishes with a finite eval loss and one model on every rank. The merge
rules' helpers, in one process."""
import logging
from types import SimpleNamespace

import pytest
import torch

from conftest import shared_mpi_suite
from lowcomm.run.checkpoint import CheckpointError
from lowcomm.errors import LowcommError
from lowcomm.run.snapshot import resized
from lowcomm.strategies import reshard
from lowcomm.strategies.outer.loop import OuterLoop
from lowcomm.strategies.outer.nesting import Nesting
from lowcomm.strategies.ps.protocol import fold


@pytest.mark.mpi_checks("check_resize.py", np=4, timeout=400, case_timeout=200)
def test_every_method_resumes_on_half_and_on_twice_the_ranks():
    cases = shared_mpi_suite(4, "check_resize.py")
    assert "check_resize.py::test_resumes_on_half_and_on_twice_the_ranks[async-ps]" in cases


# the merge rules themselves, in one process -----------------------------------------------------
def test_average_is_the_mean_of_floats_and_rank_0s_of_the_rest():
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([2.0, 2.0])
    assert torch.equal(reshard.average([a, b, c]), torch.tensor([2.0, 3.0]))
    counts = [torch.tensor([3]), torch.tensor([5])]
    assert reshard.average(counts) is counts[0]
    merged = reshard.average_optimizer([
        {"param_groups": [{"lr": 0.1}], "state": {0: {"step": torch.tensor(4.0), "exp_avg": a}}},
        {"param_groups": [{"lr": 0.1}], "state": {0: {"step": torch.tensor(4.0), "exp_avg": b}}}])
    assert torch.equal(merged["state"][0]["exp_avg"], torch.tensor([2.0, 3.5]))
    assert merged["state"][0]["step"].item() == 4.0 and merged["param_groups"] == [{"lr": 0.1}]


def test_replicas_that_differ_and_compressor_state_are_warned_about(caplog):
    same = [{"model": {"w": torch.ones(2)}, "strategy": {"k": r}} for r in range(3)]
    with caplog.at_level(logging.WARNING, "lowcomm.resize"):
        assert reshard.replicated(same, "syncdp")["strategy"] == {"k": 0}
        assert not caplog.records
        same[2]["model"]["w"] = torch.zeros(2)
        reshard.replicated(same, "syncdp")
        assert "rank 2's 'w' differs from rank 0's" in caplog.text
        assert reshard.reset_compressor([{}, {}], {"fresh": 1}, "syncdp") == {"fresh": 1}
        assert "reset" not in caplog.text
        reshard.reset_compressor([{"residuals": {"w": torch.ones(1)}}, {}], {}, "diloco")
        assert "diloco: the compressor state of the 2 old ranks" in caplog.text
        assert "is reset, not summed into the merged replica" in caplog.text


def test_per_worker_counters_fold_keeping_totals():
    assert fold([1, 2, 3, 4], 2) == [4, 6] and fold([5, 7], 3) == [5, 7, 0]


def test_a_method_that_cannot_be_resized_says_why():
    loop = object.__new__(OuterLoop)            # a level of a per-level policy
    loop.name, loop.nest = "diloco", Nesting(inner=object(), inside=None, leaders=None)
    with pytest.raises(LowcommError, match="per-level policy, whose topology fixes the number"):
        loop.reshard([{"model": {}, "strategy": {"t": 3}}] * 2)
    state = {"step": 6, "world_size": 4, "ranks": [{"model": {}, "strategy": {"t": 3}}] * 4}
    with pytest.raises(CheckpointError, match="checkpoint ck was written by 4 ranks and cannot "
                                              "be resumed on 2: diloco is a level"):
        resized(state, SimpleNamespace(rank=0, size=2), loop, "ck")


def test_an_add_local_fragment_in_flight_keeps_the_average_of_the_ranks_bases():
    loop = object.__new__(OuterLoop)
    loop.name, loop.nest, loop.compressor, loop._dense = "streaming-diloco", None, None, None
    opt = {"param_groups": [{"lr": 0.1}], "state": {}}
    avg = torch.tensor([5.0, 5.0])

    def rank(base):
        return {"model": {"w": base + 1}, "strategy": {
            "t": 3, "optimizer": opt, "syncs": [], "in_flight": [(0, 3, 4, avg, [], base)]}}
    merged = loop.reshard([rank(torch.tensor([1.0, 2.0])), rank(torch.tensor([3.0, 6.0]))])
    (f, start, at, got, rows, base), = merged["strategy"]["in_flight"]
    assert (f, start, at) == (0, 3, 4) and torch.equal(got, avg)
    assert torch.equal(base, torch.tensor([2.0, 4.0]))            # the mean of the two ranks' bases
    assert torch.equal(merged["model"]["w"], torch.tensor([3.0, 5.0]))
