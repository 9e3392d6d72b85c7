"""``lowcomm`` command line (one rank per process under mpirun).

An uncaught exception on any rank aborts the whole MPI job (``MPI_Abort``) after printing the
rank and the error, so a failure on one rank never leaves the others waiting in a collective.
Configuration is read and validated before MPI starts, so a bad key fails every rank at once.
"""
from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

import click

from .common import TrainOptions, check_env, config_options, debug, launcher_rank, \
    load_cfg as _config, pass_options, saved_config, world as _world, write_json
from ..errors import LowcommError
from .fleet import fleet_command, fleet_options, refuse_outside, run_fleet
from .bench import bench as bench_command
from .compare import compare as compare_command
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
    write_json(json_path, {"kind": "projection", "projections": done, "not_projected": skipped,
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


cli.add_command(bench_command)
cli.add_command(compare_command)
cli.add_command(wan_command)
cli.add_command(fault_command)
cli.add_command(topo_command)
cli.add_command(plan_command)
cli.add_command(fleet_command)


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
