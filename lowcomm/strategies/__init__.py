"""Strategies decide when and what to communicate; each attaches to a plain torch optimizer."""
from .base import Strategy
from .syncdp import SyncDP

STRATEGIES = {"syncdp": SyncDP}

__all__ = ["STRATEGIES", "Strategy", "SyncDP"]
