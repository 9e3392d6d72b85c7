"""Synchronous data parallelism: every step, average the gradients of all ranks."""
from __future__ import annotations


import torch

from ..collectives import broadcast_
from ..comm import Comm
from ..errors import LowcommError
from ..reducer import Reducer
from .base import Strategy

BACKENDS = ("mpi", "horovod")


class SyncDP(Strategy):
    """Synchronous data-parallel SGD (mini-batch SGD over K·B samples; e.g. Goyal et al. 2017,
    arXiv 1706.02677; Li et al. 2020, arXiv 2006.15704 for bucketing and overlap).

    Update, per step t, on every rank k with local gradient g_k:
      1. ranks start from the same parameters (broadcast from rank 0 at construction);
      2. as autograd produces gradients, full buckets are all-reduced on a background thread;
      3. ``step()`` waits for the buckets and sets ``p.grad = (1/K) Σ_k g_k``;
      4. the wrapped optimizer applies its own update.
    With ``backward_passes_per_step = N`` the reduction happens after every N-th backward
    (local gradients accumulate by summation in between, as in Horovod).

    Args:
        model, optimizer: the user's torch objects.
        comm: communicator (default: world).
        algorithm: all-reduce algorithm ("mpi", "ring", "rabenseifner", "tree", "hierarchical").
        bucket_mb: bucket size in MiB.
        backward_passes_per_step: gradient accumulation factor N ≥ 1.
        overlap: reduce buckets during backward (True) or all at once in ``step()``.
        backend: "mpi" (lowcomm's reducer) or "horovod" (``hvd.DistributedOptimizer`` on the
            same communicator).
        compressor: a :class:`~lowcomm.compress.Compressor` applied to every bucket (None:
            dense all-reduce with ``algorithm``).
        nonfinite: "raise" (a NaN/Inf gradient is an error, never sent) or "zero" (the caller
            skips such steps with :meth:`skip`).
        levels: the topology's communicators (:meth:`lowcomm.topology.Topology.comms`) for
            ``algorithm = "hierarchical"``.

    Example::

        opt = SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm="ring")
        opt.zero_grad(); loss.backward(); opt.step()
    """

    name = "syncdp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, algorithm: str = "mpi", bucket_mb: float = 4.0,
                 backward_passes_per_step: int = 1, overlap: bool = True, backend: str = "mpi",
                 compressor=None, nonfinite: str = "raise", levels=None):
        super().__init__(model, optimizer, comm)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.backend, self.algorithm, self.compressor = backend, algorithm, compressor
        self.passes = int(backward_passes_per_step)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if backend == "horovod":
            from ..backends.horovod import HorovodOptimizer   # refuses non-summable compressors
            self._hvd = HorovodOptimizer(model, optimizer, self.comm, self.passes, compressor)
            return
        self._hvd = None
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        self.reducer = Reducer(self.comm, self._named[::-1], algorithm, int(bucket_mb * (1 << 20)),
                               op="avg", overlap=overlap, compressor=compressor,
                               nonfinite=nonfinite, levels=levels)
        self._count = {n: 0 for n, _ in self._named}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self._named] \
            if overlap else []
        self._step_hook = optimizer.register_step_pre_hook(lambda *_: self.synchronize())

    @staticmethod
    def config_kwargs(cfg) -> dict:
        """The constructor's keyword arguments from a :class:`~lowcomm.config.Config` (also
        the outer loops' dense warm-up, less ``algorithm`` and ``backend``)."""
        from ..compress import build_compressor
        s = cfg.strategy
        return dict(algorithm=s.algorithm, bucket_mb=s.bucket_mb,
                    backward_passes_per_step=s.backward_passes_per_step, overlap=s.overlap,
                    backend=s.backend, compressor=build_compressor(cfg.compressor),
                    nonfinite="zero" if cfg.on_nonfinite == "skip" else "raise")

    @classmethod
    def from_config(cls, cfg, model, optimizer, comm, levels=None):
        """Build from a :class:`~lowcomm.config.Config`; ``levels``: the topology's
        communicators, for ``strategy.algorithm = "hierarchical"``."""
        return cls(model, optimizer, comm, levels=levels, **cls.config_kwargs(cfg))

    def _hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            self._count[name] += 1
            if self._count[name] == self.passes:
                self.reducer.ready(name, p.grad)
        return hook

    def synchronize(self) -> None:
        """Finish the gradient all-reduce and write the averages into ``p.grad``."""
        partial = [n for n, c in self._count.items() if 0 < c < self.passes] if self._hooks else []
        if partial:
            raise LowcommError(f"step() after {self._count[partial[0]]} of {self.passes} backward "
                               f"passes (parameter {partial[0]!r}); set backward_passes_per_step "
                               f"to the number of backward() calls per step")
        params = dict(self._named)
        for name, p in self._named:
            if self.reducer.is_pending(name) and p.grad is not None:
                self.reducer.ready(name, p.grad)
        for name, avg in self.reducer.flush():
            p = params[name]
            if p.grad is None:
                p.grad = avg.clone()
            else:
                p.grad.copy_(avg)
        for n in self._count:
            self._count[n] = 0

    def step(self, closure=None):
        if self._hvd is not None:
            return self._hvd.step(closure)
        return self.optimizer.step(closure)  # the pre-hook synchronises first

    def skip(self) -> None:
        if self._hvd is not None:
            self._hvd.synchronize()
        else:
            self.synchronize()   # every rank takes part in the same reductions, then drops them
        self.zero_grad()

    def state_dict(self) -> dict:
        if self._hvd is not None:   # Horovod steps its own copy of the optimizer
            return {"optimizer": self._hvd.optimizer.state_dict()}
        state = super().state_dict()
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self._hvd is not None:
            self._hvd.optimizer.load_state_dict(state["optimizer"])
            return
        super().load_state_dict(state)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd is not None:
            self._hvd.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        if self._hvd is not None:
            return
        for h in self._hooks:
            h.remove()
        self._step_hook.remove()
        self.reducer.close()
