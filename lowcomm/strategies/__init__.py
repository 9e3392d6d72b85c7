"""Strategies decide when and what to communicate; each attaches to a plain torch optimizer."""
from .async_ps import AsyncPS
from .base import Strategy
from .diloco import DiLoCo, StreamingDiLoCo
from .gossip import Gossip
from .localsgd import LocalSGD
from .syncdp import SyncDP

STRATEGIES = {"syncdp": SyncDP, "gossip": Gossip, "localsgd": LocalSGD, "diloco": DiLoCo,
              "streaming-diloco": StreamingDiLoCo, "async-ps": AsyncPS}

__all__ = ["STRATEGIES", "DiLoCo", "LocalSGD", "Strategy", "StreamingDiLoCo", "SyncDP"]
