"""What every communication-efficient optimizer declares on the contract
(:class:`~lowcomm.strategies.base.Strategy`): 1-bit Adam, 0/1 Adam, DeMo."""
from __future__ import annotations

from ..base import Strategy


class ExchangingOptimizer(Strategy):
    """A method whose optimizer step is where the ranks exchange: each step every rank's
    gradients (dense tensors: sparse ones are refused at build) enter the exchange and the ranks
    step together (``lockstep``; 0/1 Adam's local steps say otherwise step by step)."""
    dense_gradients = True
    lockstep = True


__all__ = ["ExchangingOptimizer"]
