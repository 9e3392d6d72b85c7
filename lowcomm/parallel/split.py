"""What every method that splits the model over the ranks of a level declares on the contract
(:class:`~lowcomm.strategies.base.Strategy`): pipeline stages, tensor-parallel pieces, experts."""
from __future__ import annotations

from ..strategies.base import Strategy


class SplitModel(Strategy):
    """A method whose ranks hold different parts of one model: the ranks step together
    (``lockstep``), every rank's part takes part in each forward (``collective_forward``), a rank
    holds its part only (``shards_model``) and the parts differ between the ranks of the level
    (``splits_model``: an outer loop above keeps each rank's part, not the whole model)."""
    lockstep = True
    collective_forward = True
    shards_model = True
    splits_model = True


__all__ = ["SplitModel"]
