"""Strategies decide when and what to communicate; each attaches to a plain torch optimizer.

Each module owns its settings and builder (a :class:`~lowcomm.strategies.method.Method`);
:mod:`lowcomm.run.registry` maps names to them.
"""
from .async_ps import AsyncPS
from .base import Strategy
from .method import Context, Method
from .demo import DeMo
from .diloco import DiLoCo, StreamingDiLoCo
from .fsdp import FSDP
from .gossip import Gossip
from .localsgd import LocalSGD
from .onebit_adam import OneBitAdam
from .sparta import Sparta, SpartaDiLoCo
from .syncdp import SyncDP
from .zeroone_adam import ZeroOneAdam

__all__ = ["AsyncPS", "Context", "DeMo", "DiLoCo", "FSDP", "Gossip", "LocalSGD", "Method", "OneBitAdam",
           "Sparta", "SpartaDiLoCo", "Strategy", "StreamingDiLoCo", "SyncDP", "ZeroOneAdam"]
