"""What the loop measures of the model: held-out loss, non-finite values, and the hash by which
ranks and runs are compared; :func:`allsum` sums floats over the ranks of a communicator."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from ..comm.comm import Comm
from ..strategies.sharded.partition import ShardedGrad
from .memory import local_part

if TYPE_CHECKING:
    from ..tasks import Task


def state_sha256(model: torch.nn.Module) -> str:
    """sha256 of the model's whole state — parameters and persistent buffers (BatchNorm's
    running statistics, ``num_batches_tracked``) — in ``state_dict`` order, names included: two
    ranks or two runs with the same hash hold the same model."""
    return dict_sha256(model.state_dict())


def dict_sha256(state: dict) -> str:
    """sha256 of a state dict ``{name: tensor}`` in its order, names included (what
    :func:`state_sha256` hashes of a model)."""
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def allsum(ctl: Comm, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    ctl.allreduce_(t)
    return t.tolist()


def nonfinite(loss: torch.Tensor, model: torch.nn.Module) -> str | None:
    """What holds NaN/Inf on this rank (``"the loss"``, ``"the gradient of 'w'"``) or None.

    One sum per tensor and one test of them all decide the common case (NaN/Inf propagate into
    a sum; one pass over the gradients instead of a test and a host sync per tensor); only when
    that sum is not finite (NaN/Inf, or a finite sum that overflowed) is each tensor tested."""
    grads = [(name, local_part(p.grad)) for name, p in model.named_parameters()   # (a sharding
             if p.grad is not None and not isinstance(p.grad, ShardedGrad)]  # method checks its own)
    sums = [loss.detach().float().sum()] + [g.sum(dtype=torch.float32) for _, g in grads]
    if bool(torch.isfinite(torch.stack([s.to(sums[0].device) for s in sums])).all()):
        return None
    if not bool(torch.isfinite(loss.detach()).all()):
        return "the loss"
    for name, g in grads:
        if not bool(torch.isfinite(g).all()):
            return f"the gradient of {name!r}"
    return None


@torch.no_grad()
def evaluate(model, task: Task, batches: list, ctl: Comm) -> float:
    """Mean loss of ``task`` on the held-out ``batches``, split across the ranks of ``ctl``
    (NaN when there are none)."""
    return mean_loss(*allsum(ctl, evaluation_sums(model, task, batches, ctl)))


def evaluation_sums(model, task: Task, batches: list, ctl: Comm, every: bool = False,
                    loss_of=None) -> list[float]:
    """``[loss sum, batches]`` of this rank's share of the held-out ``batches`` (every
    ``ctl.size``-th from ``ctl.rank``): summed over the ranks, :func:`mean_loss` of them is
    :func:`evaluate`'s. ``every``: the model's forward is collective (FSDP gathers parameters
    in it, a pipeline's stages pass activations on), so every rank runs every batch and counts
    its share only. ``loss_of(batch)``: one batch's loss (default: the task's on ``model``)."""
    model.eval()
    total = count = 0.0
    for i, b in enumerate(batches):
        mine = i % ctl.size == ctl.rank
        if mine or every:
            loss = loss_of(b) if loss_of is not None else task.loss(model, b).item()
        if mine:
            total += loss
            count += 1
    model.train()
    return [total, count]


def mean_loss(total: float, count: float) -> float:
    return total / count if count else float("nan")
