"""Strategies decide when and what to communicate; each attaches to a plain torch optimizer.

Each module owns its settings and builder (a :class:`~lowcomm.strategies.base.Method`);
:mod:`lowcomm.run.registry` maps names to them.
"""
from .async_ps import AsyncPS
from .base import Context, Method, Strategy
from .diloco import DiLoCo, StreamingDiLoCo
from .gossip import Gossip
from .localsgd import LocalSGD
from .onebit_adam import OneBitAdam
from .syncdp import SyncDP

__all__ = ["AsyncPS", "Context", "DiLoCo", "Gossip", "LocalSGD", "Method", "OneBitAdam", "Strategy",
           "StreamingDiLoCo", "SyncDP"]
