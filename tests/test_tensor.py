"""Tensor and sequence parallelism (``tp``): its 2-rank checks under real mpirun
(tests/mpi/check_tensor.py, each case asserted on every rank), ``lowcomm train`` with it (resume
bit for bit and on another degree, DiLoCo between datacenters of split models), and the
settings in one process."""
import json

import pytest
import torch

from lowcomm.errors import ConfigError
from lowcomm.parallel.plans import join_parts, local_part
from lowcomm.run.api import load_config
from split_helpers import (RUN, assert_checks_ran, assert_refused,
                           assert_refused_across_datacenters, assert_resumes_on_two_and_one_rank,
                           assert_split_run_equals, copy_at_step_5, metrics, run_train,
                           same_losses, summary)


@pytest.mark.mpi_checks("check_tensor.py", np=2, timeout=300)
def test_tensor_parallel_on_two_ranks():
    assert_checks_ran("check_tensor.py", (
        "test_tp_equals_one_process_on_the_same_batch[gpt2-tp]",
        "test_tp_equals_one_process_on_the_same_batch[gpt2-tp+sp]",
        "test_tp_equals_one_process_on_the_same_batch[llama-tp+sp]",
        "test_each_rank_holds_a_tth_of_the_split_layers[gpt2]",
        "test_the_ledger_holds_the_split_layers_collectives_as_megatron_counts_them[tp+sp]",
        "test_a_split_resumes_bit_for_bit_from_its_state[gpt2]",
        "test_a_state_resumes_unsplit_with_the_model_unchanged"))


SETS = ["strategy.name=tp", "model.n_layers=2", *RUN]


def train(np_, out, *sets, resume=None, base=SETS):
    return run_train(np_, out, base, *sets, resume=resume)


def resume_from_step_5(full, again, np_, *sets, base=SETS):
    """Run ``full``'s copy ``again`` on ``np_`` ranks from its step-5 checkpoint."""
    copy_at_step_5(full, again)
    return train(np_, again, *sets, resume=again, base=base)


def test_lowcomm_train_with_tp_resumes_bit_for_bit_and_on_one_rank(tmp_path):
    """2-way sequence-parallel TP, 10 steps with a checkpoint every 5: the whole model on every
    rank at the end (ranks_agree) and the split layers' traffic in the ledger; resumed from
    step 5 on 2 ranks: the same model bit for bit; on 1 rank (the pieces joined): the same
    losses to float tolerance."""
    full = tmp_path / "full"
    r = train(2, full, "strategy.sequence=true")
    assert r.returncode == 0, r.output
    first = summary(full)
    assert first["ranks_agree"] is True and first["steps"] == 10
    assert first["bytes_total"] > 0 and "eval_loss" in metrics(full)[-1]
    assert_resumes_on_two_and_one_rank(train, full, tmp_path, "strategy.sequence=true")


