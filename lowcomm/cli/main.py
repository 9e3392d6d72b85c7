"""``lowcomm`` command line (one rank per process under mpirun).

An uncaught exception on any rank aborts the whole MPI job (``MPI_Abort``) after printing the
rank and the error, so a failure on one rank never leaves the others waiting in a collective.
Configuration is read and validated before MPI starts, so a bad key fails every rank at once.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import traceback
from pathlib import Path

import click

from .common import TrainOptions, check_env, config_options, debug, launcher_rank, \
    load_cfg as _config, pass_options, saved_config, world as _world
from ..errors import LowcommError
from .fleet import fleet_options, refuse_outside, run_fleet
from .fault import fault as fault_command
from .plan import plan as plan_command
from .topo import topo as topo_command
from .wan import wan as wan_command

log = logging.getLogger("lowcomm")

__all__ = ["cli", "config_options", "launcher_rank", "main"]


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def cli(verbose: bool) -> None:
    """lowcomm: low-communication distributed training over MPI."""
    check_env()
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format=f"[rank {launcher_rank()}] %(levelname)s %(name)s: %(message)s")


@cli.command()
@config_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for config.json, metrics.jsonl, summary.json and checkpoints/ "
                   "[default: runs/latest, or the --resume folder].")
@click.option("--checkpoint-every", type=int, default=None, metavar="N",
              help="Write a checkpoint every N steps (same as --set checkpoint.every=N).")
@click.option("--resume", type=click.Path(file_okay=False, exists=True), default=None, metavar="DIR",
              help="Continue the run in DIR (its config.json, then --config/--set) from its "
                   "newest intact checkpoint.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--overwrite", is_flag=True,
              help="Replace the run already in --out (its config, metrics, summary and "
                   "checkpoints: only what lowcomm wrote, in a folder it marked); without it "
                   "such a folder is refused.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None, metavar="N",
              help="Supervise: launch the job (on --np ranks) and relaunch it from its newest "
                   "checkpoint when it fails, up to N times (not a stop you asked for). Run this "
                   "outside mpirun: it starts mpirun itself.")
@click.option("--np", type=click.IntRange(min=1), default=None,
              help="Ranks of the supervised job (with --max-restarts).")
@click.option("--min-ranks", type=click.IntRange(min=1), default=None, metavar="M",
              help="With --max-restarts: when a relaunch on n ranks fails too (a rank cannot "
                   "come back), relaunch on n-1 ranks, down to M, resuming the checkpoint on "
                   "fewer ranks [default: --np, never shrink].")
@click.option("--restart-backoff", type=click.FloatRange(min=0), default=2.0, show_default=True,
              metavar="S", help="With --max-restarts: wait S·2^k seconds before the k-th relaunch.")
@click.option("--launcher", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --max-restarts: a launcher taking '-n N COMMAND...' (default: mpirun "
                   "with this machine's flags).")
@click.option("--run-id", default=None, hidden=True,
              help="The run's id, from its supervisor: a folder marked with it holds this run's "
                   "own earlier attempt, which it replaces.")
@click.option("--report-dir", default=None, hidden=True,
              help="Where each rank reports how it ended, for its supervisor (read by main()).")
@fleet_options
@pass_options(TrainOptions)
def train(opts: TrainOptions):
    """Train the configured task with the configured strategy on every rank.

    \b
    --resume DIR may run on another number of ranks than DIR's run: each method merges the old
    ranks' checkpoints by its own rule (see the README's "Resume on another number of ranks")."""
    if opts.dcs is not None:                   # a fleet: one MPI job per datacenter
        run_fleet(opts)
        return
    if opts.max_restarts is not None or opts.np is not None:
        _supervised(opts)
        return
    if opts.launcher or opts.min_ranks is not None:
        raise click.UsageError(f"{'--launcher' if opts.launcher else '--min-ranks'} goes with "
                               "--max-restarts (a supervised run)")
    global _RUN_OUT
    overrides, resume = opts.overrides, opts.resume
    if opts.checkpoint_every is not None:
        overrides = (*overrides, f"checkpoint.every={opts.checkpoint_every}")
    cfg = _config(opts.config, overrides, saved_config(resume) if resume else None)
    refuse_outside(cfg)
    out = opts.out or resume or "runs/latest"
    from ..run.folder import refusal
    why = refusal(Path(out), resume, opts.overwrite, opts.run_id)   # before MPI starts: every rank at once
    if why:
        raise click.UsageError(why)
    _RUN_OUT = Path(out)
    comm = _world()
    from ..run.api import run
    from ..run.folder import RunOptions
    summary = run(cfg, RunOptions(out, not opts.quiet, resume, opts.overwrite, opts.run_id), comm)
    if comm.rank == 0:
        keys = ("method", "task", "ranks", "steps", "params", "final_loss", "eval_loss",
                "bytes_total", "wall_s", "skipped_steps", "state_sha256", "ranks_agree")
        from ..run.folder import json_text
        click.echo(json_text({k: summary[k] for k in keys if k in summary}).rstrip())
        click.echo(f"wrote {Path(out) / 'summary.json'}")


_RUN_OUT: Path | None = None     # the run folder, for the tracebacks of a failing rank


def _supervised(opts: TrainOptions) -> None:
    """``lowcomm train --np N --max-restarts R``: this process launches and watches the job."""
    import os
    import sys

    from ..tools.compare import mpirun_command
    from ..run.folder import checkpoint_dir
    from ..run.supervise import Attempts, supervise
    np_, min_ranks, resume, every = opts.np, opts.min_ranks, opts.resume, opts.checkpoint_every
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        raise click.UsageError("--max-restarts supervises the job from outside: run 'lowcomm train "
                               "--np N --max-restarts R ...' without mpirun (it starts mpirun)")
    if np_ is None:
        raise click.UsageError("--max-restarts needs --np (the ranks of the job it launches)")
    if min_ranks is not None and min_ranks > np_:
        raise click.UsageError(f"--min-ranks {min_ranks} is more than --np {np_}")
    if resume and opts.out and Path(opts.out).resolve() != Path(resume).resolve():
        raise click.UsageError("a supervised run resumes in place: give --resume DIR alone")
    out = Path(opts.out or resume or "runs/latest")
    cfg = _config(opts.config, (*opts.overrides, *([f"checkpoint.every={every}"] if every else [])),
                  saved_config(resume) if resume else None)
    checkpoints = checkpoint_dir(cfg, out)
    _refuse_before_launch(out, resume, opts.overwrite, checkpoints)
    args = [sys.executable, "-m", "lowcomm.cli", "train", *(["--quiet"] if opts.quiet else []),
            *(["--config", opts.config] if opts.config else []),
            *[a for o in opts.overrides for a in ("--set", o)],
            *(["--checkpoint-every", str(every)] if every else [])]
    attempts = Attempts(opts.max_restarts or 0, opts.restart_backoff, np=np_, min_ranks=min_ranks,
                        checkpoints=checkpoints)
    result = supervise(lambda n: mpirun_command(n, opts.launcher), args, out, attempts,
                       first=["--resume", str(out)] if resume else
                       (["--overwrite"] if opts.overwrite else []))
    _supervised_end(result, out)


def _supervised_end(result: dict, out: Path) -> None:
    """What a supervised run says at its end: each failed attempt, why it was not restarted;
    its summary's head, or its exit status."""
    for f in result["failures"]:
        click.echo(f"attempt {f['attempt']} failed on {f['ranks']} ranks (exit {f['exit']}): "
                   f"{f['cause']}", err=True)
    if result["stopped"] and result["returncode"]:
        click.echo(f"lowcomm: stopped by {result['stopped']}; not restarted (continue with "
                   f"--resume {out})", err=True)
    elif result["repeats"]:
        click.echo("lowcomm: not restarted: a relaunch would fail the same way", err=True)
    if result["returncode"]:
        raise SystemExit(result["returncode"] if result["returncode"] > 0 else 1)
    s = json.loads((out / "summary.json").read_text())
    click.echo(json.dumps({k: s.get(k) for k in ("method", "ranks", "steps", "eval_loss",
                                                  "state_sha256", "ranks_agree", "restarts",
                                                  "ranks_per_attempt")},
                          indent=2))
    click.echo(f"wrote {out / 'summary.json'}")


