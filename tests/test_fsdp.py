"""FSDP (torch FSDP2 behind lowcomm's method interface) under real mpirun
(tests/mpi/check_fsdp.py, each case asserted on every rank), and its config errors."""
import json

import pytest
import torch

from conftest import run_ranks, shared_mpi_suite
from lowcomm.errors import ConfigError
from lowcomm.run.api import load_config
from lowcomm.run.evaluate import dict_sha256
from lowcomm.strategies.sharded.fsdp import join_shards


@pytest.mark.mpi_checks("check_fsdp.py", np=2, timeout=400)
def test_fsdp_on_two_ranks():
    cases = shared_mpi_suite(2, "check_fsdp.py")
    assert "check_fsdp.py::test_fsdp_equals_syncdp_bit_for_bit_at_two_ranks[gpt2]" in cases
    assert "check_fsdp.py::test_resume_on_one_rank_continues_the_two_rank_run" in cases


@pytest.mark.parametrize("overrides, key, words", [
    (["topology=dc:2,rank:2", "policy.dc=fsdp", "policy.rank=fsdp"], "policy.dc",
     "fsdp would shard across the 'dc' level, a wide-area link"),
    (["topology=dc:2,rank:2", "strategy.name=fsdp"], "strategy.name", "across the 'dc' level"),
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


def whole_model_sha(folder) -> str:
    """state_sha256 of the model whose shards the checkpoint ``folder``'s rank files hold."""
    return dict_sha256(join_shards([torch.load(f, weights_only=False)["model"]
                                    for f in sorted(folder.glob("rank-*.pt"))]))


def test_a_two_rank_fsdp_run_resumes_on_four_ranks(tmp_path):
    """``lowcomm train`` on the built-in task (wrap=auto: its transformer blocks): 2 ranks
    checkpoint their shards at step 3; resumed on 4 ranks (to steps=3), the model is exactly
    the 2 ranks' shards put together, and the 4 ranks agree."""
    sets = [a for o in ("strategy.name=fsdp", "steps=6", "checkpoint.every=3", "model.d_model=32",
                        "model.n_layers=2", "eval_batches=2", "batch_size=4", "log_every=3")
            for a in ("--set", o)]
    two, four = tmp_path / "two", tmp_path / "four"
    for np_, out, extra in ((2, two, []), (4, four, ["--resume", two, "--set", "steps=3"])):
        r = run_ranks(np_, "lowcomm", "train", "--quiet", "--out", out, *sets, *extra, timeout=300)
        assert r.returncode == 0, r.output
    summary = json.loads((four / "summary.json").read_text())
    assert summary["state_sha256"] == whole_model_sha(two / "checkpoints" / f"step-{3:08d}")
    assert summary["resizes"] == [{"step": 3, "from": 2, "to": 4}]
    assert summary["ranks_agree"] is True and summary["ranks"] == 4


def test_wrap_auto_picks_the_transformer_blocks_and_names_select_classes():
    transformers = pytest.importorskip("transformers")
    from lowcomm.errors import ArgumentError
    from lowcomm.strategies.sharded.fsdp import wrap_units
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2))
    blocks = list(model.transformer.h)
    assert wrap_units(model, "auto") == blocks[::-1]            # wrapped last block first
    assert wrap_units(model, "GPT2Block") == blocks[::-1]
    assert set(wrap_units(model, "GPT2Block,GPT2MLP")) == set(blocks) | {b.mlp for b in blocks}
    assert wrap_units(model, "none") == []
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert wrap_units(mlp, "auto") == []                         # no ModuleList: one unit
    with pytest.raises(ArgumentError, match="'wrap': 'Block' matches no module of Sequential"):
        wrap_units(mlp, "Block")


def test_streaming_diloco_over_fsdp_keeps_each_ranks_chunks_and_equals_it_over_syncdp(tmp_path):
    """``topology=dc:2,rank:2``, streaming DiLoCo (2 fragments, each landing a step late)
    between the datacenters, FSDP inside: each rank keeps the outer state of its chunk of every
    parameter and averages it with its counterpart in the other datacenter. Equal to the same
    loop over SyncDP bit for bit (two datacenters: one sum per element, in either order), with
    half the parameters and of Adam's moments per rank. (DiLoCo is its one-fragment case; over
    FSDP in a fleet: tests/test_fleet.py.)"""
    common = ["topology=dc:2,rank:2", "policy.dc=streaming-diloco:period=4,fragments=2,delay=1",
              "steps=12", "model.d_model=32",
              "model.n_layers=2", "eval_batches=2", "batch_size=4", "log_every=4"]
    out = {}
    for inside in ("syncdp", "fsdp"):
        sets = [a for o in (*common, f"policy.rank={inside}") for a in ("--set", o)]
        run_ranks(4, "lowcomm", "train", "--quiet", "--out", tmp_path / inside, *sets, timeout=400)
        out[inside] = json.loads((tmp_path / inside / "summary.json").read_text())
    plain, fsdp = out["syncdp"], out["fsdp"]
    assert fsdp["state_sha256"] == plain["state_sha256"] and fsdp["ranks_agree"], (fsdp, plain)
    assert fsdp["sharded"] and fsdp["inner"]["strategy"] == "fsdp", fsdp
    half, whole = fsdp["memory_by_rank"], plain["memory_by_rank"]
    assert [2 * m["param_bytes"] for m in half] == [m["param_bytes"] for m in whole], half
    for m, w in zip(half, whole):       # Adam's moments halved; its step counters stay whole
        assert 0 <= 2 * m["optimizer_state_bytes"] - w["optimizer_state_bytes"] <= 0.001 * \
            w["optimizer_state_bytes"], (m, w)


def test_the_torch_internals_fsdp_relies_on_are_where_it_expects_them():
    """The suite's torch has every private name of INTERNALS (a newer torch that moved one fails
    here first), and a missing one is a LowcommError naming the name, this torch's version, the
    releases tested and what to use instead."""
    from lowcomm.errors import LowcommError
    from lowcomm.strategies.sharded.fsdp import INTERNALS, torch_internal
    for module, names in INTERNALS.items():
        assert all(x is not None for x in torch_internal(module, *names))
    for module, names in (("torch.distributed.fsdp._no_such_module", ("DefaultAllGather",)),
                          ("torch.distributed._composable.contract", ("NO_SUCH_KEY",))):
        with pytest.raises(LowcommError) as e:
            torch_internal(module, *names)
        words = str(e.value)
        assert f"{module}.{names[0]}" in words and f"torch {torch.__version__}" in words
        assert "tested with torch 2.13 and 2.14" in words and "zero1/zero2" in words


def test_fsdp_on_a_torch_without_its_internals_fails_before_touching_the_model(monkeypatch):
    from lowcomm.errors import LowcommError
    from lowcomm.strategies.sharded import fsdp
    monkeypatch.setitem(fsdp.INTERNALS, "torch.distributed._moved_away", ("FSDPState",))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LowcommError, match=r"torch.distributed._moved_away.FSDPState.*torch "
                       + torch.__version__.replace("+", r"\+")):
        fsdp.FSDP(model, opt, wrap="none")
    assert type(model) is torch.nn.Sequential
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