def test_a_tp_run_checkpointed_through_torch_distributed_checkpoint_resumes_bit_for_bit(tmp_path):
    """``checkpoint.format=dcp`` on 2 ranks: the model goes into torch's DCP folder (its
    ``.metadata`` and the ranks' ``.distcp`` files, hashed in the manifest), not into lowcomm's
    per-rank files; the run resumed from step 5 at the same split ends with the same model bit
    for bit; resumed on 1 rank it is refused, naming the format, and so is the format under a
    method that keeps no split model (syncdp)."""
    full = tmp_path / "full"
    r = train(2, full, "checkpoint.format=dcp")
    assert r.returncode == 0, r.output
    first = summary(full)
    step5 = full / "checkpoints" / f"step-{5:08d}"
    manifest = json.loads((step5 / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and "dcp/.metadata" in manifest["files"]
    assert any(n.endswith(".distcp") for n in manifest["files"])
    assert torch.load(step5 / "rank-00000.pt", weights_only=False)["model"] == {}
    for np_ in (2, 1):
        again = tmp_path / f"again{np_}"
        r = resume_from_step_5(full, again, np_, "checkpoint.format=dcp")
        if np_ == 2:
            assert r.returncode == 0, r.output
            resumed = summary(again)
            assert resumed["state_sha256"] == first["state_sha256"]
        else:
            assert r.returncode != 0 and 'checkpoint.format = "dcp"' in r.output, r.output
    plain = [x for x in SETS if not x.startswith("strategy.")] + ["steps=1", "checkpoint.every=1"]
    r = train(1, tmp_path / "plain", "checkpoint.format=dcp", base=plain)
    assert r.returncode != 0 and "config key 'checkpoint.format'" in r.output, r.output


def test_diloco_between_two_datacenters_of_tensor_parallel_pairs_equals_unsplit_diloco(tmp_path):
    """``topology=dc:2,rank:2``, ``policy.rank=tp``, ``policy.dc=diloco``: each rank keeps the
    outer state of its pieces only and averages them with the same rank of the other
    datacenter. The same losses (training and held-out, every logged step, to 1e-5) as DiLoCo
    between two datacenters of one rank each holding the whole model."""
    common = ["policy.dc=diloco:period=5", "eval_every=5", "checkpoint.every=0"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    base = [x for x in SETS if not x.startswith("strategy.")]
    r = train(4, split, "topology=dc:2,rank:2", "policy.rank=tp", *common, base=base)
    assert r.returncode == 0, r.output
    r = train(2, whole, "topology=dc:2,rank:1", *common, base=base)
    assert r.returncode == 0, r.output
    assert_split_run_equals(split, whole, "rank")


def test_tp_across_datacenters_is_refused_naming_the_key():
    assert_refused_across_datacenters("tp")


def test_a_fused_projections_pieces_join_back_exactly():
    import torch
    full = torch.arange(4 * 12.).view(4, 12)            # q, k, v of 4 columns each
    pieces = [local_part(full, 1, 3, 2, r) for r in range(2)]
    assert pieces[0].tolist()[0] == [0, 1, 4, 5, 8, 9]   # q0, k0, v0: each part's first half
    assert torch.equal(join_parts(pieces, 1, 3), full)


@pytest.mark.parametrize("split, zero", [("tp", "zero2"), ("pp", "zero1")])
def test_data_parallelism_around_a_split_model_equals_syncdp_of_whole_models(tmp_path, split,
                                                                             zero):
    """``topology=node:2,rank:2``, ``policy.node=syncdp``, ``policy.rank=tp`` (or ``pp``): two
    split models, each rank averaging its gradients with the rank holding the same part in the
    other: the same losses (training and held-out, to 1e-5) as SyncDP on 2 ranks each holding
    the whole model; the whole model on every rank at the end. With ``policy.node=zero2`` (or
    ``zero1``) instead, the optimizer state partitioned over the two replicas: the same model
    bit for bit (a mean of two terms), the replicas' optimizer state half of syncdp's in all,
    reduce-scatters and all-gathers on the node level."""
    common = ["log_every=5", "eval_every=5", "checkpoint.every=0"]
    base = [x for x in SETS if not x.startswith("strategy.")]
    runs = {}
    for dp in ("syncdp", zero):
        out = tmp_path / dp
        r = train(4, out, "topology=node:2,rank:2", f"policy.node={dp}", f"policy.rank={split}",
                  *(["strategy.microbatches=2"] if split == "pp" else []), *common, base=base)
        assert r.returncode == 0, r.output
        runs[dp] = json.loads((out / "summary.json").read_text())
    ref = tmp_path / "whole"
    r = train(2, ref, "strategy.name=syncdp", *common, base=base)
    assert r.returncode == 0, r.output
    assert_split_run_equals(tmp_path / "syncdp", ref, "node")
    s, z = runs["syncdp"], runs[zero]
    assert z["ranks_agree"] is True and z["state_sha256"] == s["state_sha256"]
    state = [sum(m["optimizer_state_bytes"] for m in x["memory_by_rank"]) for x in (z, s)]
    assert 2 * state[0] == state[1]
    ops = {(row["level"], row["op"].split(".")[0]) for row in z["ledger_rank0"] if row["bytes_sent"]}
    assert {("node", "reduce_scatter"), ("node", "allgather")} <= ops


def test_pipeline_stages_each_tensor_parallel_equal_one_process_and_resume_bit_for_bit(tmp_path):
    """``topology=node:2,rank:2``, ``policy.node=pp``, ``policy.rank=tp``: two stages, each split
    over the two ranks of a node (one torch.distributed group, a (pp, tp) mesh). The same losses
    (training and held-out, steps 5 and 10, to 1e-5) as one process training the whole model on
    the whole batch; TP's all-reduces on the rank level and the activations on the node level
    of the ledger; resumed from step 5's checkpoint: the same model bit for bit."""
    base = [x for x in SETS if not x.startswith("strategy.")]
    mesh = ["topology=node:2,rank:2", "policy.node=pp", "policy.rank=tp",
            "strategy.microbatches=2"]
    ours, ref = tmp_path / "pp-tp", tmp_path / "one"
    r = train(4, ours, *mesh, base=base)
    assert r.returncode == 0, r.output
    r = train(1, ref, "strategy.name=syncdp", "checkpoint.every=0", base=base)
    assert r.returncode == 0, r.output
    same_losses(metrics(ours), metrics(ref))
    s = summary(ours)
    ops = {(row["level"], row["op"]) for row in s["ledger_rank0"] if row["bytes_sent"]}
    assert ("rank", "allreduce.tp") in ops and ("node", "send.activation.0-1") in ops
    assert s["ranks_agree"] is True
    again = tmp_path / "again"
    copy_at_step_5(ours, again)
    r = train(4, again, *mesh, resume=again, base=base)
    assert r.returncode == 0 and "at step 5" in r.output, r.output
    assert summary(again)["state_sha256"] == s["state_sha256"]


#: fsdp over a split model: the split level's keys and the op its own traffic is filed as
FSDP_OVER = {"tp": (["policy.rank=tp"], ("rank", "allreduce.tp")),
             "pp": (["policy.rank=pp", "strategy.microbatches=2"], ("rank", "send.activation.0-1"))}


@pytest.mark.parametrize("split", FSDP_OVER)
def test_fsdp_over_the_replicas_of_a_split_model_equals_syncdp_with_half_the_state_and_resumes(
        tmp_path, split):
    """``topology=node:2,rank:2``, ``policy.rank=tp`` or ``pp``, ``policy.node=fsdp`` (FSDP2
    over the dp dim of a (dp, tp) mesh, torch's FSDP + TP; or each stage module
    ``fully_shard``-ed over the dp dim of a (dp, pp) mesh, torchtitan's way): the same losses
    (training and held-out, to 1e-5) as ``policy.node=syncdp``; each rank's parameters half of
    that run's, its optimizer state half to 1 %; FSDP's collectives on the node level, the
    split's own traffic on the rank level; resumed from step 5's checkpoint (tp's pieces cut
    again into the (dp, tp) shards, a stage's whole tensors into its dp shards): the same model
    bit for bit."""
    keys, own = FSDP_OVER[split]
    keys = ["topology=node:2,rank:2", *keys]
    base = [x for x in SETS if not x.startswith("strategy.")]
    runs = {}
    for dp in ("fsdp", "syncdp"):
        out = tmp_path / dp
        r = train(4, out, *keys, f"policy.node={dp}",
                  *(["checkpoint.every=0"] if dp == "syncdp" else []), base=base)
        assert r.returncode == 0, r.output
        runs[dp] = (metrics(out), summary(out))
    (a, ours), (b, theirs) = runs["fsdp"], runs["syncdp"]
    same_losses(a, b)
    assert ours["ranks_agree"] is True
    for m, n in zip(ours["memory_by_rank"], theirs["memory_by_rank"]):
        assert 2 * m["param_bytes"] == n["param_bytes"]
        assert abs(2 * m["optimizer_state_bytes"] / n["optimizer_state_bytes"] - 1) < 0.01
    ops = {(row["level"], row["op"]) for row in ours["ledger_rank0"] if row["bytes_sent"]}
    assert {("node", "reduce_scatter.fsdp"), ("node", "allgather.fsdp"), own} <= ops
    r = resume_from_step_5(tmp_path / "fsdp", tmp_path / "again", 4, *keys, "policy.node=fsdp",
                           base=base)
    assert r.returncode == 0 and "at step 5" in r.output, r.output
    resumed = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert resumed["state_sha256"] == ours["state_sha256"]


@pytest.mark.parametrize("policy, words", [
    (["policy.node=tp", "policy.rank=pp"], "tp over pp: two levels that split the model in "
                                           "one job are built as pp over tp only"),
    (["policy.node=pp", "policy.rank=pp"], "pp over pp"),
    (["policy.node=tp", "policy.rank=syncdp"], "innermost per-step level only"),
    (["policy.node=syncdp:algorithm=ring", "policy.rank=tp"], "plain syncdp"),
    (["policy.node=zero1", "policy.rank=ep"], "or, directly above tp or pp, fsdp"),
])
def test_a_composition_that_is_not_built_is_refused_naming_the_level(policy, words):
    assert_refused(["topology=node:2,rank:2", *policy], "policy.node", words)


@pytest.mark.parametrize("below", [["policy.node=fsdp", "policy.rank=pp"],
                                   ["policy.node=zero1", "policy.rank=tp"]])
def test_an_outer_loop_above_sharded_replicas_other_than_fsdp_over_tp_is_refused(below):
    assert_refused(["topology=dc:2,node:2,rank:2", "policy.dc=diloco", *below], "policy.dc",
                   "built above fsdp over tp only")


@pytest.mark.parametrize("below", [["policy.node=pp", "policy.rank=tp"],
                                   ["policy.node=fsdp", "policy.rank=tp"]])
def test_a_fleet_refuses_two_split_or_sharded_levels_inside_its_datacenters(below):
    from lowcomm.run.fleet.plan import plan
    cfg = load_config(None, ["fleet.dcs=2", "topology=dc:2,node:2,rank:2", "policy.dc=diloco",
                             *below])
    with pytest.raises(ConfigError, match="not verified in a fleet") as e:
        plan(cfg, 2, 8)
    assert e.value.key == "policy.node"
