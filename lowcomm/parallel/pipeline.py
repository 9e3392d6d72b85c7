"""Pipeline parallelism (``pp``): the model cut into stages across the ranks of a level, run by
torch's own pipeline engine (:mod:`torch.distributed.pipelining`).

GPipe (Huang et al. 2019, arXiv 1811.06965), 1F1B (PipeDream-Flush: Narayanan et al. 2021,
arXiv 2006.09503), interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473) and the
zero-bubble schedules (Qi et al. 2023, arXiv 2401.10241): the batch is cut into ``M``
micro-batches; stage ``s`` runs its blocks on each micro-batch and sends the activations to
stage ``s+1``; the last stage computes the loss and the activation gradients flow back. A
schedule orders the micro-batches' forward and backward passes; the idle part of a step, the
*bubble*, is (P−1)/(M+P−1) of it for GPipe and 1F1B on P stages ((P−1)/(vM+P−1) with v
stages per rank, interleaved).

Per step t (:meth:`PipelineParallel.forward_backward`, which replaces the loop's forward and
backward):
  1. the batch is split into (inputs, target) by the task's ``split`` and into M micro-batches;
  2. the schedule's ``step`` runs every micro-batch's forward and backward on this rank's
     stage(s); gradients are the mean over micro-batches (= the whole batch's, for a loss that is
     a mean over equal micro-batches);
  3. a tied module (an input/output embedding on the first and the last stage) has its
     gradient summed over the two stages (Megatron's embedding group);
  4. ``step()``: the wrapped optimizer updates this rank's stage.

Traffic: every activation and activation gradient a stage sends is charged to ``comm``'s ledger
as ``send.activation.<s>-<s+1>`` / ``send.gradient.<s+1>-<s>`` (the bytes of the tensors
torch's P2P operations carry; what a stage receives as the same rows' ``bytes_recv``), the
tied gradients' sum as an all-reduce. :meth:`finish` gathers every stage onto every rank: the
whole model, the same on every rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..comm.comm import Comm
from ..comm.ledger import Ledger
from ..errors import ConfigError, LowcommError
from ..settings import Settings
from ..strategies.base import Strategy
from .split import SplitModel
from ..strategies.method import Context, Method
from .chains import Chain, chain_for
from .deferred import deferred_of
from .merge import OwnedKeys, by_name, held_names
from .owners import share_from_owners
from .replicas import average_gradients, local_grads, local_of, place
from .stages import (Stage, block_times, cut, outside_chain, owned_names, parse_split,
                     release_others, restore_others)

#: torch's schedules lowcomm offers (those of this torch: :func:`schedules`), one stage per rank
SINGLE = ("GPipe", "1F1B")
#: several stages per rank: looped (rank r holds r, r+P, ...) or V-shaped (r and 2P-1-r)
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def schedules() -> dict[str, type]:
    """The schedules of :data:`SINGLE`, :data:`LOOPED` and :data:`V_SHAPED` this torch has."""
    from torch.distributed.pipelining.schedules import get_schedule_class
    out = {}
    for name in (*SINGLE, *LOOPED, *V_SHAPED):
        try:
            out[name] = get_schedule_class(name)
        except ValueError:
            pass
    return out


@dataclass
class PipelineSettings(Settings):
    """``[strategy]`` keys of ``pp``."""
    microbatches: int = 4       # micro-batches per step (they must divide the batch)
    schedule: str = "1F1B"      # torch's: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, ZBVZeroBubble, ...
    stages_per_rank: int = 2    # stages each rank holds under a looped or V-shaped schedule
    # where the blocks are cut: "params" (balanced by parameter count), "time" (by measured
    # time), "every:N", "at:A,B,..."
    split: str = "params"
    # "stages": the model built on the meta device, each rank materialising its stages (the
    # whole build's values); "whole": built whole on every rank, then split
    build: str = "stages"
    timeout_s: float = 300.0    # the torch.distributed group's limit for one operation

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "microbatches", 1)
        self.at_least(prefix, "stages_per_rank", 2)
        self.within(prefix, "timeout_s", 0, float("inf"), low_open=True)
        known = schedules()
        if self.schedule not in known:
            lacks = self.schedule in (*SINGLE, *LOOPED, *V_SHAPED)
            raise ConfigError.at(prefix, "schedule", f"{self.schedule!r} is "
                                 f"{'a schedule this torch lacks' if lacks else 'no schedule'} "
                                 f"(torch {torch.__version__}); known: {', '.join(known)}")
        if self.schedule in V_SHAPED and self.stages_per_rank != 2:
            raise ConfigError.at(prefix, "stages_per_rank", f"{self.schedule} holds 2 stages "
                                 f"per rank (a V), got {self.stages_per_rank}")
        parse_split(self.split, prefix + "split")
        self.one_of(prefix, "build", ("stages", "whole"))

    def per_rank(self) -> int:
        """Stages each rank holds under this schedule."""
        return 1 if self.schedule in SINGLE else self.stages_per_rank


def check(s: PipelineSettings, cfg, prefix: str) -> None:
    """Before MPI starts: the micro-batches divide the batch."""
    if cfg.batch_size % s.microbatches:
        raise ConfigError.at(prefix, "microbatches", f"{s.microbatches} micro-batches do not "
                             f"divide batch_size = {cfg.batch_size}")


def pair(batch):
    """The default ``split``: a batch ``(x, y)`` as inputs ``(x,)`` and target ``y``."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(map(torch.is_tensor, batch)):
        return (batch[0],), batch[1]
    raise LowcommError(f"pp cuts a batch into (inputs, target): the task's batch is a "
                       f"{type(batch).__name__}, not a pair of tensors (x, y); define "
                       "split(batch) -> (inputs tuple, target tensor) in the task")


