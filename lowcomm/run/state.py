"""What a run is while it runs: :class:`Run` (the objects every part of the loop works on) and
:class:`LoopState` (the loop's own counters — what a checkpoint saves of the loop)."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..comm.comm import Comm


@dataclass
class LoopState:
    """The loop's counters, saved in every checkpoint under ``"loop"``.

    ``step`` is the last step taken (a parameter-server worker's own steps); ``wall_s`` and
    ``compute_cpu_s`` add up across resumes; ``window`` holds the losses since the last metrics
    line; ``samples`` counts the samples of every rank; ``resizes`` lists the rank-count changes
    at resumes (``{"step", "from", "to"}``); ``passed`` counts the steps this rank's method passed
    over without computing them (dynamic local updates)."""
    step: int = 0
    skipped: int = 0
    passed: int = 0           # steps the method passed over on this rank (dynamic local updates)
    wall_s: float = 0.0
    window: list = field(default_factory=list)
    recent: float = float("nan")
    resizes: list = field(default_factory=list)
    samples: int = 0
    compute_cpu_s: float = 0.0
    memory: dict = field(default_factory=dict)     # this rank's memory after its first step here

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict, step: int) -> "LoopState":
        """The state a checkpoint at ``step`` saved; keys it lacks (an older checkpoint) take
        their defaults, ``compute_cpu_s`` NaN (unknown), ``step`` the checkpoint's."""
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in saved.items() if k in known})
        if "step" not in saved:
            state.step = step
        if "compute_cpu_s" not in saved:
            state.compute_cpu_s = math.nan
        state.window, state.resizes = list(state.window), list(state.resizes)
        return state


@dataclass
class Run:
    """The objects of one run on one rank: the resolved config, the task, the model, the
    method, the world and control communicators (the control one uncharged), the output
    folder and the checkpointer (None without a folder), and how it was started."""
    cfg: Any
    task: Any
    model: Any
    strategy: Any
    comm: Comm
    ctl: Comm
    out: Path | None
    ckpt: Any
    progress: bool = True
    resume: Path | str | None = None

    @functools.cached_property
    def held_out(self) -> list:
        """The task's held-out batches (built once)."""
        return self.task.eval_batches(self.cfg) if self.cfg.eval_batches else []
