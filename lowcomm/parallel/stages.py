"""Where a chain is cut into pipeline stages, and the module one stage runs.

The cut is a setting (``strategy.split``):

* ``"params"`` (default) — balanced by parameter count: the cut that makes the largest stage's
  parameters (the stem's counted with the first stage, the head's with the last) as small as
  it can be (the linear-partition problem, solved exactly by dynamic programming);
* ``"time"`` — balanced by measured time: each block's forward and backward pass timed on a
  micro-batch (the stem's with the first block, the head's and the loss's with the last),
  rank 0's measurement used by every rank (:func:`block_times`), then the same partition;
* ``"every:N"`` — a new stage every N blocks (the blocks must be N × the stages);
* ``"at:A,B,..."`` — named split points: the blocks where stages 1, 2, … begin, by index in
  the blocks' list or by module name (``"at:transformer.h.6"``).

A :class:`Stage` is an ``nn.Module`` over the model's own modules for blocks ``[lo, hi)`` (and
the stem on the first stage, the head on the last): what torch's ``PipelineStage`` runs.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError
from .chains import Chain, blocks_of


def parse_split(text: str, key: str = "strategy.split") -> tuple[str, list]:
    """``"params"``, ``"every:N"`` or ``"at:A,B"`` as (rule, arguments); ConfigError naming
    ``key`` otherwise."""
    rule, _, rest = str(text).partition(":")
    rule = rule.strip()
    args = [a.strip() for a in rest.split(",") if a.strip()]
    if rule in ("params", "time") and not args:
        return rule, []
    if rule == "every" and len(args) == 1 and args[0].isdigit() and int(args[0]) > 0:
        return rule, [int(args[0])]
    if rule == "at" and args:
        return rule, [int(a) if a.isdigit() else a for a in args]
    raise ConfigError(key, f"{text!r} is no split; give \"params\" (balanced by parameter "
                      "count), \"time\" (by measured time), \"every:N\" (a stage every N blocks) or \"at:A,B,...\" (the "
                      "blocks where stages 1, 2, ... begin, by index or module name)")


def numel(modules) -> int:
    """Parameters of ``modules`` (each distinct tensor once)."""
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


def cut(model: nn.Module, chain: Chain, stages: int, split: str,
        key: str = "strategy.split", count_key: str = "strategy.stages_per_rank",
        times: list[float] | None = None) -> list[int]:
    """The block index each stage starts at, and the number of blocks at the end
    (``stages + 1`` bounds, increasing: stage ``s`` runs blocks ``[b[s], b[s+1])``);
    ``count_key``: the setting that made ``stages`` (named when there are too many);
    ``times``: each block's measured seconds, for ``split = "time"``."""
    blocks = blocks_of(model, chain)
    n = len(blocks)
    if stages > n:
        raise ConfigError(count_key, f"{stages} stages for a model of {n} blocks "
                          f"({chain.blocks or type(model).__name__}): a stage holds at least one "
                          f"block, so at most {n} stages")
    rule, args = parse_split(split, key)
    if rule == "every":
        if args[0] * stages != n:
            raise ConfigError(key, f"every:{args[0]} cannot cut {n} blocks into {stages} stages "
                              f"(it needs {args[0] * stages} blocks); use "
                              f"{f'every:{n // stages}' if n % stages == 0 else 'at:...'} or "
                              "split=params")
        return [s * args[0] for s in range(stages)] + [n]
    if rule == "at":
        return _at(blocks, chain, args, stages, n, key)
    if rule == "time":
        if times is None or len(times) != n:
            raise ConfigError(key, "split = \"time\" needs each block's measured time: give "
                              "the pipeline an example batch (example=)")
        return balanced(times, stages)
    stem = numel(model.get_submodule(m) for m in chain.stem)
    head = numel(model.get_submodule(m) for m in chain.head if m not in chain.stem)
    sizes = [numel([b]) for b in blocks]
    sizes[0] += stem
    sizes[-1] += head
    return balanced(sizes, stages)


def _at(blocks, chain: Chain, points: list, stages: int, n: int, key: str) -> list[int]:
    names = {f"{chain.blocks}.{i}" if chain.blocks else str(i): i for i in range(n)}
    starts = []
    for p in points:
        i = p if isinstance(p, int) else names.get(p)
        if i is None or not 0 < i < n:
            raise ConfigError(key, f"split point {p!r} is not a block where a stage can begin "
                              f"(block indices 1..{n - 1}, or names such as "
                              f"{list(names)[min(1, n - 1)]!r})")
        starts.append(i)
    if len(starts) != stages - 1 or starts != sorted(set(starts)):
        raise ConfigError(key, f"{len(starts)} increasing split points make {len(starts) + 1} "
                          f"stages; {stages} stages need {stages - 1}")
    return [0, *starts, n]


