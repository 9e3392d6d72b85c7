"""``lowcomm train --dcs D --np N ...``: a fleet of datacenters (:mod:`lowcomm.run.fleet`),
run from outside mpirun: on the emulated WAN when one of D datacenters is up, on the machines
of ``--hostfiles`` (one per datacenter), else on this machine."""
from __future__ import annotations

import json
import sys

import click

from ..errors import LowcommError


def fleet_options(f):
    """``--dcs``, ``--hostfiles``, ``--coordinator-host`` on ``lowcomm train``."""
    for opt in reversed([
        click.option("--dcs", type=click.IntRange(min=2), default=None, metavar="D",
                     help="Run as a fleet of D datacenters (with --np, outside mpirun): one MPI "
                          "job per datacenter, the outer method across them through a "
                          "coordinator; a failed datacenter is relaunched and heals back in "
                          "live. On the emulated WAN when one of D datacenters is up."),
        click.option("--hostfiles", default=None, metavar="FILE,...",
                     help="With --dcs: one mpirun hostfile per datacenter (real machines)."),
        click.option("--place", type=click.Choice(["auto", "local", "wan"]), default="auto",
                     show_default=True,
                     help="With --dcs: where the datacenters run: 'wan', the emulated WAN's "
                          "namespaces; 'local', this machine; 'auto', the WAN when one of D "
                          "datacenters is up (root), else this machine."),
        click.option("--coordinator-host", default=None, metavar="ADDR",
                     help="With --hostfiles: the address of this machine that every "
                          "datacenter reaches [default: its hostname's]."),
    ]):
        f = opt(f)
    return f


def refuse_outside(cfg) -> None:
    """``fleet.dcs`` in a job that no fleet started: a usage error before MPI starts."""
    from ..run.fleet.plan import identity
    if cfg.fleet.dcs and identity() is None:
        raise click.UsageError(f"config key 'fleet.dcs': a fleet is launched from outside mpirun "
                               f"by 'lowcomm train --dcs {cfg.fleet.dcs} --np N', which starts "
                               "one job per datacenter")


def run_fleet(opts) -> None:
    """Launch and watch the fleet of ``lowcomm train``'s options ``opts`` (a
    :class:`~lowcomm.cli.common.TrainOptions`; :func:`lowcomm.tools.fleet_launch.train_fleet`);
    print its summary's head. What cannot run is a usage error before anything starts; a fleet
    stopped by a signal says how to continue and exits with 128 + the signal."""
    from ..tools.fleet_launch import FleetLaunch, prepare
    if opts.np is None and opts.resume is None:
        raise click.UsageError("--dcs needs --np (the ranks of all datacenters together)")
    every = opts.checkpoint_every
    try:
        fleet = prepare(FleetLaunch(
            opts.dcs, opts.np, opts.config,
            (*opts.overrides, *([f"checkpoint.every={every}"] if every else [])), opts.out,
            opts.place, tuple(opts.hostfiles.split(",")) if opts.hostfiles else None,
            opts.coordinator_host, opts.launcher, opts.overwrite,
            1 if opts.max_restarts is None else opts.max_restarts, opts.resume))
    except (OSError, LowcommError) as e:
        raise click.UsageError(str(e)) from None
    summary = fleet.run()
    keys = ("method", "ranks", "dcs", "steps", "eval_loss", "state_sha256", "dcs_agree",
            "finished_dcs")
    click.echo(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    f = summary["fleet"]
    done = f"{sum(f['arrivals'].values())} arrivals" if "arrivals" in f else \
        f"{len(f['membership'])} rounds"
    click.echo(f"{done}, {len(f['failures'])} failure(s), "
               f"{len(f['heals'])} heal(s); wrote {fleet.out / 'summary.json'}")
    stop = summary.get("stopped")
    if stop and len(summary["finished_dcs"]) < fleet.min_dcs:
        if stop["step"] is None:
            click.echo(f"lowcomm: stopped by {stop['signal']} before a checkpoint that "
                       f"{fleet.min_dcs} datacenters hold; nothing to resume from", err=True)
        else:
            click.echo(f"lowcomm: stopped by {stop['signal']}; every datacenter wrote its "
                       f"checkpoint of step {stop['step']}; continue with: {stop['resume']}",
                       err=True)
        sys.exit(128 + stop["signum"])
    if len(summary["finished_dcs"]) < fleet.min_dcs:
        sys.exit(1)


__all__ = ["fleet_options", "refuse_outside", "run_fleet"]


@click.group("fleet")
def fleet_command():
    """A fleet's credentials (lowcomm train --dcs D)."""


@fleet_command.command("key")
@click.argument("file", type=click.Path(dir_okay=False))
def fleet_key(file):
    """Write a new secret for a fleet into FILE (readable by you only; never replaces a file):
    copy it to every machine of the fleet and run with --set fleet.secret_file=FILE (or
    $LOWCOMM_FLEET_SECRET_FILE). A fleet on this machine makes its own."""
    from ..run.fleet.trust import write_secret
    try:
        click.echo(f"wrote {write_secret(file)} (mode 600)")
    except FileExistsError:
        raise click.BadParameter(f"{file} exists: a secret is never replaced; choose another "
                                 "file or remove it", param_hint="FILE") from None