def first_batch(batches):
    """The first of ``batches`` (a list or iterable, or a function of the step returning one:
    its batches of step 1); None without any."""
    if batches is None:
        return None
    return next(iter(batches(1) if callable(batches) else batches), None)


def stage_options(ctx: Context) -> dict:
    """What a pipeline takes from the run beside its settings: the task's ``criterion`` and
    ``split``, an example batch (for ``split = "time"``) and the replicas."""
    if ctx.criterion is None:
        raise ConfigError("task", "pp computes the loss on the last stage from the model's "
                          "output: the task must define criterion(output, target) (and "
                          "split(batch) -> (inputs, target) unless a batch is a pair (x, y))")
    return dict(criterion=ctx.criterion, context=ctx)


def build(s: PipelineSettings, model, optimizer, comm: Comm, ctx: Context) -> Strategy:
    return PipelineParallel(model, optimizer, comm, settings=s, **stage_options(ctx))


METHOD = Method("pp", PipelineSettings, build,
                "pipeline parallelism: the model's blocks cut into stages across the ranks, "
                "torch's schedules (GPipe, 1F1B, interleaved, zero-bubble)",
                check=check, level=True, splits=True, deferred=True, python="PipelineParallel")


def bubble_formula(schedule: str, stages: int, microbatches: int, per_rank: int = 1) -> float:
    """The idle fraction of a step a schedule's paper gives: (P−1)/(M+P−1) for GPipe and 1F1B
    on P ranks (Huang et al. 2019; Narayanan et al. 2021), (P−1)/(vM+P−1) for an interleaved
    schedule with v stages per rank (Narayanan et al. 2021, §2.2); the zero-bubble schedules'
    bound is that of 1F1B (their point is to fill it)."""
    v = per_rank if schedule not in SINGLE else 1
    return (stages - 1) / (v * microbatches + stages - 1)


