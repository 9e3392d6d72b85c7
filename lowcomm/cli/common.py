"""What every ``lowcomm`` command module shares: the launcher's rank before MPI starts, the
``--config``/``--set`` options, config loading as a usage error, and the world communicator.

It imports no command module, so ``cli.py`` (the group) and the command modules it registers
(``wan_cli.py``, ``topo_cli.py``) all depend on it and never on each other.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from dataclasses import dataclass

import click

from ..errors import ConfigError, EnvError


def click_errors(usage, failure=lambda: ()):
    """A command's errors as click's: the exception types ``usage()`` returns become usage
    errors (exit 2, with the command's usage), those of ``failure()`` plain failures (exit 1).
    The types are named by functions so that a command module imports its tools only when run."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except usage() as e:
                raise click.UsageError(str(e)) from None
            except failure() as e:
                raise click.ClickException(str(e)) from None
        run.__name__, run.__doc__ = fn.__name__, fn.__doc__
        return run
    return wrap


def launcher_rank() -> int:
    """This process's rank as the launcher tells it, before MPI is initialised (0 if none)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


#: the environment variables lowcomm reads, each with a check of its value (None: any text)
ENV = {
    "LOWCOMM_NUM_THREADS": ("a whole number >= 1", lambda v: int(v) >= 1),
    "LOWCOMM_TIMEOUT_S": ("seconds >= 0 (0 = no watchdog)", lambda v: 0 <= float(v) < float("inf")),
    "LOWCOMM_WATCHDOG_FACTOR": ("a number >= 0", lambda v: 0 <= float(v) < float("inf")),
    "LOWCOMM_WATCHDOG_OUTAGE_S": ("seconds >= 0", lambda v: 0 <= float(v) < float("inf")),
    "LOWCOMM_DEBUG": ("0 or 1", lambda v: v in ("0", "1")),
    "LOWCOMM_HOSTFILE": ("an existing hostfile", lambda v: os.path.isfile(v)),
    "LOWCOMM_TOPOLOGY": ("a topology spec such as dc:2,rank:2", None),
}


def check_env() -> None:
    """A usage error naming any ``LOWCOMM_*`` variable whose value lowcomm cannot use."""
    for name, (what, ok) in ENV.items():
        value = os.environ.get(name)
        if value is None or ok is None:
            continue
        try:
            good = ok(value)
        except ValueError:
            good = False
        if not good:
            raise click.UsageError(str(EnvError(name, value, f"expects {what}")))
    spec = os.environ.get("LOWCOMM_TOPOLOGY")
    if spec:
        from ..comm.topology import Topology
        try:
            Topology.parse(spec)
        except ConfigError as e:
            raise click.UsageError(str(EnvError("LOWCOMM_TOPOLOGY", spec, e.reason))) from None


def debug() -> bool:
    """``LOWCOMM_DEBUG=1``: full tracebacks on every failing rank."""
    return os.environ.get("LOWCOMM_DEBUG") == "1"


def load_cfg(config, overrides, base=None):
    """:func:`~lowcomm.run.api.load_config`, a bad key reported as a click usage error."""
    from ..run.api import load_config   # late: it imports every strategy
    try:
        return load_config(config, overrides, base)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


def saved_config(folder) -> dict:
    """The resolved config a run saved in ``folder/config.json`` (``--resume``), checked: a
    missing, unreadable or garbled file is a usage error naming it."""
    import json
    from pathlib import Path
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise click.BadParameter(f"{path} not found: is {folder} the --out folder of a run?",
                                 param_hint="--resume")
    try:
        base = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise click.BadParameter(f"{path} is not a config lowcomm wrote ({type(e).__name__}: {e})",
                                 param_hint="--resume") from None
    if not isinstance(base, dict):
        raise click.BadParameter(f"{path} is not a config lowcomm wrote (a JSON "
                                 f"{type(base).__name__}, not an object)", param_hint="--resume")
    from ..run.config import load_config   # the saved config alone: its own errors name it
    try:
        load_config(None, (), base)
    except ConfigError as e:
        raise click.BadParameter(f"{path}: {e}", param_hint="--resume") from None
    except (TypeError, AttributeError, ValueError) as e:
        raise click.BadParameter(f"{path} is not a config lowcomm wrote ({type(e).__name__}: {e})",
                                 param_hint="--resume") from None
    return base


def set_threads() -> None:
    """torch's intra-op threads: ``$LOWCOMM_NUM_THREADS`` (the launchers set 1 per rank)."""
    import torch
    torch.set_num_threads(int(os.environ.get("LOWCOMM_NUM_THREADS", torch.get_num_threads())))


def world():
    """Set torch's threads, initialise MPI and return the world :class:`~lowcomm.comm.comm.Comm`."""
    from ..comm.comm import init
    set_threads()
    return init()


_config_options = [
    click.option("--config", "config", type=click.Path(dir_okay=False), help="TOML file."),
    click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                 help="Override a config key, e.g. --set strategy.algorithm=ring (repeatable)."),
]


def pass_options(kind=None):
    """Hand a click command its arguments as one frozen object, built once: a ``kind`` (a frozen
    dataclass whose fields are the command's parameters) or, without one, a frozen dataclass of
    the parameters' names. Put it under the command's options, above its function."""
    def wrap(fn):
        @functools.wraps(fn)
        def command(**given):
            made = kind or dataclasses.make_dataclass(f"{fn.__name__}_options", list(given),
                                                      frozen=True)
            return fn(made(**given))
        return command
    return wrap


@dataclass(frozen=True)
class TrainOptions:
    """``lowcomm train``'s arguments, as click gives them (see its ``--help``): a plain run, a
    supervised one (``max_restarts``/``np``) or a fleet (``dcs``) reads the ones it needs."""
    config: str | None
    overrides: tuple[str, ...]
    out: str | None
    checkpoint_every: int | None
    resume: str | None
    quiet: bool
    overwrite: bool
    max_restarts: int | None
    np: int | None
    min_ranks: int | None
    restart_backoff: float
    launcher: str | None
    run_id: str | None
    report_dir: str | None
    dcs: int | None
    hostfiles: str | None
    place: str
    coordinator_host: str | None


def config_options(f):
    """Add ``--config FILE`` and repeatable ``--set KEY=VALUE`` to a click command."""
    for opt in reversed(_config_options):
        f = opt(f)
    return f


def write_json(path, rows) -> None:
    """Write a command's rows to ``path`` as JSON (nothing when no path was given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=2) + "\n")
        click.echo(f"wrote {path}")