def _refuse_before_launch(out: Path, resume, overwrite: bool, checkpoints: Path) -> None:
    """A supervisor's checks before it launches anything (each would fail every attempt the
    same way): the folder holds another run, is locked by a live run or cannot be written; a
    --resume without a checkpoint."""
    from ..run.folder import refusal, usable
    from ..run.supervise import has_checkpoint
    if resume and not has_checkpoint(checkpoints):
        raise click.UsageError(f"--resume {resume}: no checkpoint in {checkpoints} to resume from "
                               "(nothing was changed)")
    why = refusal(out, resume, overwrite) or usable(out)
    if why:
        raise click.UsageError(why)


@cli.group()
def bench():
    """Benchmarks beside vendor MPI, Horovod and torch gloo, in one run."""


def _write_json(path, rows):
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")
        click.echo(f"wrote {path}")


@bench.command("allreduce")
@click.option("--sizes", default="4K,1M,16M", show_default=True, help="Bytes per buffer (K, M, G).")
@click.option("--algorithms", default="mpi,ring,rabenseifner,tree,shm,shm-registered,auto,horovod,gloo,memcpy",
              show_default=True, help="Rows; 'memcpy' is the memory-bandwidth floor: each rank "
              "writes the result from a buffer that holds it (one copy, no communication).")
