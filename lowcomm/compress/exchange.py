"""Exchanges: how K ranks' payloads become their average.

* :class:`Summed` — a summable codec's payload is all-reduced (sum) and decoded once;
* :class:`Gathered` — every rank's payload is all-gathered (all payload tensors of a rank travel
  as one byte message, one collective per bucket) and mean-decoded; bytes grow like K−1;
* :class:`~lowcomm.compress.twophase.TwoPhase` — compressed chunks to their owners, who decode
  the mean and re-encode it, then an all-gather of those: bytes flat in K;
* :class:`Auto` — per bucket, the faster of the last two by the α–β model on the communicator's
  link (:func:`~lowcomm.compress.twophase.predicted_seconds`).

:func:`make_exchange` picks the exchange of a codec from ``compressor.collective``.
"""
from __future__ import annotations

import torch

from ..comm.comm import Comm
from .base import Exchange, Pending, Segment
from .twophase import TwoPhase, check_collective, link_of, predicted_seconds


def allgather_payload(comm: Comm, payload: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather a rank's payload tensors as one byte message; returns one ``(K, *shape)``
    tensor per payload tensor (the bytes on the wire are exactly the payload's)."""
    return split_gathered(comm.allgather(one_message(payload)), payload, comm.size)


def one_message(payload: list[torch.Tensor]) -> torch.Tensor:
    """A rank's payload tensors as one contiguous message (the tensor itself when alone)."""
    if len(payload) == 1:
        return payload[0].contiguous()
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def split_gathered(g: torch.Tensor, payload: list[torch.Tensor], K: int) -> list[torch.Tensor]:
    """The ``(K, *shape)`` tensors of every payload tensor in ``g``, the all-gather of
    :func:`one_message` ``(payload)``."""
    if len(payload) == 1:
        return [g]
    out, off = [], 0
    for t in payload:
        nb = t.numel() * t.element_size()
        out.append(g[:, off:off + nb].clone(memory_format=torch.contiguous_format).view(t.dtype).view(K, *t.shape))
        off += nb
    return out


class Summed(Exchange):
    """All-reduce (sum) of a summable codec's payload.

    Update, per bucket x on each of K ranks:
      1. ``(payload, ctx) = encode(x)``; with ``predivide`` each payload tensor is divided by K
         in its own dtype (a 16-bit sum cannot overflow);
      2. all-reduce (sum) each payload tensor;
      3. the average is ``decompress(Σ payload)`` (divided by K unless predivided).
    """

    name = "allreduce"

    def reduce(self, comp, x: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        K, codec = comm.size, comp.codec
        payload, ctx = comp.encoder.compress(x, key, segments, comm.rank)
        if codec.predivide:
            payload = [t.div(K) for t in payload]     # not in place: a payload may be x itself
        for t in payload:
            comm.allreduce_(t)
        out = codec.decompress(payload, ctx).to(x.dtype)
        return out if codec.predivide else out.div_(K)


class Gathered(Exchange):
    """All-gather of every rank's payload (one message per rank and bucket), then
    ``decompress_mean``: bytes per rank ``(K−1)·P(n)``."""

    name = "allgather"

    def reduce(self, comp, x: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        payload, ctx = comp.encoder.compress(x, key, segments, comm.rank)
        gathered = allgather_payload(comm, payload)
        return comp.codec.decompress_mean(gathered, ctx, comm.size).to(x.dtype)

    def posts(self, comp, numel, dtype, comm) -> bool:
        return True

    def start(self, comp, x, key, comm, segments) -> Pending:
        """The payload's non-blocking vendor all-gather (``MPI_Iallgather``), mean-decoded by
        ``wait()``."""
        payload, ctx = comp.encoder.compress(x, key, segments, comm.rank)
        request, g = comm.iallgather(one_message(payload))
        return Pending([request], lambda: comp.codec.decompress_mean(
            split_gathered(g, payload, comm.size), ctx, comm.size).to(x.dtype))


class Auto(TwoPhase):
    """Per bucket, :class:`Gathered` or :class:`~lowcomm.compress.twophase.TwoPhase`, whichever
    has the smaller :func:`~lowcomm.compress.twophase.predicted_seconds` on
    :func:`~lowcomm.compress.twophase.link_of` ``(comm)`` (the all-gather where latency
    dominates: small buckets, few ranks, long links)."""

    name = "auto"

    def reduce(self, comp, x: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        if self._two_phase(comp, x.numel(), x.dtype, comm):
            return super().reduce(comp, x, key, comm, segments)
        return Gathered().reduce(comp, x, key, comm, segments)

    @staticmethod
    def _two_phase(comp, numel: int, dtype: torch.dtype, comm: Comm) -> bool:
        t = predicted_seconds(comp.codec, numel, dtype, comm.size, link_of(comm))
        return t["two-phase"] < t["allgather"]

    def posts(self, comp, numel, dtype, comm) -> bool:
        """Where it chooses the all-gather (one round; the two-phase exchange has none)."""
        return not self._two_phase(comp, numel, dtype, comm)

    def start(self, comp, x, key, comm, segments) -> Pending:
        return Gathered().start(comp, x, key, comm, segments)


GATHERED = {"allgather": Gathered, "two-phase": TwoPhase, "auto": Auto}


def make_exchange(codec, collective: str = "two-phase") -> Exchange:
    """The exchange of ``codec``: its own where it names one, :class:`Summed` for a summable
    codec, else the one ``collective`` ("allgather" | "two-phase" | "auto") names."""
    check_collective(collective)
    if codec.own_exchange is not None:
        return codec.own_exchange()
    if codec.summable:
        return Summed()
    return GATHERED[collective]()
