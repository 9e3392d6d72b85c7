"""ZeRO stages 1 and 2 on lowcomm's own Comm, with ZeRO++'s low-communication collectives.

Each rank keeps the whole model for its forward and backward passes but owns 1/K of every
gradient bucket: the gradients are reduce-scattered instead of all-reduced, each rank steps the
user's optimizer on its part only (so the optimizer state — Adam's two moments — is 1/K per
rank), and the parameters are all-gathered after the step. Reduce-scatter plus all-gather move
what one all-reduce moves, so the bytes equal SyncDP's; ZeRO++ makes them fewer (qgZ, qwZ) or
keeps them inside a node (hpZ).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ...comm.collectives import allgather_, broadcast_, reduce_scatter
from ...comm.comm import Comm
from ...compress.base import nonfinite_segments
from ...compress.quantize import dequantize_blocks, quantize_blocks
from ...errors import ArgumentError, ConfigError, LowcommError, NonFiniteError
from ...settings import NonFinite, Settings
from ..base import Strategy
from ..layout import agreed_dup
from ..method import Context, Method
from ..passes import BackwardPasses
from .partition import Bucket, merged_model_range, partition, sharded_grad
from ..buffers import Buffers

#: torch optimizers whose update of an element reads only that element's gradient and state
#: (and the group's options): stepping a flat range of a tensor equals stepping the tensor
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop")
    if hasattr(torch.optim, n))
PARTITIONS = ("auto", "flat", "tensor")
QUANTIZED = {"none": 0, "int8": 8, "int4": 4}
SCATTER_ALGORITHMS = ("auto", "mpi", "ring", "shm")


@dataclass
class ZeROSettings(Settings):
    """``[strategy]`` keys of ``zero1`` and ``zero2``."""
    bucket_mb: float = 4.0             # gradient bucket size in MiB
    backward_passes_per_step: int = 1  # gradient accumulation N
    overlap: bool | None = None        # reduce-scatter buckets during backward (None: auto)
    algorithm: str = "auto"            # reduce-scatter / all-gather: auto | mpi | ring | shm
    partition: str = "auto"            # "flat" ranges | whole "tensor"s per rank | "auto"
    qgz: str = "none"                  # ZeRO++ quantized gradients: none | int8 | int4
    qwz: str = "none"                  # ZeRO++ quantized weights: none | int8
    hpz: bool = False                  # ZeRO++ hierarchical partition: shard inside the node
    block: int = 2048                  # qgZ / qwZ: elements sharing one scale

    def validate(self, prefix: str = "") -> None:
        self.within(prefix, "bucket_mb", 0, float("inf"), low_open=True)
        self.at_least(prefix, "backward_passes_per_step", 1)
        self.one_of(prefix, "algorithm", SCATTER_ALGORITHMS)
        self.one_of(prefix, "partition", PARTITIONS)
        self.one_of(prefix, "qgz", tuple(QUANTIZED))
        self.one_of(prefix, "qwz", ("none", "int8"))
        self.at_least(prefix, "block", 1)


def build(s: ZeROSettings, model, optimizer, comm: Comm, ctx: Context, stage: int) -> "ZeRO":
    if ctx.compressor.name != "none":
        raise ConfigError("compressor.name", f"zero{stage} reduce-scatters its gradients; "
                          "compress them with its own strategy.qgz = \"int8\" or \"int4\" "
                          "(ZeRO++'s blockwise quantization), not the run's [compressor]")
    return (ZeRO1 if stage == 1 else ZeRO2)(model, optimizer, comm, settings=s, levels=ctx.levels,
                                            nonfinite=ctx.nonfinite)


class ZeRO(Strategy):
    """ZeRO data parallelism, stage 1 or 2 (Rajbhandari, Rasley, Ruwase & He 2019,
    arXiv 1910.02054), with ZeRO++'s collectives (Wang et al. 2023, arXiv 2306.10209).

    Layout: the parameters of each optimizer group are packed, in reverse order (the order
    autograd produces their gradients), into flat buckets of about ``bucket_mb``; the model's
    parameters become views of them. Rank r of K owns the range ``[b_r, b_{r+1})`` of every
    bucket: K near-equal ranges (``partition = "flat"``, for optimizers that update each element on
    its own: SGD, Adam, AdamW, ...), or whole tensors balanced over the ranks (``"tensor"``, for
    optimizers that need whole matrices, such as Muon). The user's optimizer is re-pointed at
    the owned ranges (its ``param_groups`` stay the same dicts, so LR schedulers keep working)
    and holds state for them only: 1/K of SyncDP's.

    Update, per step, on every rank r with local gradient g_r:

      1. as autograd produces a bucket's gradients they are copied into its flat gradient; when
         the bucket is complete it is reduce-scattered (on a background thread where
         ``overlap``): rank r receives ``ĝ_r = (1/K) Σ_k g_k[b_r:b_{r+1}]``. Stage 2 frees the
         flat gradient once reduced (gradients 1/K per rank, plus the buckets in flight); stage
         1 keeps it (the paper's P_os: only the optimizer state is partitioned);
      2. ``step()``: the wrapped optimizer updates rank r's range θ[b_r:b_{r+1}] with ĝ_r;
      3. every bucket's parameters are all-gathered: θ = concat_r θ[b_r:b_{r+1}]; persistent
         buffers (BatchNorm's statistics) become rank 0's, as in SyncDP.

    With an elementwise optimizer and 2 ranks this is SyncDP bit for bit (a sum of two terms
    does not depend on its order); at K > 2 the reduce-scatter may add in another order than the
    all-reduce (float32: about 1e-7 relative per step).

    ZeRO++:

    * ``qgz = "int8" | "int4"`` (quantized gradients): step 1 becomes an all-to-all of each
      rank's chunks quantized blockwise (one float32 scale per ``block`` elements,
      :func:`~lowcomm.compress.quantize.quantize_blocks`), each rank dequantizing the K copies of
      its range and averaging them in full precision. Bytes per rank and bucket of n elements:
      ``(K−1)/K · n · (bits/8 + 4/block)`` instead of ``(K−1)/K · 4n``. Error per element at most
      half a block's scale, averaged over the ranks;
    * ``qwz = "int8"`` (quantized weights): step 3 all-gathers each range quantized blockwise to
      int8 and every rank, its owner included, dequantizes all of them (so the ranks' models stay
      equal); the owner keeps its exact range as the optimizer's (master) copy, 1/K of the
      parameters more. Bytes: ``(K−1)/K · n · (1 + 4/block)`` instead of ``(K−1)/K · 4n``;
    * ``hpz = true`` (hierarchical partitioning): the ranges are owned inside the innermost
      level of the topology (a node): gradients are reduce-scattered inside the node and the
      range all-reduced with the same range of the other nodes; the step's all-gather then stays
      inside the node. State per rank is 1/k (k ranks per node) instead of 1/K.

    Gradient clipping must see the whole gradient, which no rank holds: clip with
    :meth:`clip_grad_norm_` (the global norm: one 8-byte all-reduce), which the Hugging Face
    integration calls in place of torch's. After ``backward()`` the model's ``p.grad`` are None
    (the reduced gradient lives in the optimizer's ranges).

    Args:
        model, optimizer: the user's torch objects; every parameter the optimizer holds must
            be one of the model's, and the optimizer must not have stepped yet.
        comm: communicator (default: world).
        settings: a validated :class:`ZeROSettings` (else keyword arguments, its fields).
        levels: the topology's communicators (``hpz`` needs them).
        nonfinite: the NaN policy (:class:`~lowcomm.settings.NonFinite`): "abort" (``step()``
            after a NaN/Inf gradient names it) or "skip" (the caller skips such steps).

    Example::

        opt = lowcomm.build("zero2", model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        opt.zero_grad(); loss.backward(); opt.clip_grad_norm_(1.0); opt.step()
    """

    name = "zero"
    stage = 0
    lockstep = True
    dense_gradients = True     # sparse gradients are refused at build, naming the parameter
    sharded = True             # an outer loop above keeps only this rank's share of its state
    Settings = ZeROSettings

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, *, settings: ZeROSettings | None = None,
                 levels=None, nonfinite: NonFinite | str = NonFinite.ABORT, **options):
        super().__init__(model, optimizer, comm, settings=settings, **options)
        s = self.settings
        self.nonfinite = NonFinite.parse(nonfinite, "nonfinite", ArgumentError)
        self.partition = self._partition_mode(s.partition)
        if optimizer.state:
            raise LowcommError(f"{self.name}: the optimizer has state already (it stepped, or "
                               "loaded a state dict); wrap it before its first step and load "
                               "checkpoints through the method")
        names = self.built.names         # (Strategy checked: every one is a model parameter)
        self._scatter, self._across = self._partition_comms(levels)
        self.buffers = Buffers(model)
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        self.buckets = partition(optimizer, names, int(s.bucket_mb * (1 << 20)), self._scatter,
                                 by_tensor=self.partition == "tensor", master_copy=s.qwz != "none")
        self.built.counts = [len(g["params"]) for g in optimizer.param_groups]   # (what step()
        self.built.ids = {id(q) for g in optimizer.param_groups for q in g["params"]}   # checks)
        optimizer.lowcomm_ranges = {id(q): b.index for b in self.buckets for q, _, _ in b.pieces}
        sig = repr([(b.group, [(n, tuple(p.shape)) for n, p, _, _ in b.members], str(b.params.dtype))
                    for b in self.buckets])
        self._red = agreed_dup(self._scatter, "zero.layout", sig, len(self.buckets))
        self._across = [agreed_dup(c, "zero.layout", sig, len(self.buckets)) for c in self._across]
        self._frozen = [(n, p) for n, p in model.named_parameters()
                        if not any(p is q for b in self.buckets for _, q, _, _ in b.members)]
        self._where = {id(p): (b.index, i) for b in self.buckets for i, (_, p, _, _) in enumerate(b.members)}
        overlap = s.overlap
        if overlap is None:
            overlap = self.comm.cores_per_rank() >= 2 or any(
                b.params.device.type != "cpu" for b in self.buckets)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-zero") if overlap else None
        self._next = 0
        self.withheld: list[str] = []
        self.sync_s = 0.0
        self.passes = BackwardPasses(int(s.backward_passes_per_step), self._exchange)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook)
                       for b in self.buckets for _, p, _, _ in b.members]
        self._reset()

    # layout -------------------------------------------------------------------------------------
    def _partition_mode(self, asked: str) -> str:
        inner = type(self.optimizer)
        if asked == "auto":
            if issubclass(inner, ELEMENTWISE):
                return "flat"
            return "tensor"
        return asked

    def _partition_comms(self, levels) -> tuple[Comm, list[Comm]]:
        """(the ranks that share the ranges, the communicators to the same-range ranks of the
        other units, innermost level first: none without hpz)."""
        if not self.settings.hpz:
            return self.comm, []
        if levels is None or len(levels.names) < 2:
            raise ConfigError("strategy.hpz", "hierarchical partitioning shards inside the "
                              "innermost level of a topology; give one with at least two levels "
                              "(e.g. topology = \"node:2,rank:2\")")
        if levels.size != self.comm.size:
            raise ConfigError("strategy.hpz", f"{self.name} is a level of a per-level policy; "
                              "its units are the partition already (use hpz = false there)")
        inner = levels.names[-2]                     # e.g. "node": its units share the ranges
        return levels.group(inner), [levels.peers(n) for n in reversed(levels.names[:-1])]

    # backward -----------------------------------------------------------------------------------
    def _reset(self) -> None:
        for b in self.buckets:
            b.pending = set(range(len(b.members)))
            b.future = None
        self._next = 0

    def _hook(self, p: torch.Tensor) -> None:
        if not self.passes.exchanging():
            return                                   # a pass under no_sync: p.grad accumulates
        bi, i = self._where[id(p)]
        self._ready(self.buckets[bi], i, p.grad)
        if self.stage >= 2:
            p.grad = None                            # the bucket holds it now

    def _ready(self, b: Bucket, i: int, grad: torch.Tensor | None) -> None:
        if i not in b.pending:
            return
        if b.grad is None:
            b.grad = torch.empty_like(b.params)
        _, _, lo, hi = b.members[i]
        if grad is None:
            b.grad[lo:hi].zero_()
        else:
            b.grad[lo:hi].copy_(grad.reshape(-1))
        b.pending.discard(i)
        if self._pool is not None:
            while self._next < len(self.buckets) and not self.buckets[self._next].pending:
                nb = self.buckets[self._next]
                nb.future = self._pool.submit(self._reduce, nb)
                self._next += 1

    def _reduce(self, b: Bucket) -> list[str]:
        """Reduce-scatter one bucket's gradient into its shard's ``grad``; returns the names of
        this rank's tensors that held NaN/Inf (sent as zeros)."""
        bad = []
        for seg in nonfinite_segments(b.grad, b.segments):
            b.grad[seg.start:seg.stop].zero_()
            bad.append(seg.name)
        bits = QUANTIZED[self.settings.qgz]
        if bits:
            mine = self._quantized_reduce_scatter(b, bits)
        else:
            mine = reduce_scatter(b.grad, self._red, b.counts, self.settings.algorithm, "avg")
        for across in self._across:                  # hpZ: the same range of the other units
            if across.size > 1:
                across.allreduce_(mine, "avg")
        if mine.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr():
            mine = mine.clone()                      # a view of the bucket: the grad is its own
        for q, lo, hi in b.pieces:
            q.grad = mine[lo:hi].view(q.shape)
        if self.stage >= 2:
            b.grad = None
        return bad

    def _quantized_reduce_scatter(self, b: Bucket, bits: int) -> torch.Tensor:
        """qgZ: every rank's chunk j quantized blockwise and sent to rank j (one all-to-all);
        rank r dequantizes the K copies of its range and averages them."""
        comm, K, r, block = self._red, self._red.size, self._red.rank, self.settings.block
        counts = b.counts
        payloads = []
        for j in range(K):
            q, scales = quantize_blocks(b.grad[b.bounds[j]:b.bounds[j + 1]], bits, block)
            payloads.append(torch.cat([q.view(torch.uint8), scales.view(torch.uint8)]))
        n = counts[r]
        qbytes = n if bits == 8 else (n + 1) // 2
        size = qbytes + 4 * -(-n // block)
        got = comm.alltoallv(payloads, [size] * K)
        q = torch.stack([g[:qbytes] for g in got])
        scales = torch.stack([g[qbytes:] for g in got]).view(torch.float32)   # a new, aligned tensor
        if bits == 8:
            q = q.view(torch.int8)
        return dequantize_blocks(q, scales, n, bits, block, b.grad.dtype).mean(0)

    def _exchange(self) -> None:
        """At the end of the exchanging backward pass: the buckets not yet launched (unused
        parameters count as zeros), then wait for all."""
        t0 = time.perf_counter()
        for b in self.buckets:
            for i in sorted(b.pending):
                _, p, _, _ = b.members[i]
                self._ready(b, i, p.grad)
                if self.stage >= 2:
                    p.grad = None
        bad = []
        for b in self.buckets:
            bad += b.future.result() if b.future is not None else self._reduce(b)
        self.withheld = bad
        for b in self.buckets:                       # the reduced gradient lives in the ranges
            for _, p, _, _ in b.members:
                p.grad = sharded_grad(p)
        self._reset()
        self.sync_s = time.perf_counter() - t0

    def no_sync(self):
        return self.passes.no_sync()

    def local_nonfinite(self) -> str | None:
        return f"the gradient of {self.withheld[0]!r}" if self.withheld else None

    # the optimizer interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._drop_model_grads()

    def _check_frozen(self) -> None:
        for n, p in self._frozen:
            if p.grad is not None:
                raise LowcommError(f"parameter {n!r} has a gradient but was frozen (or not in the "
                                   f"optimizer) when {self.name} was built, so no rank owns it; "
                                   "unfreeze parameters before building the method")

    def _drop_model_grads(self) -> None:
        for b in self.buckets:
            for _, p, _, _ in b.members:
                p.grad = None

    def _step(self, closure=None):
        self.passes.before_step()
        self._drop_model_grads()
        self._check_frozen()
        bad = self.local_nonfinite()
        if bad is not None and self.nonfinite is NonFinite.ABORT:
            raise NonFiniteError(self.comm.rank, bad)
        loss = self.optimizer.step(closure)
        self.withheld = []
        self._gather_params()
        self.buffers.broadcast(self.comm)
        return loss

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Step 3: every rank's range to every rank (dense, or qwZ's int8)."""
        for b in self.buckets:
            if self.settings.qwz == "none":
                allgather_(b.params, self._red, b.counts, self.settings.algorithm)
                continue
            block = self.settings.block
            q, scales = quantize_blocks(b.shard, 8, block)
            mine = torch.cat([q.view(torch.uint8), scales.view(torch.uint8)])
            sizes = [c + 4 * -(-c // block) for c in b.counts]
            got = self._red.allgatherv(mine, sizes)
            for j, (g, c) in enumerate(zip(got, b.counts)):
                if c:
                    dq = dequantize_blocks(g[:c].view(torch.int8)[None], g[c:].clone().view(torch.float32)[None],
                                           c, 8, block, b.params.dtype)[0]
                    b.params[b.bounds[j]:b.bounds[j + 1]].copy_(dq)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """ZeRO-1's flat gradients (stage 2 frees them), qwZ's master copy of the ranges."""
        return {"grad": [b.grad for b in self.buckets if b.grad is not None],
                "param": [b.shard for b in self.buckets] if self.settings.qwz != "none" else []}

    @torch.no_grad()
    def parameters_changed(self) -> None:
        """qwZ's master copy of this rank's ranges follows the parameters set from outside."""
        if self.settings.qwz != "none":
            for b in self.buckets:
                b.shard.copy_(b.params[b.bounds[self._red.rank]:b.bounds[self._red.rank + 1]])

    def skip(self) -> None:
        self.passes.before_step()
        self._drop_model_grads()
        self.withheld = []
        self.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the reduced gradient by its global norm (torch's ``clip_grad_norm_`` over the
        whole model: each rank's ranges' part, summed over the partition; one all-reduce).
        Returns the norm before clipping."""
        norm_type = float(norm_type)
        grads = [q.grad for b in self.buckets for q, _, _ in b.pieces if q.grad is not None]
        dev = self.buckets[0].params.device if self.buckets else torch.device("cpu")
        if norm_type == float("inf"):
            mine = max((g.abs().max() for g in grads if g.numel()), default=torch.tensor(0.0))
            every = self._red.allgather(mine.reshape(1).double().cpu())
            total = every.max()
        else:
            mine = sum((g.double().abs().pow(norm_type).sum() for g in grads),
                       torch.tensor(0.0, dtype=torch.float64, device=dev)).reshape(1).cpu()
            if self._red.size > 1:
                self._red.allreduce_(mine)
            total = mine[0] ** (1.0 / norm_type)
        total = total.float().to(dev)
        if error_if_nonfinite and not torch.isfinite(total):
            raise NonFiniteError(self.comm.rank, f"the total gradient norm ({float(total)})")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    clip_grad_norm = clip_grad_norm_        # the name sharded optimizers use elsewhere

    # state ------------------------------------------------------------------------------------
    def _layout_state(self) -> dict:
        r = self._red.rank
        return {"stage": self.stage, "partition": self.partition, "world": self._red.size,
                "rank": r, "hpz": self.settings.hpz,
                "buckets": [{"members": [(n, a, z) for n, _, a, z in bk.members],
                             "bounds": list(bk.bounds)} for bk in self.buckets],
                # the optimizer's parameters in its order: (bucket, start, stop) in the bucket
                "pieces": [(bk.index, bk.bounds[r] + lo, bk.bounds[r] + hi)
                           for gi in range(len(self.optimizer.param_groups))
                           for bk in self.buckets if bk.group == gi for _, lo, hi in bk.pieces]}

    def _state_dict(self) -> dict:
        state = super()._state_dict()
        state["layout"] = self._layout_state()
        if self.settings.qwz != "none":
            state["shards"] = [b.shard.detach().clone() for b in self.buckets]
        return state

    def _load_state_dict(self, state: dict) -> None:
        saved = state.get("layout")
        if saved is None:
            raise LowcommError(f"{self.name}: this state was not written by a ZeRO method (no "
                               "layout); load a checkpoint of zero1 or zero2")
        mine = self._layout_state()
        for key in ("partition", "world", "rank", "hpz"):
            if saved[key] != mine[key]:
                raise LowcommError(f"{self.name}: the state was written with {key} = "
                                   f"{saved[key]!r}, this run has {mine[key]!r}; resume on the "
                                   "same ranks (a run resumes on another rank count through "
                                   "its checkpoints: lowcomm train --resume, which reshards)")
        if [b["members"] for b in saved["buckets"]] != [b["members"] for b in mine["buckets"]]:
            raise LowcommError(f"{self.name}: the state's bucket layout differs from this "
                               "model's (another model, bucket_mb or optimizer groups)")
        super()._load_state_dict(state)
        with torch.no_grad():
            for b, full in zip(self.buckets, state.get("shards", [])):
                b.shard.copy_(full)
            self._gather_params()

    def reshard(self, old: list[dict]) -> dict:
        """Resume on another number of ranks: the model is replicated (rank 0's, checked
        equal); the optimizer's state of every old rank's ranges is put together per parameter
        and cut again for this rank's ranges (its step counts are rank 0's)."""
        from ..reshard import replicated
        merged = replicated([{"model": o["model"], "strategy": {}} for o in old], self.name)
        layouts = [o["strategy"].get("layout") for o in old]
        if any(x is None for x in layouts):
            raise LowcommError(f"{self.name}: the checkpoint was not written by zero1/zero2")
        full: dict[str, dict] = {}           # parameter name -> state key -> flat tensor
        scalars: dict = {}
        for o, lay in zip(old, layouts):
            for i, (bi, lo, hi) in enumerate(lay["pieces"]):
                for key, v in o["strategy"]["optimizer"]["state"].get(i, {}).items():
                    if not torch.is_tensor(v) or v.dim() == 0:
                        scalars.setdefault(key, v)
                        continue
                    v = v.reshape(-1)
                    for name, a, z in lay["buckets"][bi]["members"]:
                        x, y = max(a, lo), min(z, hi)
                        if x < y:
                            t = full.setdefault(name, {}).setdefault(key, torch.zeros(z - a, dtype=v.dtype))
                            t[x - a:y - a].copy_(v[x - lo:y - lo])
        mine = self._layout_state()
        state = {}
        for i, (bi, lo, hi) in enumerate(mine["pieces"]):
            b = self.buckets[bi]
            keys = {k for name, _, _, _ in b.members for k in full.get(name, {})}
            if not keys:
                continue
            shape = self._pieces()[i].shape
            entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
            for key in keys:
                flat = torch.cat([full[name][key] for name, _, _, _ in b.members])
                entry[key] = flat[lo:hi].clone().view(shape)
            state[i] = entry
        groups, n = [], 0                    # old rank 0's options, this rank's pieces
        for g, here in zip(old[0]["strategy"]["optimizer"]["param_groups"], self.optimizer.param_groups):
            groups.append(dict(g, params=list(range(n, n + len(here["params"])))))
            n += len(here["params"])
        strategy = {"optimizer": {"state": state, "param_groups": groups}, "layout": mine}
        r = self._red.rank
        if "shards" in old[0]["strategy"]:
            strategy["shards"] = [merged_model_range(merged["model"], b, r) for b in self.buckets]
        return {"model": merged["model"], "strategy": strategy}

    def _pieces(self) -> list[torch.nn.Parameter]:
        """The inner optimizer's parameters, in its order."""
        return [q for g in self.optimizer.param_groups for q in g["params"]]

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return {}
        return {"stage": self.stage, "partition": self.partition,
                "ranks_sharing": self._red.size, "buckets": len(self.buckets),
                "qgz": self.settings.qgz, "qwz": self.settings.qwz, "hpz": self.settings.hpz}

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class ZeRO1(ZeRO):
    __doc__ = "ZeRO stage 1 (P_os): the optimizer state partitioned; see :class:`ZeRO`."
    name, stage = "zero1", 1


class ZeRO2(ZeRO):
    __doc__ = "ZeRO stage 2 (P_os+g): optimizer state and gradients partitioned; see :class:`ZeRO`."
    name, stage = "zero2", 2


METHOD1 = Method("zero1", ZeROSettings, lambda s, m, o, c, ctx: build(s, m, o, c, ctx, 1),
                 "ZeRO-1: gradients reduce-scattered, optimizer state sharded 1/K, parameters "
                 "all-gathered", level=True, shards_around=("tp", "pp"), python="ZeRO1")
METHOD2 = Method("zero2", ZeROSettings, lambda s, m, o, c, ctx: build(s, m, o, c, ctx, 2),
                 "ZeRO-2: as ZeRO-1 with the gradients sharded too", level=True,
                 shards_around=("tp", "pp"), python="ZeRO2")
