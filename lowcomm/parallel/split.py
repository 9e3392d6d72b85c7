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



class ReducedOnce(SplitModel):
    """A split method whose gradients are reduced over its level once per backward pass
    (:meth:`_reduce_gradients`), before whichever comes first of a clip and the step; the
    subclass's clip calls :meth:`_reduce` too."""
    _averaged = False       # reduced since the last backward pass

    def _reduce_gradients(self) -> None:
        """Reduce this backward pass's gradients (partial sums, the mean over replicas)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its gradients are reduced")

    def _reduce(self) -> None:
        if not self._averaged:              # done since the last step (a clip, then step())
            self._reduce_gradients()
            self._averaged = True

    def _after_backward(self) -> None:
        """What the subclass counts after each backward pass, before the reduction."""

    def forward_backward(self, loss_fn, batch, before_backward=None):
        self._averaged = False              # a new backward pass (also after a skipped step)
        loss = super().forward_backward(loss_fn, batch, before_backward)
        self._after_backward()
        self._reduce()
        return loss

    def _step(self, closure=None):
        self._reduce()
        self._averaged = False
        return self.optimizer.step(closure)


__all__ = ["ReducedOnce", "SplitModel"]
