"""One owner per parameter that several ranks of a split model hold, for an outer loop above.

Under tensor parallelism every rank of the level holds the replicated parameters (embeddings,
norms, a row split's bias) whole; under a pipeline the first and the last stage both hold a tied
embedding. An outer loop above (DiLoCo, Local SGD, ...) that kept and exchanged every copy would
send those tensors once per holder. Instead each such tensor has one owner among its holders
(Megatron-LM keeps one copy of a tied embedding's optimizer state the same way: Narayanan et al.
2021, arXiv 2104.04473): the owner alone keeps its outer state and sends its pseudo-gradient
across the units, so a unit of T ranks sends each parameter once and each rank about 1/T of the
model; after every merge the owner broadcasts the synchronised tensor to the other holders
inside the unit (:func:`share_from_owners`), which trained it alike in between.
"""
from __future__ import annotations

import torch

from ..comm.comm import Comm
from ..strategies.layout import balance


def balanced_owners(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """An owner rank in ``[0, ranks)`` for each named tensor of ``sizes`` (its element count),
    balanced by size (:func:`~lowcomm.strategies.layout.balance`; the same on every rank)."""
    names = list(sizes)
    return dict(zip(names, balance([sizes[n] for n in names], ranks)))


@torch.no_grad()
def share_from_owners(comm: Comm, tensors: list[tuple[torch.Tensor, int]]) -> None:
    """Every ``(tensor, owner)`` set in place to the owner's copy: one broadcast per owner and
    dtype over ``comm`` of that owner's tensors packed flat (every rank of ``comm`` passes the
    same list, in the same order)."""
    groups: dict = {}
    for t, owner in tensors:
        groups.setdefault((owner, t.dtype), []).append(t)
    for (owner, _), same in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in same])
        comm.bcast_(flat, root=owner)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.device))
            offset += t.numel()


__all__ = ["balanced_owners", "share_from_owners"]
