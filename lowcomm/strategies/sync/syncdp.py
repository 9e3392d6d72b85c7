"""Synchronous data parallelism: every step, average the gradients of all ranks."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...comm.collectives import ALGORITHM_NAMES, broadcast_
from ...comm.comm import Comm
from ...errors import ArgumentError, ConfigError, LowcommError, NonFiniteError
from .reducer import Reducer, ReducerSettings
from ...settings import NonFinite, Settings
from ..base import Strategy
from ..method import Context, Method, check_compressor_name
from ..passes import BackwardPasses
from ..buffers import Buffers
from ..guard import sparse_gradient

BACKENDS = ("mpi", "horovod")


@dataclass
class SyncDPSettings(Settings):
    """``[strategy]`` keys of ``syncdp`` (and of the outer loops' dense warm-up)."""
    algorithm: str = "auto"            # all-reduce algorithm (collectives.ALGORITHM_NAMES)
    bucket_mb: float = 4.0             # bucket size in MiB
    backward_passes_per_step: int = 1  # gradient accumulation N
    overlap: bool | None = None        # reduce buckets during backward; None ("auto"): when
                                       # a core is left for it (see SyncDP)
    backend: str = "mpi"               # "mpi" (lowcomm's reducer) or "horovod"
    compressor: str = ""               # gradient compressor; "" = the run's [compressor] table

    def validate(self, prefix: str = "") -> None:
        self.one_of(prefix, "algorithm", list(ALGORITHM_NAMES))
        self.one_of(prefix, "backend", BACKENDS)
        self.within(prefix, "bucket_mb", 0, float("inf"), low_open=True)
        self.at_least(prefix, "backward_passes_per_step", 1)
        check_compressor_name(self, prefix, allow_empty=True)
        if self.backend == "horovod" and self.algorithm not in ("mpi", "auto"):
            raise ConfigError.at(prefix, "algorithm", "Horovod chooses its own all-reduce; leave "
                              f"algorithm = \"auto\" or \"mpi\" with backend = \"horovod\", got "
                              f"{self.algorithm!r}")

    def kwargs(self, ctx: Context) -> dict:
        """The constructor's keyword arguments (also the outer loops' dense warm-up, which
        drops ``algorithm``)."""
        return dict(algorithm=self.algorithm, bucket_mb=self.bucket_mb,
                    backward_passes_per_step=self.backward_passes_per_step, overlap=self.overlap,
                    compressor=ctx.gradient_compressor(self.compressor or None),
                    nonfinite=ctx.nonfinite)


def build(s: SyncDPSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    """SyncDP, or :class:`~lowcomm.strategies.sync.horovod.HorovodDP` for ``backend = "horovod"``."""
    if s.backend == "horovod":
        from .horovod import HorovodDP    # refuses non-summable compressors
        return HorovodDP(model, optimizer, comm, s.backward_passes_per_step,
                         ctx.gradient_compressor(s.compressor or None))
    return SyncDP(model, optimizer, comm, settings=s, levels=ctx.levels,
                  compressor=ctx.gradient_compressor(s.compressor or None),
                  nonfinite=ctx.nonfinite)


METHOD = Method("syncdp", SyncDPSettings, build,
                "synchronous data parallelism: gradients averaged every step", level=True,
                python="SyncDP", compare_name="ddp")


class SyncDP(Strategy):
    """Synchronous data-parallel SGD (mini-batch SGD over K·B samples; e.g. Goyal et al. 2017,
    arXiv 1706.02677; Li et al. 2020, arXiv 2006.15704 for bucketing and overlap).

    Update, per step t, on every rank k with local gradient g_k:
      1. ranks start from the same parameters and buffers (rank 0's, broadcast at construction);
      2. as autograd produces gradients, full buckets are all-reduced on a background thread
         (or all after backward where no core is left for the thread: ``overlap``); buckets
         of CPU gradients on one node live in shared memory and are reduced in place there,
         and ``p.grad`` is the bucket's view (torch DDP's ``gradient_as_bucket_view``);
      3. when the backward pass ends, ``p.grad = (1/K) Σ_k g_k``, a missing ``g_k`` (a
         parameter unused on rank k) counted as zero, and ``p.grad`` left None where no rank
         has one (so the optimizer skips it, as under torch DDP); as torch DDP: gradient
         clipping, ``GradScaler.unscale_`` and anything else between ``backward()`` and
         ``step()`` see the averaged gradients);
      4. ``step()``: the wrapped optimizer applies its own update;
      5. every persistent buffer (BatchNorm's running statistics) becomes rank 0's — DDP's
         ``broadcast_buffers`` rule, applied after the step instead of before the next forward,
         so the ranks end every step, and the run, with one identical model.

    Gradient accumulation: with ``backward_passes_per_step = N`` the exchange happens at the end
    of every N-th backward (local gradients accumulate by summation in between, as in
    Horovod); backward passes inside :meth:`no_sync` accumulate locally and the next one outside
    exchanges (as in DDP), also when it runs inside ``step(closure)`` (Lightning's way): one
    exchange per step. A NaN/Inf gradient is never sent: it is reduced as zero on its rank,
    :meth:`local_nonfinite` names it, and ``step()`` raises unless the step is skipped (the
    loop's ``on_nonfinite = "skip"``, or a GradScaler, whose skip every rank then agrees on).

    Progressive unfreezing: parameters the torch optimizer holds frozen (``requires_grad=False``)
    at build are members too, in buckets of their own after the others; such a bucket is sent
    only in a step where some rank has a gradient for one of its parameters (agreed with one
    4-byte all-reduce per frozen bucket per step), so a frozen parameter costs no bytes and is
    left alone, and once unfrozen it is averaged like the others (its bucket reduced after
    backward, not overlapped with it).

    On one rank (e.g. the inner level of a per-level policy whose datacenters hold one rank
    each) there is nothing to exchange: without a compressor no buckets are made (nor hooks,
    unless they count accumulated backward passes) and a step is the wrapped optimizer's (a
    reducer there cost 0.6 ms of a 15 ms backward in copies and checks, on the default model).

    Args:
        model, optimizer: the user's torch objects.
        comm: communicator (default: world).
        settings: a validated :class:`SyncDPSettings` (what the registry passes); otherwise the
            keyword arguments ``algorithm``, ``bucket_mb``, ``backward_passes_per_step`` and
            ``overlap`` are its fields, checked once by its ``validate`` (a wrong one raises
            :class:`~lowcomm.errors.ArgumentError` naming it):
        algorithm: all-reduce algorithm ("auto": the fastest per bucket size, see
            :mod:`lowcomm.comm.tuning`; "mpi", "ring", "rabenseifner", "tree", "shm", "hierarchical").
        bucket_mb: bucket size in MiB.
        backward_passes_per_step: gradient accumulation factor N ≥ 1.
        overlap: reduce buckets on a background thread during backward (True) or all at once
            when it ends (False); None ("auto"): overlap where the thread does not take the
            computation's core — the model on an accelerator, or at least 2 CPU cores per rank
            (:meth:`~lowcomm.comm.comm.Comm.cores_per_rank`). At one core per rank the thread
            only competes with backward (2 ranks on 2 cores, 437,760 parameters, a 4 MiB
            bucket: 1.06–1.11× the no-communication floor overlapped, 1.00–1.07× not, in
            single runs of ``lowcomm bench step --set strategy.overlap=...``).
        compressor: a :class:`~lowcomm.compress.Compressor` applied to every bucket (None:
            dense all-reduce with ``algorithm``).
        nonfinite: the NaN policy (:class:`~lowcomm.settings.NonFinite`): "abort" (``step()``
            after a non-finite gradient is an error naming it) or "skip" (the caller skips such
            steps with :meth:`skip`).
        levels: the topology's communicators (:meth:`lowcomm.comm.topology.Topology.comms`) for
            ``algorithm = "hierarchical"`` (and a candidate of ``"auto"``).

    Example::

        opt = SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm="ring")
        opt.zero_grad(); loss.backward(); opt.step()
    """

    name = "syncdp"
    lockstep = True
    dense_gradients = True
    unfreezes = True
    Settings = SyncDPSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: SyncDPSettings | None = None,
                 compressor=None, nonfinite: NonFinite | str = NonFinite.ABORT, levels=None,
                 **options):
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s = self.settings
        nonfinite = NonFinite.parse(nonfinite, "nonfinite", ArgumentError)
        if s.backend != "mpi":
            raise ArgumentError("backend", "SyncDP is lowcomm's own reducer; for Horovod's use "
                                "lowcomm.HorovodDP (or the spec \"syncdp:backend=horovod\")")
        self.algorithm, self.compressor, self.nonfinite = s.algorithm, compressor, nonfinite
        algorithm, bucket_mb, overlap = s.algorithm, s.bucket_mb, s.overlap
        backward_passes_per_step = s.backward_passes_per_step
        self.sync_s = 0.0
        self._named = self.members()              # frozen ones too: unfrozen later, exchanged
        self._params = dict(self._named)
        frozen = [n for n, p in self._named if not p.requires_grad]
        if overlap is None:
            spare_core = self.comm.cores_per_rank() >= 2         # collective: every rank asks
            overlap = spare_core or any(p.device.type != "cpu" for _, p in self._named)
        self.buffers = Buffers(model)
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        self.passes = BackwardPasses(int(backward_passes_per_step), self.synchronize)
        self._overlap = overlap
        self.reducer, self._hooks = None, []
        if levels is not None and levels.size != self.comm.size:
            levels = None      # a unit inside the topology (a policy's level): its own ranks only
        if self.comm.size > 1 or compressor is not None:   # else: nothing to exchange or encode
            how = ReducerSettings(algorithm, int(bucket_mb * (1 << 20)), "avg", overlap)
            self.reducer = Reducer(self.comm, self._named[::-1], how, compressor=compressor,
                                   levels=levels, idle=frozen)
        if self.reducer is not None or self.passes.per_step > 1:   # the hooks count the passes
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n))
                           for n, p in self._named if p.requires_grad]

    def _hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if p.grad.is_sparse:
                sparse_gradient(self.name, name)
            if self.passes.exchanging() and self._overlap and self.reducer is not None:
                self.reducer.ready(name, p.grad)             # (every hook counts the pass)
        return hook

    @property
    def per_rank_state(self) -> bool:
        """Only a compressor's memory (error feedback, a two-phase server error) differs
        between ranks: the optimizer's state is a replica."""
        return self.compressor is not None and bool(
            self.compressor.error_feedback or hasattr(self.compressor.exchange, "server_error"))

    def no_sync(self):
        return self.passes.no_sync()

    def synchronize(self) -> None:
        """Finish the gradient all-reduce and write the averages into ``p.grad``. Its duration
        (the communication backward did not hide, plus the copies) is kept in ``sync_s``."""
        if self.reducer is None:
            return
        t0 = time.perf_counter()
        try:
            params = self._params
            for name, p in self._named:
                if p.grad is not None and self.reducer.is_pending(name):
                    self.reducer.ready(name, p.grad)
            for name, avg in self.reducer.flush():     # p.grad becomes the bucket's view (no
                p = params[name]                          # copy; torch DDP's gradient_as_bucket_view)
                if avg is not None and p.grad is not avg:  # None: no rank's, p.grad None on all
                    p.grad = avg
        except RuntimeError as e:            # torch's, when the model was cast or moved since
            changed = self.built.changed()
            if changed is not None:
                raise LowcommError(changed) from e
            raise
        finally:
            self.sync_s = time.perf_counter() - t0

    def local_nonfinite(self) -> str | None:
        withheld = self.reducer.withheld if self.reducer is not None else []
        return f"the gradient of {withheld[0]!r}" if withheld else None

    def _withheld_clear(self) -> None:
        if self.reducer is not None:
            self.reducer.withheld = []

    def _gradients_ready(self) -> None:
        """Before the wrapped optimizer uses the gradients: those accumulated unexchanged
        (under no_sync) are exchanged, and a non-finite one withheld is an error."""
        self.passes.before_step()
        bad = self.local_nonfinite()
        if bad is not None and self.nonfinite is NonFinite.ABORT:
            raise NonFiniteError(self.comm.rank, bad)

    def _step(self, closure=None):
        if closure is None:
            self._gradients_ready()
            loss = self.optimizer.step()
        else:
            # The closure's backward (Lightning runs the last micro-batch's there) exchanges
            # the gradients accumulated under no_sync with its own: once, as DDP does.
            def run():
                out = closure()
                self._gradients_ready()
                return out
            loss = self.optimizer.step(run)
        self._withheld_clear()
        self.buffers.broadcast(self.comm)
        return loss

    def skip(self) -> None:
        self.passes.before_step()   # every rank takes part in the same reductions, then drops them
        self._withheld_clear()
        self.zero_grad()

    def _state_dict(self) -> dict:
        state = super()._state_dict()
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def _load_state_dict(self, state: dict) -> None:
        super()._load_state_dict(state)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def reshard(self, old: list[dict]) -> dict:
        """Model and optimizer are replicas: rank 0's (checked equal). The gradient
        compressor's per-rank state (error-feedback residuals, PowerSGD memory) is reset."""
        from ..reshard import replicated, reset_compressor
        merged = replicated(old, self.name)
        if self.compressor is not None:
            merged["strategy"] = dict(merged["strategy"], compressor=reset_compressor(
                [s["strategy"].get("compressor") for s in old], self.compressor.state_dict(),
                self.name))
        return merged

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self.reducer is not None:
            self.reducer.close()