class CountedStage:
    """Mixed into torch's ``PipelineStage``: charges the tensors of its P2P operations to a
    ledger and times its compute (for the bubble)."""

    def counting(self, ledger: Ledger, level: str, busy: list) -> None:
        self._ledger, self._level, self._busy = ledger, level, busy

    def _charge(self, ops, kind: str, sending: bool, peer_of):
        for op in ops:
            n = op.tensor.numel() * op.tensor.element_size()
            a, b = (self.stage_index, peer_of(self.stage_index)) if sending else \
                (peer_of(self.stage_index), self.stage_index)
            self._ledger.record(f"send.{kind}.{a}-{b}", self._level, sent=n if sending else 0,
                                recv=0 if sending else n, calls=1 if sending else 0)
        return ops

    def get_fwd_send_ops(self, i):
        return self._charge(super().get_fwd_send_ops(i), "activation", True, lambda s: s + 1)

    def get_fwd_recv_ops(self, i):
        return self._charge(super().get_fwd_recv_ops(i), "activation", False, lambda s: s - 1)

    def get_bwd_send_ops(self, i):
        return self._charge(super().get_bwd_send_ops(i), "gradient", True, lambda s: s - 1)

    def get_bwd_recv_ops(self, i):
        return self._charge(super().get_bwd_recv_ops(i), "gradient", False, lambda s: s + 1)

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._busy[0] += time.perf_counter() - t0

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def on_meta(model: torch.nn.Module, split: str):
    """The record of a model built on the meta device (:func:`~lowcomm.parallel.deferred.build_deferred`:
    pp materialises its stages from it), None for a model built whole; an error naming the
    setting where pp cannot use it."""
    if not any(p.is_meta for p in model.parameters()):
        return None
    deferred = deferred_of(model)
    if deferred is None:
        raise ConfigError("model", "pp was given a model on the meta device that "
                          "lowcomm.parallel.build_deferred did not build: it cannot know the "
                          "values of its stages; build it with build_deferred, or whole")
    if parse_split(split)[0] == "time":
        raise ConfigError("strategy.split", "split = \"time\" times every block of the whole "
                          "model, which is built on the meta device here (strategy.build = "
                          "\"stages\"); set strategy.build = \"whole\" or another split")
    return deferred


def stage_ids(rank: int, ranks: int, per_rank: int, schedule: str) -> list[int]:
    """The stages rank ``rank`` of ``ranks`` holds: ``rank`` alone, looped (``rank + i·P``) or
    V-shaped (``rank`` and ``2P−1−rank``)."""
    if per_rank == 1:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(per_rank)]


