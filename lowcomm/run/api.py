"""``lowcomm.train`` (this module, :mod:`lowcomm.run.api`): the Python entry point of the one training loop (``lowcomm train`` is a
thin shell around it).

Example (``launchers/local.sh -n 4 python my_script.py``)::

    import lowcomm
    summary = lowcomm.train("my_task.py", strategy="diloco:period=50", steps=500,
                            out="runs/mine", set=["optimizer.name=adamw", "compressor.name=none"])

    # or the task's functions directly
    summary = lowcomm.train(lowcomm.from_functions(make_model, loss_fn, batch_fn), steps=100)

Any config key can be given: top-level ones as keyword arguments (``steps``, ``lr``,
``batch_size``, ``seed``, ...), any other as ``set=["table.key=value", ...]`` (or a dict), and a
whole TOML file as ``config``. ``strategy`` takes a spec string ``NAME[:key=value,...]``.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..comm.comm import Comm, init
from ..errors import ArgumentError, ConfigError, refuse_moved
from ..tasks import Task, TaskError, load_task
from .config import Config, apply_comm_settings
from .config import load_config as load_config_file
from .loop import run as run_loop
from .folder import RunOptions
from .registry import build_strategy, check, parse_spec
from ..strategies.method import Context



def load_config(path=None, overrides=(), base: dict | None = None) -> Config:
    """A run's resolved config: :func:`lowcomm.run.config.load_config` (TOML, ``--set``), then
    the task (a missing file or function fails here, before any rank starts; a method the task's
    module registers is known from here on) and every method-level check
    (:func:`lowcomm.run.registry.check`); errors name the key."""
    cfg = load_config_file(path, overrides, base)
    try:
        load_task(cfg.task.name)
    except TaskError as e:
        raise ConfigError("task", str(e)) from None
    check(cfg)
    return cfg


def topology_comms(cfg, comm):
    """The topology's communicators over ``comm`` when the run needs them (a per-level policy,
    or a ``hierarchical`` all-reduce), else None; the topology is read (and checked against the
    job's size) whenever one is configured, and ``comm.link`` set to its outermost level's
    links (which a world collective crosses: the watchdog's limits and the compressed
    collective's choice read it). Collective over ``comm``."""
    configured = bool(cfg.topology or os.environ.get("LOWCOMM_TOPOLOGY"))
    algorithm = cfg.strategy.get("algorithm", "auto")
    # "auto" may pick the hierarchical all-reduce where a topology is configured
    needed = bool(cfg.policy) or algorithm == "hierarchical" or (algorithm == "auto" and configured)
    if not (needed or configured):
        return None
    from ..comm.topology import Topology
    topo = Topology.from_env(comm, cfg.topology)
    if needed:
        return topo.comms(comm)
    topo.check_size(comm.size)
    comm.link = topo.link(topo.names[0])    # a world collective crosses the outermost links
    return None


def task_of(cfg: Config) -> Task:
    return load_task(cfg.task.name)


def run(cfg: Config, opts: RunOptions = RunOptions(), comm: Comm | None = None,
        task: Task | None = None) -> dict:
    """Train a resolved config (:func:`lowcomm.run.api.load_config`) on ``comm`` (default: the
    world): the task it names (or ``task``), the strategy it names; where it writes, what it
    resumes: ``opts``."""
    from .fleet.plan import identity
    me = identity()                        # a datacenter's job in a fleet (lowcomm.run.fleet)
    if me is None and cfg.fleet.dcs:       # (before MPI starts)
        raise ConfigError("fleet.dcs", "a fleet is launched from outside mpirun by 'lowcomm "
                          "train --dcs D --np N' (or lowcomm.train_fleet), which starts one job "
                          "per datacenter")
    comm = comm or init()
    task = task or task_of(cfg)
    if me is not None:
        from .fleet.member import run as run_member
        return run_member(cfg, task, comm, me, opts)
    apply_comm_settings(cfg, comm)         # the watchdog's limits, before the first collective
    levels = topology_comms(cfg, comm)     # the topology's communicators: hierarchical/policy
    build = lambda m, o, c, **kw: build_strategy(cfg, m, o, c, Context(levels=levels, **kw))  # noqa: E731
    return run_loop(cfg, task, build, comm, opts)


_run_config = run          # (train's argument ``run`` is its RunOptions)

#: ``lowcomm.train``'s keywords that moved: the task's functions into a Task, how the run
#: starts into RunOptions
TRAIN_MOVED = {**{k: "task=lowcomm.from_functions(model, loss, batch, eval_batches)"
                  for k in ("model", "loss", "batch", "eval_batches")},
               **{k: f"run=lowcomm.RunOptions({k}=...)"
                  for k in ("resume", "progress", "overwrite")}}


def train(task=None, *, strategy=None, config: str | Path | None = None, set=(),
          out: str | Path | None = None, comm: Comm | None = None,
          run: RunOptions | None = None, **keys) -> dict:
    """Train ``task`` (a file path, a module name, a :class:`~lowcomm.tasks.Task` — from the
    task's functions: :func:`lowcomm.from_functions` — or a module object) under the method and
    settings given; returns the summary (rank 0 writes it to ``out``, with metrics.jsonl and
    checkpoints). ``run``: how the run starts (:class:`~lowcomm.run.folder.RunOptions`:
    ``resume``, ``overwrite``, ``progress``; default no progress bar). Runs on every rank of
    ``comm`` (default: the world)."""
    refuse_moved(keys, TRAIN_MOVED, "lowcomm.train()")
    overrides = [set] if isinstance(set, str) else list(set.items() if isinstance(set, dict) else set)
    overrides = [o if isinstance(o, str) else f"{o[0]}={_literal(o[1])}" for o in overrides]
    overrides += [f"{k}={_literal(v)}" for k, v in keys.items()]
    if strategy is not None:
        m, opts = parse_spec(strategy, "strategy")
        overrides += [f"strategy.name={_literal(m.name)}"]
        overrides += [f"strategy.{k}={_literal(v)}" for k, v in opts.items()]
    if isinstance(task, (str, Path)):
        overrides.append(f"task={_literal(str(task))}")
    cfg = load_config(config, overrides)
    if task is None:
        raise ArgumentError("task", "give a task: a file, a module, or "
                            "lowcomm.from_functions(model, loss, batch, eval_batches)")
    if isinstance(task, (str, Path)):
        task = load_task(str(task))
    elif not isinstance(task, Task):          # a module object
        task = load_task(task.__name__) if hasattr(task, "__name__") else task
    return _run_config(cfg, _run_options(out, run), comm, task)


def _run_options(out, run: RunOptions | None) -> RunOptions:
    """``run`` (default: no progress bar) writing to ``out``, which one of them may give."""
    if run is None:
        return RunOptions(out, progress=False)
    if not isinstance(run, RunOptions):
        raise ArgumentError("run", f"must be a lowcomm.RunOptions, got {type(run).__name__}")
    if out is not None and run.out is not None:
        raise ArgumentError("out", "given twice: as out= and as run.out; give one")
    return run if out is None else dataclasses.replace(run, out=out)


def _literal(v) -> str:
    """``v`` as a TOML literal for an override."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


__all__ = ["load_config", "run", "topology_comms", "train"]
