"""Local SGD: H local steps on every rank, then the ranks average their parameters."""
from __future__ import annotations

import torch

from dataclasses import dataclass

from ...errors import ConfigError
from ..method import Method
from .fragment import Fragment
from .loop import OuterLoop, OuterSettings, check_run


@dataclass
class LocalSGDSettings(OuterSettings):
    """``[strategy]`` keys of ``localsgd``: ``period`` H, ``warmup_steps`` W, ``algorithm`` (and
    the warm-up's SyncDP keys)."""
    aggregate_refusal = ("localsgd averages the ranks' parameters, not pseudo-gradients, so "
                         "there is no update to clip or trim; use strategy.name=\"diloco\" with "
                         "outer_optimizer=\"sgd\", outer_lr=1, outer_momentum=0")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        if self.compressor != "none":
            raise ConfigError.at(prefix, "compressor", "localsgd averages parameters, which have no "
                              "error to feed back; to compress, use strategy.name=\"diloco\" with "
                              "outer_optimizer=\"sgd\", outer_lr=1, outer_momentum=0 (the same "
                              "update on the compressed pseudo-gradient)")


class LocalSGD(OuterLoop):
    """Local SGD with periodic parameter averaging (Stich 2019, arXiv 1805.09767), optionally
    after dense warm-up steps: post-local SGD (Lin, Stich, Patel & Jaggi 2020, arXiv 1808.07217).

    Update on rank k, after each inner step t (W = ``warmup_steps``, H = ``period``):
      1. ranks start from rank 0's parameters and buffers (broadcast at construction);
      2. t ≤ W: synchronous data parallelism (gradients averaged every step, as SyncDP);
      3. t > W: θ_k ← θ_k − u_k(g_k), the wrapped optimizer's step on the local gradient only;
      4. when (t − W) is a multiple of H: θ_k ← (1/K) Σ_j θ_j (all-reduce of the parameters).

    The optimizer's own state (momentum, Adam moments) stays local and is never averaged.
    Floating-point buffers (BatchNorm's running statistics) are averaged with the parameters
    in step 4 and at the end of the run; integer ones (``num_batches_tracked``) are rank 0's. With plain SGD
    and H = 1 this is exactly SyncDP; it equals DiLoCo with an outer SGD of lr 1 and no momentum.

    Args:
        model, optimizer: the user's torch objects (the optimizer makes the local steps).
        comm: communicator (default: world).
        settings: a validated :class:`LocalSGDSettings` (the registry's); otherwise the keyword
            arguments are its fields, checked once (errors name the argument):
        period: H ≥ 1, local steps between averagings.
        warmup_steps: W ≥ 0 dense SyncDP steps first.
        algorithm: all-reduce algorithm of the averaging and the warm-up.
        bucket_mb, overlap, backward_passes_per_step: the warm-up's SyncDP keys.
        context: the run's objects (:class:`~lowcomm.strategies.method.Context`): ``levels``,
            the topology's communicators, for ``algorithm = "hierarchical"``; ``compressor``
            and ``nonfinite``, the warm-up's gradient compressor and NaN policy; ``batches``
            and ``forward`` for ``bn_recompute``.

    Example::

        opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), period=8,
                       warmup_steps=100)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    name = "localsgd"
    Settings = LocalSGDSettings

    def _outgoing(self, f: Fragment, local: torch.Tensor) -> torch.Tensor:
        return local

    def _apply(self, f: Fragment, avg: torch.Tensor) -> torch.Tensor:
        return avg


METHOD = Method("localsgd", LocalSGDSettings, LocalSGD.from_settings, "Local SGD: H local steps, then average "
                "the parameters", check=check_run, outer=True, level=True, python="LocalSGD",
                example="localsgd:period=3", compare=("strategy.period=10",))
