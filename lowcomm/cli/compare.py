"""``lowcomm compare``: every method on one task, tuned alike, then tables and plots."""
from __future__ import annotations

import math
from pathlib import Path

import click

from .common import config_options, load_cfg as _config, pass_options


@click.command()
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
