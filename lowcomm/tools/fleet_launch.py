"""Where a fleet's jobs run (:mod:`lowcomm.run.fleet`): how each datacenter's MPI job and the
coordinator are launched, and how the leaders reach the coordinator and each other.

* :func:`local`: every datacenter's job on this machine (mpirun with this machine's flags), the
  coordinator on loopback; gloo over ``lo``. For tests and trying things out.
* :func:`emulated_wan`: on the emulated WAN that is up (``lowcomm wan up --dcs D``,
  :mod:`lowcomm.tools.wan`): datacenter i's job inside namespace ``lowcomm-dc<i>`` (its own
  hostname, shared memory inside), gloo on its WAN device ``lcwan<i>``, the coordinator in
  datacenter 0's namespace at ``10.77.0.1`` — so a link taken down with ``lowcomm wan fault``
  cuts a datacenter off from the coordinator and the others, as on real links.
* :func:`hostfiles`: real machines: datacenter i's job is ``mpirun --hostfile FILE_i`` (with
  the fleet's variables passed on with ``-x``), the coordinator on this machine at ``host``
  (an address every datacenter reaches); ``GLOO_SOCKET_IFNAME`` is passed on when set.

Each returns a :class:`~lowcomm.run.fleet.supervisor.Placement` for
:class:`~lowcomm.run.fleet.supervisor.Fleet`.
Every mpirun gets ``--mca odls_base_sigkill_timeout 0``: when one of its ranks is killed, Open
MPI otherwise waits a second per signal to the others and exits about 2 s later (measured
here); a fleet's job is torn down at once, so the coordinator hears of the failure in
milliseconds.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArgumentError, LowcommError
from ..run.fleet.plan import ENV
from ..run.fleet.supervisor import Placement
from .compare import mpirun_command

#: tear a job down at once when one of its ranks dies (module docstring)
TEAR_DOWN = ["--mca", "odls_base_sigkill_timeout", "0"]


def local(launcher=None):
    """Every datacenter on this machine (module docstring)."""
    return Placement(lambda dc, n: mpirun_command(n, launcher) + ([] if launcher else TEAR_DOWN),
                     (), "127.0.0.1", lambda dc: {"GLOO_SOCKET_IFNAME": "lo"})


def emulated_wan(dcs: int):
    """The datacenters in the namespaces of the emulated WAN that is up (module docstring)."""
    from .wan import DEV_PREFIX, WanError, address, namespace, state
    s = state()
    if s is None or s["dcs"] != dcs:
        raise WanError(f"a fleet of {dcs} datacenters on the emulated WAN needs 'lowcomm wan up "
                       f"--dcs {dcs}' first" + (f" (the WAN that is up has {s['dcs']})" if s else ""))

    def launch(dc: int, n: int) -> list[str]:
        ns = namespace(dc)
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "/bin/sh", "-c",
                f'hostname {ns}; exec "$@"', "sh", *mpirun_command(n, None), *TEAR_DOWN,
                "--mca", "btl", "self,vader"]

    return Placement(launch, ("ip", "netns", "exec", namespace(0)), address(0),
                     lambda dc: {"GLOO_SOCKET_IFNAME": f"{DEV_PREFIX}{dc}"})


def hostfiles(files: list[str], host: str | None = None):
    """Datacenter i on the machines of ``files[i]`` (module docstring)."""
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--hostfiles: {f} is not a file")
    passed = [*ENV, "GLOO_SOCKET_IFNAME"] if os.environ.get("GLOO_SOCKET_IFNAME") else list(ENV)

    def launch(dc: int, n: int) -> list[str]:
        cmd = [*mpirun_command(n, None), *TEAR_DOWN, "--hostfile", files[dc]]
        for name in passed:
            cmd += ["-x", name]
        return cmd

    return Placement(launch, (), host or socket.gethostbyname(socket.gethostname()), remote=True)


def placement(dcs: int, place: str = "auto", hostfiles_: list[str] | None = None,
              host: str | None = None, launcher=None):
    """Where the fleet runs: ``hostfiles_`` (one per datacenter), else ``place``: ``"wan"`` the
    emulated WAN's namespaces, ``"local"`` this machine, ``"auto"`` the WAN when one of
    ``dcs`` datacenters is up (as root), else this machine."""
    from . import wan
    if place not in ("auto", "local", "wan"):
        raise ArgumentError("place", f"unknown value {place!r}; known: auto, local, wan")
    if hostfiles_:
        if len(hostfiles_) != dcs:
            raise ArgumentError("hostfiles", f"{len(hostfiles_)} hostfiles for {dcs} datacenters")
        return hostfiles(hostfiles_, host)
    if place == "wan" or (place == "auto" and os.geteuid() == 0 and
                          (wan.state() or {}).get("dcs") == dcs):
        return emulated_wan(dcs)
    return local(launcher)


@dataclass(frozen=True)
class FleetLaunch:
    """How a fleet is launched (``lowcomm train --dcs D``, :func:`train_fleet`): ``dcs``
    datacenters of ``np`` ranks in all (None with ``resume``: the fleet's own), the run's
    ``config`` and ``overrides``, its folder ``out``; where it runs (:func:`placement`:
    ``place``, ``hostfiles`` one per datacenter, ``coordinator_host``; ``launcher``: a launcher
    for the local mpirun); ``overwrite`` a run in ``out``; each datacenter relaunched up to
    ``max_restarts`` times; ``resume``: the folder of a stopped fleet to continue (its launch
    arguments, then ``overrides``)."""
    dcs: int
    np: int | None = None
    config: str | Path | None = None
    overrides: tuple[str, ...] = ()
    out: str | Path | None = "runs/latest"
    place: str = "auto"
    hostfiles: tuple[str, ...] | None = None
    coordinator_host: str | None = None
    launcher: str | None = None
    overwrite: bool = False
    max_restarts: int = 1
    resume: str | Path | None = None


def prepare(launch: FleetLaunch):
    """A :class:`~lowcomm.run.fleet.supervisor.Fleet` ready to run, everything checked before
    anything starts (a LowcommError names what is wrong: the config key, the argument, the
    folder). The folder is locked for the fleet and checked (:mod:`lowcomm.run.fleet.folder`)."""
    from ..run.api import load_config
    from ..run.fleet.folder import claim, lock_key
    from ..run.fleet.plan import plan
    from ..run.fleet.supervisor import Fleet
    from ..run.folder import close_run
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        raise LowcommError("a fleet launches one MPI job per datacenter itself: run 'lowcomm "
                           "train --dcs D --np N ...' (or lowcomm.train_fleet) outside mpirun")
    out, config, overrides, np = _resumed(launch)
    if np is None:
        raise ArgumentError("np", "--dcs needs --np (the ranks of all datacenters together)")
    overrides = (*overrides, f"fleet.dcs={launch.dcs}")
    cfg = load_config(config, overrides)
    fp = plan(cfg, launch.dcs, np)                  # refuses what a fleet cannot run
    args = [*(["--config", str(config)] if config else []), *[a for o in overrides for a in ("--set", o)]]
    where = placement(launch.dcs, launch.place, launch.hostfiles, launch.coordinator_host,
                      launch.launcher)
    claim(out, launch.overwrite, launch.resume is not None)
    try:
        return Fleet(fp, args, out, where, max_restarts=launch.max_restarts,
                     resume=launch.resume is not None)
    except BaseException:
        close_run(lock_key(out))
        raise


def _resumed(launch: FleetLaunch) -> tuple[Path, str | Path | None, tuple[str, ...], int | None]:
    """The fleet's folder, config, overrides and ranks: ``launch``'s, or with ``resume`` those
    the stopped fleet was launched with (then ``launch.overrides``), checked against it."""
    from ..run.fleet.folder import claim, fleet_of
    resume, out, np = launch.resume, launch.out, launch.np
    if resume is not None and out is not None and Path(out).resolve() != Path(resume).resolve():
        raise ArgumentError("resume", "a fleet resumes in place: give --resume DIR alone")
    out = Path(resume if resume is not None else out or "runs/latest")
    earlier = fleet_of(out) if resume is not None else None
    if resume is not None and earlier is None:
        claim(out, launch.overwrite, resume=True)     # raises: no fleet there (lock released)
    if earlier is None:
        return out, launch.config, tuple(launch.overrides), np
    if earlier["dcs"] != launch.dcs or np is not None and earlier["np"] != np:
        raise ArgumentError("dcs", f"--resume {out}: the fleet there ran {earlier['dcs']} "
                            f"datacenters of {earlier['np']} ranks in all; give --dcs "
                            f"{earlier['dcs']}" + (f" --np {earlier['np']}" if np else ""))
    saved_config, saved = _saved(earlier["args"])
    overrides = (*[o for o in saved if not o.startswith("fleet.dcs=")], *launch.overrides)
    return out, launch.config or saved_config, overrides, earlier["np"]


def _saved(args: list[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` and the ``--set`` values of a fleet's launch arguments."""
    config, sets, it = None, [], iter(args)
    for a in it:
        if a == "--config":
            config = next(it)
        elif a == "--set":
            sets.append(next(it))
    return config, sets


def train_fleet(config=None, overrides=(), **launch) -> dict:
    """Train as a fleet of ``dcs`` datacenters of ``np // dcs`` ranks each, from outside mpirun
    (what ``lowcomm train --dcs D --np N`` runs): one MPI job per datacenter, the outer level
    across them through a coordinator; a datacenter that fails is relaunched and heals back in
    live (:mod:`lowcomm.run.fleet`). ``launch``: the keywords of :class:`FleetLaunch` (``dcs``,
    ``np``, ``out``, ``place``, ``hostfiles``, ``coordinator_host``, ``overwrite``,
    ``max_restarts``, ``resume``). Returns the fleet's summary (also ``out/summary.json``)."""
    if launch.get("hostfiles") is not None:
        launch["hostfiles"] = tuple(launch["hostfiles"])
    return prepare(FleetLaunch(config=config, overrides=tuple(overrides), **launch)).run()


__all__ = ["FleetLaunch", "emulated_wan", "hostfiles", "local", "placement", "prepare", "train_fleet"]
