"""A compressor: an encoder (a codec, or error feedback around one) composed with an exchange."""
from __future__ import annotations

import torch

from ..comm.comm import Comm
from .base import Codec, Exchange, Pending, Segment
from .error_feedback import ErrorFeedback
from .exchange import make_exchange


class Compressor:
    """What strategies hold: ``reduce(flat, key, comm, segments)`` averages a bucket over
    ``comm`` through the exchange, encoding with the encoder and decoding with its codec.

    Args:
        encoder: a :class:`~lowcomm.compress.base.Codec`, or
            :class:`~lowcomm.compress.error_feedback.ErrorFeedback` wrapped around one
            (default: the identity codec, a dense average).
        exchange: an :class:`~lowcomm.compress.base.Exchange`, or the name of the collective of
            a gathered codec ("two-phase" | "allgather" | "auto"; summable codecs are summed,
            PowerSGD runs its own).

    Example::

        comp = Compressor(ErrorFeedback(ScaledSign("ef-sign")), "two-phase")
        avg = comp.reduce(flat, "bucket0", comm, segments)
        payload, ctx = comp.compress(x, "w")          # one rank on its own (gossip, PS)
    """

    def __init__(self, encoder=None, exchange: Exchange | str = "two-phase"):
        encoder = Codec() if encoder is None else encoder
        self.encoder = encoder
        self.codec: Codec = encoder.codec
        self.exchange = exchange if isinstance(exchange, Exchange) else make_exchange(self.codec, exchange)

    @property
    def name(self) -> str:
        return self.codec.name

    @property
    def summable(self) -> bool:
        """Payloads are summed on the wire (an all-reduce can run it: Horovod's backend)."""
        return self.codec.summable

    @property
    def error_feedback(self) -> bool:
        return isinstance(self.encoder, ErrorFeedback)

    @property
    def gathers_rows(self) -> bool:
        """Each rank's payload can be gathered and decoded on its own (``Codec.decodes_alone``)."""
        return self.codec.decodes_alone

    @property
    def collective(self) -> str:
        """The exchange's name ("two-phase", "allgather", "auto", "allreduce", ...)."""
        return self.exchange.name

    def reduce(self, flat: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        """The average over ``comm`` of every rank's ``flat`` (same shape and dtype)."""
        return self.exchange.reduce(self, flat, key, comm, segments).view(flat.shape)

    def posts(self, numel: int, dtype: torch.dtype, comm: Comm) -> bool:
        """Whether :meth:`start` can post a reduction of ``numel`` elements over ``comm`` (the
        all-gathered exchanges; the same answer on every rank)."""
        return self.exchange.posts(self, numel, dtype, comm)

    def start(self, flat: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> Pending:
        """:meth:`reduce` posted (where :meth:`posts`): encoded and handed to non-blocking MPI
        calls now, decoded by the result's ``wait()``; ``test()`` moves it on."""
        return self.exchange.start(self, flat, key, comm, segments).then(lambda avg: avg.view(flat.shape))

    def compress(self, x: torch.Tensor, key: str, segments: list[Segment] | None = None,
                 rank: int | None = None):
        """One rank's encoding (with error feedback, if on): ``(payload, ctx)``."""
        return self.encoder.compress(x, key, segments, rank)

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        return self.codec.decompress(payload, ctx)

    def state_dict(self) -> dict:
        """The encoder's and the exchange's state (empty for a stateless compressor)."""
        parts = {"encoder": self.encoder.state_dict(), "exchange": self.exchange.state_dict()}
        return {k: v for k, v in parts.items() if v}

    def load_state_dict(self, state: dict) -> None:
        self.encoder.load_state_dict(state.get("encoder", {}))
        self.exchange.load_state_dict(state.get("exchange", {}))
