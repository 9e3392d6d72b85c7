"""fp16 / bf16: send the gradient in a 16-bit float format, all-reduced (summable)."""
from __future__ import annotations

import torch

from ..comm.comm import world_rank
from ..errors import LowcommError
from .base import Codec, Segment, nonfinite_segments


class Cast(Codec):
    """Cast to a 16-bit float for the wire (mixed-precision communication, e.g. Micikevicius et
    al. 2018, arXiv 1710.03740 for fp16; bf16: Kalamkar et al. 2019, arXiv 1905.12322).

    Update, per bucket x on each of K ranks:
      1. ``h = fp16(x)`` (round to nearest even); an ``|x|`` beyond the format's range is an error,
         never sent as Inf;
      2. ``h ← h / K`` in the 16-bit format (so the sum cannot overflow), all-reduce (sum);
      3. the average is ``float(h)``.

    Bytes: an all-reduce of 2 bytes per element.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Example::

        avg = Compressor(Cast(torch.float16)).reduce(flat, "bucket0", comm, segments)
    """

    summable, predivide = True, True

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Cast needs torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def encode(self, x: torch.Tensor, key: str, segments: list[Segment], rank: int | None = None):
        h = x.to(self.dtype)
        big = [s.name for s in nonfinite_segments(h, segments)]
        if big:
            top = torch.finfo(self.dtype).max
            raise LowcommError(f"rank {world_rank() if rank is None else rank}: {', '.join(map(repr, big))} hold values beyond "
                               f"{self.name}'s range (|x| > {top:g}); not sent ({key})")
        return [h], x.dtype

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        return payload[0].to(ctx)

    def payload_layout(self, n, dtype, nseg=1):
        return [(self.dtype, (n,))]
