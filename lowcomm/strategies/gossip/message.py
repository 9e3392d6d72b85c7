"""The message gossip sends: every trainable parameter in one flat byte buffer (an optional
push-sum weight first), and the consensus distance of the ranks' parameters."""
from __future__ import annotations

import torch

from ...comm.comm import Comm
from ..outer.fragment import Fragment


class Layout:
    """Where each trainable parameter sits in one flat byte message: an optional float64 push-sum
    weight first, then one typed block per dtype (widest first, so every block is aligned)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], weight: bool):
        by_dtype: dict[torch.dtype, list] = {}
        for name, p in named:
            by_dtype.setdefault(p.dtype, []).append((name, p))
        order = sorted(by_dtype, key=lambda d: (-d.itemsize, str(d)))
        offset = 8 if weight else 0
        self.groups: list[tuple[Fragment, int]] = []     # (one dtype's block, its byte offset)
        for i, dtype in enumerate(order):
            members, n = [], 0
            for name, p in by_dtype[dtype]:
                members.append((name, p, n, n + p.numel()))
                n += p.numel()
            self.groups.append((Fragment(i, members, dtype, 0), offset))
            offset += n * dtype.itemsize
        self.nbytes = offset

    def new(self) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[off:off + f.numel * f.dtype.itemsize].view(f.dtype) for f, off in self.groups]

    def flats(self) -> list[torch.Tensor]:
        """Fresh CPU copies of the parameters, one flat tensor per dtype block."""
        return [f.pack() for f, _ in self.groups]

    @property
    def segments(self) -> list[list]:
        """Each block's parameters as compressor segments."""
        return [f.segments for f, _ in self.groups]

    def pack(self, buf: torch.Tensor) -> torch.Tensor:
        for view, (f, _) in zip(self.views(buf), self.groups):
            for _, p, a, b in f.members:
                view[a:b].copy_(p.detach().reshape(-1))
        return buf

    def unpack(self, flats: list[torch.Tensor]) -> None:
        for flat, (f, _) in zip(flats, self.groups):
            f.unpack_(flat)

    def get_weight(self, buf: torch.Tensor) -> float:
        return float(buf[:8].view(torch.float64)[0])

    def set_weight(self, buf: torch.Tensor, w: float) -> None:
        buf[:8].view(torch.float64)[0] = w


def consensus_distance(layout: Layout, ctl: Comm) -> float:
    """Mean over the ranks of ``ctl`` of ``‖θ_i − θ̄‖``, θ the tensors of ``layout`` (float64)."""
    flat = torch.cat([f.double() for f in layout.flats()]) if layout.groups \
        else torch.zeros(0, dtype=torch.float64)
    if ctl.size == 1:
        return 0.0
    mean = ctl.allreduce_(flat.clone()).div_(ctl.size)
    d = torch.tensor([float(torch.linalg.vector_norm(flat - mean))], dtype=torch.float64)
    return float(ctl.allreduce_(d)) / ctl.size


__all__ = ["Layout", "consensus_distance"]
