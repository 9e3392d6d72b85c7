"""Merging the checkpoints of K_old ranks into the state of one rank of a run on K_new ranks
(``lowcomm train --resume DIR`` launched with another ``-n``). Each strategy's own
:meth:`~lowcomm.strategies.capabilities.Capabilities.reshard` says which rule applies to which part of its
state; the rules themselves are here:

* replicated state (SyncDP's model and optimizer, 1-bit Adam's): rank 0's copy, after checking
  that every old rank held the same (a warning names the first tensor that differs);
* per-rank state (Local SGD, DiLoCo, gossip): the element-wise average over the old ranks,
  ``(1/K_old) Σ_k x_k`` computed as ``torch.stack(x).sum(0) / K_old`` in the tensor's dtype (a
  test recomputes it from the checkpoint files); integer tensors and plain values are rank 0's;
* compressor state (error-feedback residuals, PowerSGD's memory, seeded generators): reset to a
  fresh compressor's, with a warning saying so — a residual belongs to the rank that made it,
  and the ranks it would be handed to no longer match.
"""
from __future__ import annotations

import logging

import torch

from ..errors import LowcommError

log = logging.getLogger("lowcomm.resize")


def average(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(1/K) Σ_k t_k`` for floating tensors (the exact formula the merge tests recompute);
    the first tensor for any other dtype."""
    first = tensors[0]
    if not torch.is_tensor(first) or not (first.is_floating_point() or first.is_complex()):
        return first
    return torch.stack(list(tensors)).sum(0).div(len(tensors))


def average_dicts(dicts: list[dict]) -> dict:
    """Key by key :func:`average` of ``{name: tensor}`` dicts (a model's state dict)."""
    return {k: average([d[k] for d in dicts]) if torch.is_tensor(v) else v
            for k, v in dicts[0].items()}


def average_optimizer(states: list[dict]) -> dict:
    """A torch optimizer state dict whose per-parameter tensors (momentum, Adam moments) are the
    average over ``states``; ``step`` counters and hyper-parameters are rank 0's."""
    out = {"param_groups": states[0]["param_groups"], "state": {}}
    for idx, first in states[0]["state"].items():
        per = [s["state"][idx] for s in states if idx in s["state"]]
        out["state"][idx] = {k: (average([p[k] for p in per]) if torch.is_tensor(v) and k != "step"
                                 else v) for k, v in first.items()}
    return out


def first_difference(dicts: list[dict]) -> str | None:
    """Where the old ranks' copies of a replicated state differ first (``"rank 2's 'w'"``), or
    None when they are all equal."""
    for r, d in enumerate(dicts[1:], start=1):
        for k, v in dicts[0].items():
            if torch.is_tensor(v) and not torch.equal(v, d[k]):
                return f"rank {r}'s {k!r}"
    return None


def replicated(old: list[dict], what: str) -> dict:
    """Rank 0's model and strategy state, checked to be every old rank's (a warning otherwise:
    the replicas drifted, e.g. a non-deterministic reduction; rank 0's copy is used)."""
    diff = first_difference([s["model"] for s in old])
    if diff:
        log.warning("%s: the %d old replicas were not equal (%s differs from rank 0's); "
                    "continuing from rank 0's copy", what, len(old), diff)
    return {"model": old[0]["model"], "strategy": old[0]["strategy"]}


def reset_compressor(old_states: list[dict | None], fresh: dict, what: str) -> dict:
    """The state of a freshly built compressor, with a warning when the old ranks' held any
    (residuals, memory, generators): they are reset, not summed into the merged replica."""
    if any(s for s in old_states):
        log.warning("%s: the compressor state of the %d old ranks (error-feedback residuals, "
                    "PowerSGD memory, generators) is reset, not summed into the merged replica",
                    what, len(old_states))
    return fresh


def local_replicas(old: list[dict], what: str, extra: tuple[str, ...] = ()) -> dict:
    """The merge of a method whose ranks take local steps from one schedule (SPARTA, DES-LOC,
    NoLoCo): the models and the optimizers' state (momentum, Adam moments) averaged over the old
    ranks, as are the strategy state's tensor lists named in ``extra``; the step counter ``t``
    (which every old rank must share) and the rest rank 0's."""
    ts = [s["strategy"]["t"] for s in old]
    if len(set(ts)) != 1:
        raise LowcommError(f"{what}: the old ranks' checkpoints are at different steps {ts}")
    state = dict(old[0]["strategy"],
                 optimizer=average_optimizer([s["strategy"]["optimizer"] for s in old]))
    for key in extra:
        state[key] = [average([s["strategy"][key][i] for s in old])
                      for i in range(len(state[key]))]
    return {"model": average_dicts([s["model"] for s in old]), "strategy": state}


def outer_loop(loop, old: list[dict]) -> dict:
    """An outer loop's rule (:class:`~lowcomm.strategies.outer.loop.OuterLoop`): per-rank state is
    averaged over the old ranks: the models θ_k and buffers, the inner optimizer's state
    (momentum, Adam moments; step counts are rank 0's) and whatever the method adds
    (``loop._reshard_extra``). The step counter, the synchronisation log and the reductions in
    flight are rank 0's: an in-flight fragment holds the rank average already (the all-reduce
    completed when the checkpoint was written), so it lands at its step on every new rank as it
    would have (with ``merge = "add-local"`` its base, the fragment when sent, is averaged like
    the model). Compressor state (the pseudo-gradient's error feedback, the warm-up's) is reset.
    Inside a per-level policy the topology fixes the rank count: not resizable."""
    if loop._inner is not None:
        raise LowcommError(f"{loop.name} is a level of a per-level policy, whose topology "
                           "fixes the number of ranks: resume it on the same number of ranks")
    ts = [s["strategy"]["t"] for s in old]
    if len(set(ts)) != 1:
        raise LowcommError(f"{loop.name}: the old ranks' checkpoints are at different inner "
                           f"steps {ts}; cannot merge them")
    first = old[0]["strategy"]
    state = dict(first, optimizer=average_optimizer([s["strategy"]["optimizer"] for s in old]))
    if "compressor" in first:
        state["compressor"] = reset_compressor([s["strategy"]["compressor"] for s in old],
                                               loop.compressor.state_dict(), loop.name)
    if "warmup_compressor" in first:
        dense = loop._dense
        fresh = dense.compressor.state_dict() if dense is not None and \
            dense.compressor is not None else {}
        state["warmup_compressor"] = reset_compressor(
            [s["strategy"]["warmup_compressor"] for s in old], fresh, loop.name + " warm-up")
    state["in_flight"] = [(*item[:5], average([s["strategy"]["in_flight"][i][5] for s in old]))
                          if len(item) > 5 and item[5] is not None else item
                          for i, item in enumerate(first["in_flight"])]   # add-local's bases
    state.update(loop._reshard_extra([s["strategy"] for s in old]))
    return {"model": average_dicts([s["model"] for s in old]), "strategy": state}
