"""``lowcomm train --dcs D --np N ...``: a fleet of datacenters (:mod:`lowcomm.run.fleet`),
run from outside mpirun: on the emulated WAN when one of D datacenters is up, on the machines
of ``--hostfiles`` (one per datacenter), else on this machine."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import click

from ..errors import LowcommError
from .common import load_cfg


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


def _placement(dcs: int, hostfiles: str | None, host: str | None, launcher, place: str):
    from ..tools import fleet_launch, wan
    if hostfiles:
        files = hostfiles.split(",")
        if len(files) != dcs:
            raise click.BadParameter(f"{len(files)} hostfiles for --dcs {dcs}",
                                     param_hint="--hostfiles")
        return fleet_launch.hostfiles(files, host)
    if place == "wan" or (place == "auto" and os.geteuid() == 0 and
                          (wan.state() or {}).get("dcs") == dcs):
        return fleet_launch.emulated_wan(dcs)
    return fleet_launch.local(launcher)


def _refuse(out: Path, overwrite: bool) -> None:
    """An earlier fleet's files in ``out`` are replaced only with --overwrite."""
    earlier = [p for p in ("summary.json", "membership.jsonl") if (out / p).exists()]
    if earlier and not overwrite:
        raise click.UsageError(f"{out} holds another fleet's run ({', '.join(earlier)}); replace "
                               "it with --overwrite or choose another --out")
    if earlier:
        for p in [*out.glob("dc[0-9]*"), out / "summary.json", out / "membership.jsonl",
                  out / "metrics.jsonl", out / "coordinator.log"]:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)


def refuse_outside(cfg) -> None:
    """``fleet.dcs`` in a job that no fleet started: a usage error before MPI starts."""
    from ..run.member import identity
    if cfg.fleet.dcs and identity() is None:
        raise click.UsageError(f"config key 'fleet.dcs': a fleet is launched from outside mpirun "
                               f"by 'lowcomm train --dcs {cfg.fleet.dcs} --np N', which starts "
                               "one job per datacenter")


def run_fleet(config, overrides, out, np_, dcs, hostfiles, host, launcher, max_restarts,
              quiet, overwrite, checkpoint_every, place="auto") -> None:
    """Launch and watch the fleet; print its summary's head."""
    from ..run.fleet import Fleet
    from ..run.member import as_policy
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        raise click.UsageError("--dcs launches one MPI job per datacenter itself: run 'lowcomm "
                               "train --dcs D --np N ...' outside mpirun")
    if np_ is None:
        raise click.UsageError("--dcs needs --np (the ranks of all datacenters together)")
    overrides = (*overrides, f"fleet.dcs={dcs}",
                 *([f"checkpoint.every={checkpoint_every}"] if checkpoint_every else []))
    cfg = load_cfg(config, overrides)
    try:
        as_policy(cfg, dcs, np_)
    except Exception as e:  # noqa: BLE001 - a ConfigError naming the key
        raise click.UsageError(str(e)) from None
    out = Path(out or "runs/latest")
    _refuse(out, overwrite)
    args = [*(["--config", config] if config else []), *[a for o in overrides for a in ("--set", o)]]
    try:
        launch, coordinator, where, env = _placement(dcs, hostfiles, host, launcher, place)
    except (OSError, LowcommError) as e:
        raise click.UsageError(str(e)) from None
    summary = Fleet(cfg, args, out, np_, launch, coordinator, where, env,
                    max_restarts=1 if max_restarts is None else max_restarts).run()
    keys = ("method", "ranks", "dcs", "steps", "eval_loss", "state_sha256", "dcs_agree",
            "finished_dcs")
    click.echo(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    f = summary["fleet"]
    click.echo(f"{len(f['membership'])} rounds, {len(f['failures'])} failure(s), "
               f"{len(f['heals'])} heal(s); wrote {out / 'summary.json'}")
    if len(summary["finished_dcs"]) < (cfg.fleet.min_dcs or dcs // 2 + 1):
        sys.exit(1)


__all__ = ["fleet_options", "refuse_outside", "run_fleet"]