def block_times(model: nn.Module, chain: Chain, inputs: tuple, criterion, target,
                repeats: int = 3) -> list[float]:
    """Each block's forward and backward seconds on ``inputs`` (the median of ``repeats``), the
    stem's added to the first block's, the head's and the loss's to the last's. Gradients the
    timing leaves are cleared."""
    import time
    blocks = list(blocks_of(model, chain))
    runs: list[list[float]] = []
    for _ in range(repeats):
        row = []
        t0 = time.perf_counter()
        x = chain.embed(model, *inputs)
        stem = time.perf_counter() - t0
        for b in blocks:
            x = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            y = chain.block(b, x)
            y.backward(torch.ones_like(y))
            row.append(time.perf_counter() - t0)
            x = y
        t0 = time.perf_counter()
        criterion(chain.out(model, x.detach().requires_grad_(True)), target).backward()
        row[0] += stem
        row[-1] += time.perf_counter() - t0
        runs.append(row)
    model.zero_grad(set_to_none=True)
    return [sorted(r[i] for r in runs)[len(runs) // 2] for i in range(len(blocks))]


def balanced(sizes: list[float], parts: int) -> list[int]:
    """Bounds cutting ``sizes`` into ``parts`` contiguous non-empty runs whose largest sum is
    the smallest possible (linear partition by dynamic programming; ties: earliest cuts)."""
    n = len(sizes)
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]     # best[k][i]: first i items, k runs
    where = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], pre[i] - pre[j])
                if cost < best[k][i]:
                    best[k][i], where[k][i] = cost, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = where[k][i]
        bounds.append(i)
    return bounds[::-1]


class Stage(nn.Module):
    """Stage ``index`` of ``count``: the model's own modules for blocks ``[lo, hi)``, with the
    chain's stem on the first stage and its head on the last (registered here, so that
    ``parameters()`` are the stage's; the model keeps them too)."""

    def __init__(self, model: nn.Module, chain: Chain, index: int, count: int, lo: int, hi: int):
        super().__init__()
        self.index, self.count, self.lo, self.hi = index, count, lo, hi
        self.chain, self._model = chain, (model,)       # a tuple: not a submodule
        self.first, self.last = index == 0, index == count - 1
        self.blocks = nn.ModuleList(list(blocks_of(model, chain))[lo:hi])
        self.parts = nn.ModuleDict({n.replace(".", "/"): model.get_submodule(n)
                                    for n in self.part_names()})

    def part_names(self) -> list[str]:
        """The stem's and the head's modules this stage holds (by the model's names)."""
        names = list(self.chain.stem) if self.first else []
        return names + [n for n in self.chain.head if self.last and n not in names]

    def module_names(self) -> list[str]:
        """Every module this stage holds, by the model's names."""
        prefix = f"{self.chain.blocks}." if self.chain.blocks else ""
        return self.part_names() + [f"{prefix}{i}" for i in range(self.lo, self.hi)]

    def forward(self, *args):
        model = self._model[0]
        x = self.chain.embed(model, *args) if self.first else args[0]
        for b in self.blocks:
            x = self.chain.block(b, x)
        return self.chain.out(model, x) if self.last else x


def owned_names(model: nn.Module, stages: list[Stage]) -> set[str]:
    """The model's state-dict keys whose tensors ``stages`` hold (parameters and buffers; a
    tied tensor under each of its names)."""
    held = {id(t) for s in stages for t in (*s.parameters(), *s.buffers())}
    return {k for k, t in model.state_dict(keep_vars=True).items() if id(t) in held}


@contextmanager
def swapping():
    """Module conversions inside swap each tensor's contents in place (``torch.utils.swap_tensors``):
    every name of a tied tensor (``lm_head.weight`` is ``wte.weight``) sees the change."""
    from torch.__future__ import (get_swap_module_params_on_conversion,
                                  set_swap_module_params_on_conversion)
    old = get_swap_module_params_on_conversion()
    set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        set_swap_module_params_on_conversion(old)


def release_others(model: nn.Module, chain: Chain, stages: list[Stage]) -> tuple[list[str], dict]:
    """Move every module of the chain that none of ``stages`` holds to the meta device (its
    memory freed; :func:`restore_others` brings it back); returns their names and their
    non-persistent buffers (which no state dict carries: kept as they are)."""
    held = {n for s in stages for n in s.module_names()}
    prefix = f"{chain.blocks}." if chain.blocks else ""
    every = [*chain.stem, *chain.head, *(f"{prefix}{i}" for i in range(len(blocks_of(model, chain))))]
    others = [n for n in dict.fromkeys(every) if n not in held]
    kept = {}
    for n in others:
        for mn, m in model.get_submodule(n).named_modules(prefix=n):
            kept.update({(mn, bn): b for bn, b in m._buffers.items()
                         if b is not None and bn in m._non_persistent_buffers_set})
        with swapping():
            model.get_submodule(n).to("meta")
    return others, kept


def outside_chain(model: nn.Module, chain: Chain) -> list[str]:
    """Modules holding tensors of their own (parameters, buffers) inside none of the chain's
    stem, blocks and head: what every stage uses (Llama's rotary frequencies)."""
    prefix = f"{chain.blocks}." if chain.blocks else ""
    inside = [*chain.stem, *chain.head, *(f"{prefix}{i}" for i in range(len(blocks_of(model, chain))))]
    return [n for n, m in model.named_modules()
            if (m._parameters or m._buffers) and not any(n == c or n.startswith(c + ".") for c in inside)]


def restore_others(model: nn.Module, names: list[str], kept: dict, device: torch.device) -> None:
    """Give the modules :func:`release_others` moved to meta real storage again (uninitialised:
    load their state next), their non-persistent buffers as they were."""
    for n in names:
        with swapping():
            model.get_submodule(n).to_empty(device=device)
    for (mn, bn), b in kept.items():
        model.get_submodule(mn)._buffers[bn] = b


__all__ = ["Stage", "balanced", "cut", "numel", "outside_chain", "owned_names", "parse_split", "release_others",
           "restore_others"]