@click.option("--iters", default=20, show_default=True)
@click.option("--warmup", default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--autotune", "--tune", "tune", is_flag=True,
              help="Measure every candidate of algorithm=auto at --tune-sizes and write the table "
                   "auto reads (then the sizes/algorithms run as usual). Under mpirun write "
                   "--autotune: Open MPI's mpirun takes '--tune FILE' for itself wherever it appears.")
@click.option("--tune-sizes", default="4K,16K,64K,256K,1M,4M,16M,64M", show_default=True,
              help="The sizes --tune measures.")
@click.option("--table", "table", type=click.Path(dir_okay=False), default=None,
              help="The auto table to write (--tune) and read [default: $LOWCOMM_ALLREDUCE_TABLE, "
                   "else ~/.cache/lowcomm/allreduce-<host>-<ranks>.json].")
@pass_options()
def bench_allreduce(opts):
    """All-reduce time, algbw and busbw per size and algorithm (nccl-tests style); the auto row
    says which algorithm it ran and its time against the fastest other row's."""
    import os

    from ..tools.bench import bench_allreduce as run, format_allreduce, parse_size, tune_allreduce
    from ..comm.tuning import TABLE_ENV
    try:
        size_list = [parse_size(s) for s in opts.sizes.split(",")]
        tune_list = [parse_size(s) for s in opts.tune_sizes.split(",")]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sizes/--tune-sizes") from None
    if opts.table:
        os.environ[TABLE_ENV] = opts.table       # every rank parses the same command line
    comm = _world()
    if opts.tune:
        tuned, where = tune_allreduce(comm, tune_list, max(3, opts.iters // 2), opts.warmup)
        if comm.rank == 0:
            click.echo(f"tuned on {comm.size} ranks, median of {max(3, opts.iters // 2)}; wrote {where}")
            click.echo(format_allreduce(tuned))
    rows = run(comm, size_list, opts.algorithms.split(","), opts.iters, opts.warmup)
    if comm.rank == 0:
        click.echo(f"all-reduce, float32, {comm.size} ranks, median of {opts.iters} iterations")
        click.echo(format_allreduce(rows))
        _write_json(opts.json_path, rows)


@bench.command("step")
@config_options
@click.option("--strategies", default="syncdp,ddp-gloo,syncdp-fp16,ddp-gloo-fp16,syncdp-int8,"
              "syncdp-powersgd,ddp-gloo-powersgd,horovod,local", show_default=True,
              help="Rows, in order; 'local' sends nothing: the compute floor under all of them.")
@click.option("--steps", default=20, show_default=True)
@click.option("--warmup", default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
def bench_step(config, overrides, strategies, steps, warmup, json_path):
    """Median training-step time under lowcomm SyncDP, Horovod and torch DDP (gloo), beside
    a step with no communication at all (``local``, the floor)."""
    cfg = _config(config, overrides)
    from ..tools.bench import bench_step as run, format_step
    comm = _world()
    rows = run(comm, cfg, strategies.split(","), steps, warmup)
    if comm.rank == 0:
        click.echo(f"training step of {cfg.model.name} (batch {cfg.batch_size}x{cfg.data.seq_len} "
                   f"per rank), {comm.size} ranks, median of {steps} steps")
        click.echo(format_step(rows))
        _write_json(json_path, rows)


@bench.command("memory")
@config_options
@click.option("--method", "methods", multiple=True, show_default=True,
              default=("syncdp", "zero1", "zero2", "fsdp", "dc=diloco:period=50;rank=zero2@dc:2,rank:K/2"),
              help="A row (repeat the option): a spec, or LEVEL=SPEC;...@TOPOLOGY for an outer "
              "loop over a sharded level (K/2 in a topology: half the rank count).")
@click.option("--ranks", default="1,2,4,8", show_default=True, help="Rank counts K, each its own mpirun.")
@click.option("--max-memory-gib", type=float, default=0.0, help="With --shapes: the per-rank cap.")
@click.option("--shapes", default="", help="D_MODEL:N_LAYERS,... smallest first: find the largest "
              "that trains one step under --max-memory-gib, per method, at the largest K.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the model and batches live (cuda: a GPU per rank, rank modulo the "
              "node's GPUs; the peak is then torch.cuda.max_memory_allocated).")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--one", hidden=True, default="", help="(a worker: this method in this mpirun)")
@pass_options()
def bench_memory(opts):
    """Parameter, gradient and optimizer-state bytes per rank and the peak memory of each method
    at K ranks, beside the ideal 1/K; with --shapes, the largest GPT each trains under a cap."""
    from ..tools import memory_bench as mb
    if opts.one:
        comm = _world()
        row = mb.measure_one(comm, _config(opts.config, opts.overrides), opts.one, opts.device)
        if comm.rank == 0:
            click.echo("ROW " + json.dumps(row))
        return
    _config(opts.config, opts.overrides)                     # bad keys fail here, before any launch
    Ks = [int(k) for k in opts.ranks.split(",")]
    rows_of = lambda K: [m.replace("K/2", str(max(1, K // 2))) for m in opts.methods  # noqa: E731
                         if "@" not in m or K >= 2 and K % 2 == 0]
    launch = mb.Rows(opts.config, tuple(opts.overrides), opts.timeout_s, opts.device)
    rows = mb.table(launch, rows_of, Ks)
    click.echo("memory per rank (the largest rank's) after one step; ideal: the first row's total / K")
    click.echo(mb.format_table(rows))
    out = {"table": rows}
    if opts.shapes:
        big = mb.largest(launch, rows_of(max(Ks)), max(Ks), opts.shapes.split(","),
                         opts.max_memory_gib)
        click.echo(mb.format_largest(big))
        out["largest"] = big
    _write_json(opts.json_path, out)


@bench.command("compress")
@config_options
@click.option("--size", default="16M", show_default=True, help="Gradient bytes (float32; K, M, G).")
@click.option("--methods", default="pack,fp16,bf16,int8,qsgd,topk,randomk,sign,sign-mv,ef-sign,powersgd",
              show_default=True, help="Compressor names; 'pack' times the bit packing alone.")
@click.option("--iters", default=10, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads (one: a rank's share of a node).")
@click.option("--link-gbit", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Link of the break-even column (Gbit/s).")
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="wall: perf_counter; cpu: the thread's CPU time (steadier on a busy machine).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@pass_options()
def bench_compress(opts):
    """Compress / decompress GB/s of each compressor beside a memcpy of the same bytes (one
    process; the [compressor] keys of --config/--set give ratio, levels, approx_rank, ...), and
    its break-even: compress + decompress time against the time the bytes it saves take on a
    --link-gbit link."""
    import torch

    from ..tools.bench import bench_compress as run, format_compress, parse_size
    cfg = _config(opts.config, opts.overrides)
    try:
        numel = parse_size(opts.size) // 4
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--size") from None
    if numel < 1:
        raise click.BadParameter(f"{opts.size!r} holds no float32 element", param_hint="--size")
    torch.set_num_threads(opts.threads)
    try:
        rows = run(opts.methods.split(","), numel, opts.iters, opts.warmup, cfg.compressor, opts.link_gbit, opts.clock)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--methods") from None
    click.echo(f"compress/decompress of a {numel * 4 / 2**20:.1f} MiB float32 gradient, "
               f"{torch.get_num_threads()} thread(s), median of {opts.iters} ({opts.clock} clock, a memcpy timed "
               f"before each call); GB/s of gradient bytes")
    click.echo(format_compress(rows))
    _write_json(opts.json_path, rows)


@cli.command("methods")
@config_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per method instead of a table.")
def methods_command(config, overrides, as_json):
    """Every registered method: its spec name, Python name, the inner optimizer it needs, a
    small example spec, its name in 'lowcomm compare' and what it does. Methods a task
    registers are listed too (--set task=my_task.py)."""
    _config(config, overrides)              # loads the task: its registrations count
    from ..run.registry import catalogue
    rows = catalogue()
    if as_json:
        click.echo("\n".join(json.dumps(r) for r in rows))
        return
    cols = ("name", "python", "optimizer", "example", "compare")
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    click.echo("  ".join(c.ljust(width[c]) for c in cols) + "  summary")
    for r in rows:
        click.echo("  ".join((r[c] or "-").ljust(width[c]) for c in cols) + "  " + r["summary"])


@cli.command()
@config_options
@click.option("--np", type=click.IntRange(min=1), default=None,
              help="Ranks per run [default: compare.np of the config, 4].")
@click.option("--methods", default=None,
              help="Comma list of methods, 'main' or 'all' (every registered method under its "
                   "compare name (see 'lowcomm methods'), every compressor, and the variants of "
                   "lowcomm.tools.compare.VARIANTS) "
                   "[default: compare.methods of the config, 'main'].")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Steps per method [default: the config's steps, 300].")
@click.option("--out", type=click.Path(file_okay=False), default="runs/compare", show_default=True)
@click.option("--wan", default="model", show_default=True, metavar="model|DELAY_MS,RATE_MBIT",
              help="'model': run on this machine and model the wall-clock on --link; "
                   "DELAY_MS,RATE_MBIT: run every method over an emulated WAN of --dcs "
                   "datacenters with that link (root; launchers/wan.sh), measured wall-clock.")
@click.option("--dcs", type=click.IntRange(min=2), default=2, show_default=True,
              help="Datacenters of the emulated WAN (--wan DELAY_MS,RATE_MBIT).")
@click.option("--link", default=None, metavar="DELAY_MS,RATE_MBIT",
              help="Link of the modelled wall-clock (α–β model) [default: compare.link, 25,100].")
@click.option("--launcher", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Launcher script taking '-n N COMMAND...' (default: mpirun with local flags).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=3600, show_default=True,
              help="Seconds per method.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Relaunch a failed method from its newest checkpoint up to N times "
                   "(set checkpoint.every for a resume; without one it restarts from step 0).")
@click.option("--overwrite", is_flag=True,
              help="Run again methods that --out holds results of (the others are kept), or "
                   "replace a comparison with other settings; without it both are refused.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="Train every method for this many modelled seconds on the "
              "link (--steps is then a cap) and rank them by eval loss at equal time.")
@click.option("--target", type=float, default=None, metavar="EVAL_LOSS",
              help="Eval loss of the time-to-target column [default: ddp's final one].")
@click.option("--repeat", type=click.IntRange(min=1), default=None, metavar="N",
              help="Run the methods N times, interleaved (each once, then each again, ...); "
                   "wall s is the median of a method's runs [default: compare.repeat, 1].")
@click.option("--relative-to", default=None, metavar="METHOD",
              help="Divide every run's wall-clock by METHOD's of the same round; the table "
                   "gives the median ratio and its range [default: compare.relative_to].")
@click.option("--tune", "tune", multiple=True, metavar="KEY=V1,V2,...",
              help="Sweep KEY (any config key, as --set takes it: lr, strategy.outer_lr, ...) "
                   "over these values for --tune-steps steps per method, and compare each method "
                   "at its best value (lowest final eval loss; a diverged value never wins). "
                   "Repeat for a grid over several keys. The table states the sweep's cost.")
@click.option("--tune-steps", type=click.IntRange(min=1), default=None, metavar="N",
              help="Steps of each --tune run [default: a tenth of --steps, at least 1].")
@pass_options()
def compare(given):
    """Train the same model under each method (one mpirun each); write results.json, plots and
    a ranked table. An experiment TOML (--config) may hold a [compare] table: question, expect,
    methods, np, link, repeat, relative_to. Into an --out with an earlier comparison of the
    same settings, new methods are added beside its results. Ctrl-C ends the comparison,
    keeping what finished."""
    from ..errors import RunFolderError
    opts = _compare_options(given)
    try:
        results, where = _compare_run(opts, given.wan)
    except RunFolderError as e:
        raise click.UsageError(str(e)) from None
    span = f"{opts.budget:g} modelled s (at most {opts.steps} steps)" if opts.budget else \
        f"{opts.steps} steps"
    rounds = f", {opts.repeat} rounds" if opts.repeat > 1 else ""
    click.echo(f"\n{opts.np} ranks, {span} per method{rounds}, {where}\n")
    click.echo((opts.out / "table.md").read_text().rstrip())
    if opts.tune:
        from ..tools.tune import totals
        t = totals(results)["total"]
        click.echo(f"\ntuning spent {t['runs']} runs, {t['steps']} steps, {t['compute_cpu_s']:.1f} "
                   f"compute CPU s, {t['wall_s']:.1f} wall s ({opts.tune_steps} steps a value)")
    click.echo(f"\nwrote {opts.out / 'results.json'}, table.md{', tuning.json' if opts.tune else ''} "
               "and eval_loss_vs_*.png")
    _compare_end(results, opts.methods)


def _compare_options(given):
    """``compare``'s options (:class:`lowcomm.tools.compare.CompareOptions`) from the arguments
    click ``given`` it and the config's [compare] table, every one checked before anything runs:
    a bad one is a usage error naming its option."""
    from ..tools.compare import CompareOptions, budget_overrides
    target, methods, budget = given.target, given.methods, given.budget
    if target is not None and not math.isfinite(target):
        raise click.BadParameter(f"must be a finite eval loss, got {target}", param_hint="--target")
    if methods is not None and not methods.strip(" ,"):
        raise click.BadParameter("names no method; give a comma-separated list (e.g. "
                                 "syncdp,diloco) or leave --methods out", param_hint="--methods")
    overrides = (*given.overrides, *([f"steps={given.steps}"] if given.steps is not None else []))
    link = _compare_link(given, overrides)
    # a bad key (or a schedule a budget cannot keep) fails here, not in every run
    cfg = _config(given.config, (*overrides, *(budget_overrides(budget, link) if budget else ())))
    np_ = given.np or cfg.compare.np
    names = _compare_plan(cfg, given, np_)
    relative_to = given.relative_to or cfg.compare.relative_to
    if relative_to and relative_to not in names:
        raise click.BadParameter(f"{relative_to!r} is not one of the methods run "
                                 f"({', '.join(names)})", param_hint="--relative-to")
    space, tune_steps = _compare_tune(given, names, overrides, cfg.steps)
    if cfg.compare.question:
        click.echo(f"question: {cfg.compare.question}\nexpected: {cfg.compare.expect}")
    if not cfg.eval_every and not budget:   # about ten points per eval-loss curve (a budget
        # evaluates at every tenth of it: budget.evals)
        overrides = (*overrides, f"eval_every={max(1, round(cfg.steps / 10 / cfg.log_every)) * cfg.log_every}")
    return CompareOptions(
        tuple(names), np_, cfg.steps, Path(given.out), given.config, overrides, link,
        given.launcher, given.timeout, dcs=given.dcs, max_restarts=given.max_restarts,
        overwrite=given.overwrite, budget=budget or 0.0, target=target,
        repeat=given.repeat or cfg.compare.repeat, relative_to=relative_to or None,
        tune=space, tune_steps=tune_steps)


def _compare_tune(given, names, overrides, steps: int):
    """``--tune``'s grid, every value checked on every method it applies to before anything
    runs: ``(space or None, sweep steps)``; a bad spec or value a usage error naming --tune."""
    from ..run.api import load_config
    from ..tools import tune as tuning
    from ..tools.compare import methods_overrides
    if not given.tune:
        if given.tune_steps is not None:
            raise click.BadParameter("needs --tune KEY=V1,V2,...", param_hint="--tune-steps")
        return None, 0
    try:
        space = tuning.parse(given.tune)
        tuning.plan(lambda o: load_config(given.config, o),
                    {m: methods_overrides(m) for m in names}, space, list(overrides))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tune") from None
    return space, given.tune_steps or max(1, steps // 10)


def _compare_link(given, overrides):
    """The link of ``compare``'s modelled (or emulated) wall-clock, a bad one a usage error."""
    from ..tools.compare import Link
    wan = given.wan
    try:
        return Link.parse(wan if wan != "model" else
                          given.link or _config(given.config, overrides).compare.link)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--wan/--link") from None


def _compare_plan(cfg, given, np_: int):
    """``compare``'s methods, every option checked before anything runs."""
    import os

    from ..tools.compare import needs_topology, resolve_methods
    dcs = given.dcs
    try:
        names = resolve_methods(given.methods or cfg.compare.methods)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--methods") from None
    placed = [m for m in names if needs_topology(m)]
    if placed and np_ < dcs and not os.environ.get("LOWCOMM_TOPOLOGY"):
        raise click.BadParameter(f"{', '.join(placed)} run on {dcs} datacenters (--dcs) of ranks: "
                                 f"give --np >= {dcs}, or $LOWCOMM_TOPOLOGY", param_hint="--np")
    if cfg.checkpoint.dir:
        raise click.BadParameter("checkpoint.dir: each method keeps its checkpoints in its own "
                                 f"folder ({given.out}/<method>/checkpoints); drop it",
                                 param_hint="--set/--config")
    if given.wan != "model" and given.launcher:
        raise click.BadParameter("--wan DELAY_MS,RATE_MBIT launches through launchers/wan.sh; "
                                 "drop --launcher (or use --wan model)", param_hint="--launcher")
    return names


def _compare_run(opts, wan: str):
    """Every method's run, on this machine or over an emulated WAN (``wan``: ``"model"`` or
    its link): (results, where)."""
    import dataclasses

    from ..tools.compare import compare as run
    if wan != "model":
        from ..tools.compare import over_emulated_wan
        with over_emulated_wan(opts.np, opts.dcs, opts.link) as wan_launcher:
            results = run(dataclasses.replace(opts, launcher=tuple(wan_launcher)))
        return results, f"over an emulated WAN of {opts.dcs} datacenters, {opts.link} (measured)"
    return run(opts), f"on this machine; modelled link: {opts.link}"


def _compare_end(results, names) -> None:
    """Exit 130 when the comparison was stopped (saying what finished), 1 when a method failed."""
    stopped = [r["method"] for r in results if r["method"] in names and
               (r["status"] == "interrupted" or "interrupted_round" in r)]
    not_run = [m for m in names if m not in {r["method"] for r in results}]
    if stopped or not_run:
        click.echo(f"stopped{' during ' + stopped[0] if stopped else ''}: the comparison ended; the "
                   f"finished methods' results are kept{'; not run: ' + ', '.join(not_run) if not_run else ''}",
                   err=True)
        raise SystemExit(130)
    if any(r["status"] != "ok" for r in results):
        raise SystemExit(1)


@cli.command()
@click.argument("folder", type=click.Path(exists=True))
@click.option("--ranks", default=",".join(map(str, (8, 64, 512, 4096))), show_default=True,
              help="Comma list of rank counts to project to.")
@click.option("--link", "links", multiple=True, metavar="DELAY_MS,RATE_MBIT",
              help="A link to project over (repeat for several) [default: 25,100 and 1,10000].")
@click.option("--params", type=click.FloatRange(min=1), default=None,
              help="Project a model of this many parameters (messages and computation scale "
                   "with params / the run's).")
@click.option("--step-compute-s", type=click.FloatRange(min=0), default=None,
              help="Computation seconds per step to assume (e.g. a GPU's) instead of the run's.")
@click.option("--target", type=float, default=None, metavar="EVAL_LOSS",
              help="Rank the methods by modelled time to this eval loss at each K and link "
                   "(the steps each needed to reach it in the measured run × its projected "
                   "seconds per step).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the projections as JSON, with what they were projected from "
                   "(which `lowcomm project FILE` reads again).")
def project(folder, ranks, links, params, step_compute_s, target, json_path):
    """Project a measured run (or every method of a comparison) to thousands of ranks: each
    method's modelled seconds per step and bytes per rank per step at each K over each link,
    from its ledger's ops re-costed by their algorithms' α–β formulas; with --target, the
    methods ranked by modelled time to that eval loss. FOLDER: a comparison's or a run's
    folder, or a JSON file an earlier projection wrote."""
    from ..comm.ledger import Link
    from ..tools.project import projections, ranking, summaries, table
    try:
        ks = [int(k) for k in ranks.split(",")]
        if any(k < 2 for k in ks):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"a comma list of rank counts >= 2, got {ranks!r}",
                                 param_hint="--ranks") from None
    try:
        the_links = [Link.parse(x) for x in links] or [Link(25, 100), Link(1, 10_000)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--link") from None
    try:
        done, skipped = projections(folder, ks, the_links, params, step_compute_s, target)
        measured = summaries(folder) if json_path else None
    except FileNotFoundError as e:
        raise click.BadParameter(str(e), param_hint="FOLDER") from None
    if target is None:
        click.echo(table(done, skipped, ks, the_links))
    else:
        click.echo(ranking(done, ks, the_links, target) + "".join(
            f"\n\nnot projected: {m} ({why})" for m, why in skipped.items()))
    _write_json(json_path, {"kind": "projection", "projections": done, "not_projected": skipped,
                            "measured": measured})


@cli.command()
def info():
    """Versions and locations, MPI library and thread level, Horovod build."""
    import os
    from importlib.metadata import version as installed

    import torch

    import lowcomm
    comm = _world()
    from ..comm.comm import mpi_library
    version, level, multiple = mpi_library()
    lines = [f"lowcomm {lowcomm.__version__} ({os.path.dirname(lowcomm.__file__)}), ranks: "
             f"{comm.size}", f"torch {torch.__version__} ({os.path.dirname(torch.__file__)})",
             f"mpi4py {installed('mpi4py')}",
             f"MPI: {version.splitlines()[0]}", f"thread level: {level} (multiple = {multiple})"]
    try:
        import horovod
        import horovod.torch as hvd
        lines.append(f"horovod {horovod.__version__}: mpi={hvd.mpi_built()} gloo={hvd.gloo_built()}")
    except ImportError:
        lines.append("horovod: not installed")
    if comm.rank == 0:
        click.echo("\n".join(lines))


cli.add_command(wan_command)
cli.add_command(fault_command)
cli.add_command(topo_command)
cli.add_command(plan_command)


def _abort(code: int) -> None:
    """End every rank if MPI is running with more than one rank; otherwise just exit."""
    from ..comm.comm import abort_world   # late: the CLI starts without torch or MPI
    abort_world(code)
    sys.exit(code)


def main() -> None:
    _report_to(_option_value(sys.argv, "--report-dir"))
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        if e.exit_code:
            _abort(e.exit_code)
    except LowcommError as e:
        if getattr(e, "exit_code", None):   # every rank stopped together (a signal): no abort
            if launcher_rank() == 0:
                sys.stderr.write(f"lowcomm: {e}\n")
            if getattr(e, "signum", None):              # stopped on request
                if _REPORTING[0]:
                    from ..run import outcome
                    outcome.stopped(e.signum)
            else:
                _report(f"{type(e).__name__}: {e}", False)
            sys.exit(e.exit_code)
        _fail(e)
    except (click.ClickException, click.Abort) as e:
        if launcher_rank() == 0:
            if isinstance(e, click.ClickException):
                e.show()
            else:
                click.echo("Aborted!", err=True)
        if isinstance(e, click.ClickException):       # bad input: a relaunch gets it again
            _report(f"{type(e).__name__}: {e.format_message()}", True)
        _abort(getattr(e, "exit_code", 1))
    except SystemExit as e:                 # a command's own exit status (compare, supervisor)
        if e.code:
            _abort(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - any failure must end all ranks
        _fail(e)


def _option_value(argv: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` or ``name=VALUE`` in ``argv`` (read before click parses it,
    so that an error in parsing is reported too)."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


_REPORTING = [False]


def _report_to(folder: str | None) -> None:
    """``--report-dir``: each rank reports how it ends there (:mod:`lowcomm.run.outcome`)."""
    if folder:
        from ..run import outcome
        outcome.report_to(folder, launcher_rank())
    _REPORTING[0] = bool(folder)


def _report(message: str, repeats: bool) -> None:
    if _REPORTING[0]:
        from ..run import outcome
        outcome.error(message, repeats)


def _fail(e: BaseException) -> None:
    """One line per failing rank; the traceback goes to the run's folder (or, with
    ``LOWCOMM_DEBUG=1``, to stderr too)."""
    rank = launcher_rank()
    where = ""
    trace = traceback.format_exc()
    if debug():
        sys.stderr.write(trace)
    elif not isinstance(e, LowcommError) or e.__cause__ is not None:   # the user's code raised
        if _RUN_OUT is not None:
            try:
                _RUN_OUT.mkdir(parents=True, exist_ok=True)
                path = _RUN_OUT / f"rank{rank}.traceback.log"
                path.write_text(trace)
                where = f" (traceback: {path})"
            except OSError:
                where = " (LOWCOMM_DEBUG=1 prints the traceback)"
        else:
            where = " (LOWCOMM_DEBUG=1 prints the traceback)"
    first = str(e).splitlines()[0] if str(e) else ""
    sys.stderr.write(f"[rank {rank}] lowcomm failed: {type(e).__name__}: {first}{where}\n")
    if _REPORTING[0]:
        from ..run.outcome import repeats
        _report(f"{type(e).__name__}: {first}", repeats(e))
    _abort(1)


if __name__ == "__main__":
    main()
