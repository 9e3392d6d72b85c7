"""``lowcomm fault slow|kill|corrupt``: faults of a running fleet's datacenters, injected from outside
(cli.py registers the group; the emulated WAN's link faults are ``lowcomm wan fault``)."""
from __future__ import annotations

import json
import math
import signal

import click

from .common import click_errors


def _refusals():
    from ..run.fleet.corrupt import CorruptError
    from ..tools.slow import SlowError
    from ..tools.wan_faults import FaultError
    return SlowError, FaultError, CorruptError


_fault_error = click_errors(_refusals)


@click.group()
def fault():
    """Slow, kill or corrupt a datacenter of a running fleet (lowcomm train --dcs D --out OUT)."""


@fault.command("slow")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.option("--dc", type=click.IntRange(min=0), required=True, help="The datacenter to slow.")
@click.option("--speed", type=float, required=True,
              help="The fraction of its speed it keeps, in (0, 1): 0.5 runs half the time.")
@click.option("--cycle", default="200ms", show_default=True, metavar="DURATION",
              help="One stop and one run: at --speed 0.5, 100 ms stopped, 100 ms running.")
@click.option("--for", "for_", default=None, metavar="DURATION",
              help="How long [default: until the fleet's run ends].")
@click.option("--at", "at", default="0s", show_default=True, metavar="DELAY",
              help="Start this long from now.")
@_fault_error
def fault_slow(out, dc, speed, cycle, for_, at):
    """Slow datacenter DC of the fleet in OUT to a fraction of its speed (a duty-cycled
    SIGSTOP/SIGCONT of its ranks; a relaunched incarnation stays slow). Runs in the foreground
    and continues every process it stopped when it ends (also on Ctrl-C).

    \b
    lowcomm fault slow runs/fleet --dc 2 --speed 0.5             # until the run ends
    lowcomm fault slow runs/fleet --dc 1 --speed 0.25 --for 60s --at 30s
    """
    from ..tools.slow import slow_datacenter
    from ..tools.wan_faults import parse_duration
    for_s = parse_duration(for_, "--for") if for_ else math.inf
    done = slow_datacenter(out, dc, speed, parse_duration(cycle, "--cycle"), for_s,
                           parse_duration(at, "--at"))
    click.echo(json.dumps(done))


@fault.command("kill")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.option("--dc", type=click.IntRange(min=0), required=True, help="The datacenter.")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Kill only this rank of it (its place in the datacenter's job) [default: all].")
@_fault_error
def fault_kill(out, dc, rank):
    """SIGKILL the ranks of datacenter DC of the fleet in OUT (its newest incarnation): the
    fleet relaunches it and it heals back in live.

    \b
    lowcomm fault kill runs/fleet --dc 1              # every rank of datacenter 1
    lowcomm fault kill runs/fleet --dc 1 --rank 0     # its leader only
    """
    import os

    from ..tools.slow import SlowError, kill_targets
    pids = kill_targets(out, dc, rank)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            raise SlowError(f"rank process {pid} of datacenter {dc} ended before the kill") from None
    click.echo(json.dumps({"dc": dc, "killed": pids}))


@fault.command("corrupt")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.option("--dc", type=click.IntRange(min=0), required=True, help="The datacenter.")
@click.option("--kind", required=True, metavar="KIND",
              help="nan | scale=S | signflip | noise=SIGMA | stale=N | zero")
@click.option("--from-round", type=int, default=1, show_default=True,
              help="The first round of each fragment it corrupts (counted from 1 by the "
                   "datacenter's job).")
@_fault_error
def fault_corrupt(out, dc, kind, from_round):
    """Make datacenter DC of the fleet in OUT send a bad pseudo-gradient from then on (its every
    incarnation reads OUT/corrupt/dc<DC>.json before each round): what robust aggregation
    (strategy.aggregate) keeps out.

    \b
    lowcomm fault corrupt runs/fleet --dc 1 --kind nan
    lowcomm fault corrupt runs/fleet --dc 2 --kind scale=100 --from-round 3
    """
    from ..run.fleet.corrupt import parse_kind, write_fault
    from ..tools.slow import newest_folder
    parse_kind(kind)                                 # a bad --kind before the fleet is looked at
    newest_folder(out, dc)                           # a fleet with that datacenter
    click.echo(json.dumps(write_fault(out, dc, kind, from_round)))