class PipelineParallel(OwnedKeys, SplitModel):
    """Pipeline parallelism over the ranks of ``comm`` through torch's engine (module docstring).

    Construction, on every rank of ``comm`` together: the model (built alike on every rank)
    is cut into ``P × v`` stages (:func:`~lowcomm.parallel.stages.cut`, by ``split``); this
    rank keeps its stage(s) — the other modules move to the meta device, freeing their memory —
    and the wrapped optimizer's ``param_groups`` keep this rank's parameters only (the same
    group dicts: LR schedulers keep working); torch.distributed's group over ``comm`` (gloo on
    CPU, NCCL on CUDA) carries the stages' P2P traffic.

    The training loop changes in one place: ``forward_backward(loss, batch)`` (or the
    schedule's own ``step``) replaces ``loss = loss_fn(model, batch); loss.backward()``; it
    returns the batch's loss on every rank. Evaluation: :meth:`evaluate`. ``clip_grad_norm_``
    clips by the norm over every stage.

    Args:
        model, optimizer: the user's torch objects (the optimizer on ``model.parameters()``,
            with no state yet).
        comm: the ranks of one pipeline, stage order = rank order (default: world).
        chain: how the model runs as stem → blocks → head (:mod:`~lowcomm.parallel.chains`;
            default: the built-in chain of the model's family).
        criterion: ``criterion(output, target) -> loss`` on the last stage (a mean over the
            micro-batch).
        context: the run's objects (:class:`~lowcomm.strategies.method.Context`): ``split``,
            ``split(batch) -> (inputs tuple, target)`` (None: a pair ``(x, y)``); ``batches``,
            whose first batch the blocks are timed on for ``split = "time"`` (a list, or a
            function of the step returning some); ``replicas``, rank i of every other pipeline,
            for data parallelism around it (:mod:`~lowcomm.parallel.replicas`: gradients
            averaged over them each step).
        settings: a validated :class:`PipelineSettings`; otherwise its fields as keywords.

    Example::

        opt = PipelineParallel(model, torch.optim.AdamW(model.parameters()), microbatches=8,
                               criterion=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = opt.forward_backward(None, (x, y))     # every rank: the batch's loss
            opt.step()
        opt.finish()                                      # the whole model on every rank
    """

    name = "pp"
    Settings = PipelineSettings
    moved = {"split_batch": "context=lowcomm.Context(split=...)",
             "example": "context=lowcomm.Context(batches=[example])",
             "replicas": "context=lowcomm.Context(replicas=...)"}

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: PipelineSettings | None = None,
                 chain: Chain | None = None, criterion=None, context: Context | None = None,
                 **options):
        if criterion is None or not callable(criterion):
            raise ConfigError("criterion", "pp needs criterion(output, target) -> loss for the "
                              "last stage")
        if optimizer.state:
            raise ConfigError("optimizer", f"{type(optimizer).__name__} holds state already (it "
                              "has stepped): pp keeps each stage's state; wrap a fresh one")
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s, self.chain, context = self.settings, chain_for(model, chain), context or Context()
        self.criterion, self.split_batch = criterion, context.split or pair
        self.replicas = context.replicas
        self._deferred = on_meta(model, s.split)
        self.device = self._deferred.device if self._deferred else next(model.parameters()).device
        P, v = self.comm.size, s.per_rank()
        self.count = P * v
        times = self._block_times(first_batch(context.batches)) \
            if parse_split(s.split)[0] == "time" else None
        bounds = cut(model, self.chain, self.count, s.split, "strategy.split",
                     "strategy.stages_per_rank" if v > 1 else "pp's ranks", times)
        self.stages = [Stage(model, self.chain, i, self.count, bounds[i], bounds[i + 1])
                       for i in stage_ids(self.comm.rank, P, v, s.schedule)]
        if self._deferred:          # this rank's stages alone take memory, as a whole build's
            self._deferred.materialise(model, [*outside_chain(model, self.chain),
                                               *(n for st in self.stages for n in st.module_names())])
        self.bounds = bounds
        self._owned = owned_names(model, self.stages)
        self._others, self._kept = release_others(model, self.chain, self.stages)
        self._keep_own_parameters(optimizer)
        self._tied = self._tied_parameters()
        self._tie = self.comm.split(0 if self._tied else 1) if P > 1 and self.chain.tied() else None
        self._control = self.comm.dup(Ledger())        # the loss's broadcast: not the method's
        self._busy, self._bubbles = [0.0], []
        self._schedule = self._build_schedule(s)

    # construction -------------------------------------------------------------------------------
    def _block_times(self, example) -> list[float] | None:
        """``split = "time"``: each block's seconds on a micro-batch of ``example``, rank 0's
        (every rank cuts alike); None without an example (:func:`cut` names the setting)."""
        if example is None:
            return None
        args, target = self.split_batch(example)
        rows = target.shape[0] // self.settings.microbatches
        times = block_times(self.model, self.chain, tuple(a[:rows] for a in args),
                            self.criterion, target[:rows])
        return self.comm.bcast_object(times if self.comm.rank == 0 else None)

    def _keep_own_parameters(self, optimizer) -> None:
        """This rank's parameters, each once (a module two of its stages hold too), kept in
        ``self._held`` and alone in the optimizer's groups."""
        self._held = list({id(p): p for st in self.stages for p in st.parameters()}.values())
        held = {id(p) for p in self._held}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in held]
        self.built.fix()

    def _tied_parameters(self) -> list[torch.Tensor]:
        """The tied modules' parameters where this rank holds both ends' copies on different
        ranks (the first stage's or the last's, not both): summed with the other end."""
        ids = {st.index for st in self.stages}
        if not self.chain.tied() or (0 in ids) == (self.count - 1 in ids):
            return []
        return [p for n in self.chain.tied() for p in self.model.get_submodule(n).parameters()]

    def _build_schedule(self, s: PipelineSettings):
        from torch.distributed.pipelining import PipelineStage

        group = self._stage_group(s)
        counted = type("CountedPipelineStage", (CountedStage, PipelineStage), {})
        self._pipe = []
        for st in self.stages:
            stage = counted(st, st.index, self.count, self.device, group=group)
            stage.counting(self.comm.ledger, self.comm.level, self._busy)
            self._pipe.append(stage)
        cls = schedules()[s.schedule]
        loss_fn = self._loss_fn
        try:
            # gradients summed over the micro-batches, divided once here (torch's scale_grads
            # divides per stage: twice for a module both of a rank's stages hold, a V's tie)
            stages = self._pipe[0] if s.schedule in SINGLE else self._pipe
            return cls(stages, n_microbatches=s.microbatches, loss_fn=loss_fn, scale_grads=False)
        except (ValueError, AssertionError, RuntimeError) as e:
            raise ConfigError("strategy.schedule", f"torch's {s.schedule} refused {self.count} "
                              f"stages on {self.comm.size} ranks with {s.microbatches} "
                              f"micro-batches: {str(e).splitlines()[0][:200]}") from None

    def _stage_group(self, s: PipelineSettings):
        """The torch.distributed group the stages' P2P operations run in: the default group
        over ``comm`` (made here)."""
        from ..comm.process_group import default_group
        return default_group(self.comm, self.device, s.timeout_s, holder=self)

    def _loss_fn(self, output, target):
        return self.criterion(output, target)

    # the step -----------------------------------------------------------------------------------
    @property
    def holds_first(self) -> bool:
        return any(st.first for st in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(st.last for st in self.stages)

    def _last_rank(self) -> int:
        P = self.comm.size
        return 0 if self.settings.schedule in V_SHAPED else P - 1

    def _run(self, batch, train: bool) -> torch.Tensor:
        """The schedule on ``batch``; the mean micro-batch loss, on every rank."""
        args, target = self.split_batch(batch)
        rows = args[0].shape[0] if args and torch.is_tensor(args[0]) else target.shape[0]
        if rows % self.settings.microbatches:
            raise LowcommError(f"pp: {self.settings.microbatches} micro-batches do not divide "
                               f"the batch of {rows} rows; set strategy.microbatches to a "
                               "divisor of the batch size")
        losses: list = []
        kw = dict(target=target, losses=losses) if self.holds_last else {}
        run = self._schedule.step if train else self._schedule.eval
        self._busy[0] = 0.0
        t0 = time.perf_counter()
        run(*(args if self.holds_first else ()), **kw)
        if train:
            wall = time.perf_counter() - t0
            self._bubbles.append(max(0.0, 1.0 - self._busy[0] / wall) if wall > 0 else 0.0)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.holds_last \
            else torch.zeros(())
        return self._control.bcast_(loss.reshape(1).cpu(), root=self._last_rank()).reshape(())

    def forward_backward(self, loss_fn, batch, before_backward=None) -> torch.Tensor:
        """One step's forward and backward passes of ``batch`` through the pipeline (the
        schedule's ``step``); returns the batch's loss on every rank. ``loss_fn`` (the
        loop's whole-model loss) and ``before_backward`` are not used: the last stage's
        ``criterion`` is the loss."""
        loss = self._run(batch, train=True)
        for g in local_grads(self._held):
            g.div_(self.settings.microbatches)
        if self._tied and self._tie is not None:
            for g in local_grads(self._tied):
                self._tie.allreduce_(g, "sum")
        self._average_replicas()
        return loss

    def _average_replicas(self) -> None:
        """Data parallelism around the pipeline: each gradient the mean over the replicas."""
        if self.replicas is not None:
            average_gradients(self.replicas, local_grads(self._held))

    @torch.no_grad()
    def evaluate(self, loss_fn, batch) -> float:
        """The held-out loss of ``batch`` (forward passes only), on every rank."""
        return float(self._run(batch, train=False))

    def batch_place(self) -> tuple[int, int]:
        """Every stage of one pipeline takes the same batch (its replica's)."""
        return place(self.replicas)

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters by name (a DTensor's local piece: a split or sharded
        stage's): what an outer loop above keeps and averages with rank i of the other units
        (the same stage, the same piece)."""
        held = {id(p) for p in self._held}
        return {n: local_of(p) for n, p in self.model.named_parameters() if id(p) in held}

    def outer_shards(self) -> dict[str, torch.Tensor]:
        """:meth:`local_shards` less a tied module's parameters on the last stage's rank: the
        first stage's rank owns them (:mod:`~lowcomm.parallel.owners`), so an outer loop above
        sends them once per pipeline."""
        tied = {id(p) for p in self._tied} if not self.holds_first else set()
        return {n: p for n, p in self.local_shards().items() if id(p) not in tied}

    def parameters_changed(self) -> None:
        """An outer loop above merged its synchronisation: the last stage's copy of a tied
        module takes the first stage's (a broadcast between the two)."""
        if self._tied and self._tie is not None:
            share_from_owners(self._tie, [(local_of(p).data, 0) for p in self._tied])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every stage's gradients by their global norm (torch's ``clip_grad_norm_`` over
        the whole model: the per-tensor norms of every stage, a tied tensor once); returns the
        norm, on every rank."""
        if norm_type != 2.0:
            raise ConfigError("norm_type", f"pp clips by the 2-norm, got {norm_type}")
        grads = self._own_grads()
        sq = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in grads]).sum() if grads \
            else torch.zeros(())
        total = sq.reshape(1).double().cpu()
        self._norm_comm().allreduce_(total, "sum")
        norm = total.sqrt().to(torch.float32).reshape(())
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise LowcommError(f"the gradients' norm over every stage is {float(norm)}")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local_grads(self._held):
            g.mul_(coef.to(g.device))
        return norm

    def _norm_comm(self) -> Comm:
        """The ranks whose :meth:`_own_grads` make up the whole model's gradient."""
        return self.comm

    def _own_grads(self) -> list[torch.Tensor]:
        """This rank's gradients, a tied tensor counted on the first stage only."""
        tied = {id(p) for p in self._tied} if not self.holds_first else set()
        return local_grads(p for p in self._held if id(p) not in tied)

    # results ------------------------------------------------------------------------------------
    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        """``pp_bubble``: the idle fraction of the steps since the last line (1 − compute time
        in the stage's forward and backward passes / the schedule's wall-clock), the mean over
        ranks and its largest rank, beside ``pp_bubble_formula`` (:func:`bubble_formula`)."""
        mine = sum(self._bubbles) / len(self._bubbles) if self._bubbles else 0.0
        if not final:
            self._bubbles = []
        every = ctl.allgather_object(mine)
        s = self.settings
        return {"pp_bubble": sum(every) / len(every), "pp_bubble_max": max(every),
                "pp_bubble_formula": bubble_formula(s.schedule, self.comm.size, s.microbatches,
                                                    s.per_rank())}

    # checkpoints --------------------------------------------------------------------------------
    def load_model_state_dict(self, state: dict) -> None:
        """Load :meth:`model_state_dict`'s keys (a checkpoint of this split), or a whole model's
        state (:meth:`reshard`'s): this rank takes its stages' keys."""
        keys = set(state)
        if keys != self._owned and keys != set(self.model.state_dict()):
            odd = sorted(keys ^ self._owned)
            raise LowcommError(f"pp stage(s) {[st.index for st in self.stages]} on rank "
                               f"{self.comm.rank} hold other keys than the state ({odd[:3]} and "
                               f"{max(0, len(odd) - 3)} more differ): it was saved by another "
                               "split of the model (strategy.split, the ranks' count or the "
                               "schedule)")
        self._copy_owned(state)

    def _state_dict(self) -> dict:
        """The wrapped optimizer's state of this rank's stages, with its parameters' names (a
        resume on another split matches them by name)."""
        return {"optimizer": self.optimizer.state_dict(),
                "names": held_names(self.model, self.optimizer)}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def reshard(self, old: list[dict]) -> dict:
        """Resume a pipeline of another length (P → P'; PP 2 → 1): the old stages' parts joined
        by name (:func:`~lowcomm.parallel.merge.by_name`)."""
        return by_name(old, self.model, self.optimizer)

    # the end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Leave the whole model on every rank: every stage's state gathered, the modules
        other ranks held given storage again and loaded."""
        self._restore(self._gather())

    def _restore(self, full: dict) -> None:
        """The modules other ranks held given storage again, ``full`` loaded into the model."""
        from ..comm.process_group import release
        if self._deferred:          # the others' non-persistent buffers as the build made them
            self._deferred.materialise(self.model, self._others)
        else:
            restore_others(self.model, self._others, self._kept, self.device)
        self.model.load_state_dict(full)
        self._others, self._kept = [], {}
        self._owned = set(full)
        release(self)

    def _close(self) -> None:
        self._schedule = None
        self._pipe = []
