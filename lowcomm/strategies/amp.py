"""The AMP vote: whether a step whose gradients ``torch.amp.GradScaler`` found not finite is
skipped, by this rank alone or by every rank together."""
from __future__ import annotations

import warnings

import torch

from ..comm.comm import Comm

# torch's GradScaler warns on every step that it will stop passing itself to optimizers that
# handle scaling themselves; lowcomm's methods need it (to agree on a skipped step across ranks
# and to record that agreement where the scaler's update() reads it), and torch is pinned.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


class AmpVote:
    """Whether any rank says yes: one 4-byte all-reduce (charged) on a duplicate of the
    method's communicator, made on first use."""

    def __init__(self):
        self._votes: Comm | None = None

    def __call__(self, comm: Comm, mine: bool) -> bool:
        if comm.size == 1:
            return mine
        if self._votes is None:
            self._votes = comm.dup()
        flag = torch.tensor([1.0 if mine else 0.0])
        self._votes.allreduce_(flag, "sum")
        return bool(flag.item() > 0)


def amp_skips(method, scaler) -> bool:
    """Unscale ``method``'s gradients (once per step) and decide whether to skip this step: the
    scaler's verdict on this rank, or — where the method is in :attr:`lockstep` — on any rank
    (``method._vote``). The decision is written where ``scaler.update()`` reads it, so the
    scale moves alike on every rank that voted."""
    from torch.amp.grad_scaler import OptState
    st = scaler._per_optimizer_states[id(method)]
    if st["stage"] is OptState.READY:
        scaler.unscale_(method)
    found = any(bool(v.item()) for v in st["found_inf_per_device"].values()) or \
        method.local_nonfinite() is not None
    if method.lockstep:
        found = method._vote(found)
    for v in st["found_inf_per_device"].values():
        v.fill_(1.0 if found else 0.0)
    return found
