"""Strategies decide when and what to communicate; each attaches to a plain torch optimizer.

The contract every method implements is :mod:`.base` (:class:`~.base.Strategy`) with what the
registry knows of it in :mod:`.method`; per-level policies compose methods in :mod:`.policy`. The
methods live by family:

* :mod:`.sync` -- synchronous data parallelism (SyncDP, Horovod);
* :mod:`.sharded` -- ZeRO-1/2 with ZeRO++, FSDP2;
* :mod:`.outer` -- Local SGD, DiLoCo, streaming DiLoCo, SparseLoCo, SPARTA, DES-LOC, ...;
* :mod:`.gossip` -- gossip SGD and NoLoCo;
* :mod:`.optimizers` -- 1-bit Adam, 0/1 Adam, DeMo;
* :mod:`.ps` -- asynchronous parameter servers.

The model-parallel axes (pipeline, tensor, sequence and expert parallelism) are in
:mod:`lowcomm.parallel`. :mod:`lowcomm.run.registry` maps names to methods.
"""
from .base import Strategy
from .gossip.gossip import Gossip
from .method import Context, Method
from .optimizers.demo import DeMo
from .optimizers.onebit_adam import OneBitAdam
from .optimizers.zeroone_adam import ZeroOneAdam
from .outer.diloco import DiLoCo, StreamingDiLoCo
from .outer.localsgd import LocalSGD
from .outer.sparta import Sparta, SpartaDiLoCo
from .ps.async_ps import AsyncPS
from .sharded.fsdp import FSDP
from .sync.syncdp import SyncDP

__all__ = ["AsyncPS", "Context", "DeMo", "DiLoCo", "FSDP", "Gossip", "LocalSGD", "Method", "OneBitAdam",
           "Sparta", "SpartaDiLoCo", "Strategy", "StreamingDiLoCo", "SyncDP", "ZeroOneAdam"]
