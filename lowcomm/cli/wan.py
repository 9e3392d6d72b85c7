"""``lowcomm wan up|fault|down|status``: the emulated WAN's click group (cli.py registers it; this
module imports no other command module)."""
from __future__ import annotations

import json

import click

from .common import click_errors, pass_options


def _tools():
    from ..tools.wan import WanError
    from ..tools.wan_faults import FaultError
    return FaultError, WanError


_wan_error = click_errors(lambda: _tools()[:1], lambda: _tools()[1:])


@click.group()
def wan():
    """Emulated WAN between datacenters: namespaces joined by a delaying forwarder (root)."""


@wan.command("up")
@click.option("--dcs", type=int, required=True, help="Datacenters (network namespaces).")
@click.option("--delay-ms", type=float, default=25.0, show_default=True, help="One-way delay.")
@click.option("--rate-mbit", type=float, default=100.0, show_default=True, help="Rate per direction.")
@click.option("--link", "links", multiple=True, metavar="A,B,DELAY_MS,RATE_MBIT",
              help="Another delay/rate between datacenters A and B (both ways; repeatable).")
@click.option("--queue-kb", type=float, default=0.0, show_default=True,
              help="Drop-tail queue bound per direction (0: one bandwidth-delay product).")
@click.option("--mtu", type=int, default=9000, show_default=True)
@click.option("--fault", "faults", multiple=True, metavar="KIND:LINK[:KEY=VALUE...]",
              help="A fault scheduled from the moment the WAN is up (repeatable): "
                   "down:0-1:at=20s:for=10s[:hold] or loss:all:rate=1%[:seed=7][:at=..][:for=..]; "
                   "LINK is A-B (both ways), A>B (one way) or all.")
@_wan_error
def wan_up(dcs, delay_ms, rate_mbit, links, queue_kb, mtu, faults):
    """Create namespaces lowcomm-dc0.. with TUN devices and start the forwarder."""
    from ..tools.wan import WanSpec, up
    from ..tools.wan_faults import parse_spec
    spec = WanSpec(dcs, delay_ms, rate_mbit, queue_kb, mtu)
    for text in links:
        spec.set_link(text)
    scheduled = [parse_spec(text, dcs) for text in faults]
    st = up(spec, scheduled)
    click.echo(f"WAN up: {dcs} datacenters, forwarder pid {st['pid']}")
    for i, (ns, addr) in enumerate(zip(st["namespaces"], st["addresses"])):
        click.echo(f"  dc{i}: namespace {ns}, address {addr}")
    for x in spec.links:
        click.echo(f"  dc{x.a} -> dc{x.b}: {x.delay_ms:g} ms, {x.rate_mbit:g} Mbit/s, "
                   f"queue {x.queue_bytes // 1024} KiB")
    _echo_faults()


def _echo_faults():
    from ..tools.wan import faults_now
    for f in faults_now():
        click.echo(f"  fault {f['what']}")


@wan.command("fault")
@click.option("--link", default="all", show_default=True, metavar="A-B|A>B|all",
              help="The link: both directions between datacenters A and B, one direction, or all.")
@click.option("--down", "down_for", metavar="DURATION",
              help="Take the link down for this long (10s, 500ms, 2m), then restore it.")
@click.option("--hold", is_flag=True,
              help="With --down: hold the packets and deliver them when the link is back "
                   "(default: drop them, as a cut link does; TCP retransmits).")
@click.option("--loss", metavar="RATE", help="Drop each packet with this probability per direction "
                                             "(1% or 0.01).")
@click.option("--seed", type=int, default=None, help="With --loss: the loss draws' seed [default: 0].")
@click.option("--for", "loss_for", metavar="DURATION",
              help="With --loss: how long [default: until --clear].")
@click.option("--at", "at", metavar="DELAY", default="0s", show_default=True,
              help="Start the fault this long from now.")
@click.option("--clear", is_flag=True, help="End every fault now (before adding any given here).")
@_wan_error
@pass_options()
def wan_fault(opts):
    """Take a link of the running WAN down for a while, or add packet loss to it.

    \b
    lowcomm wan fault --link 0-1 --down 10s            # dc0 <-> dc1 drops every packet for 10 s
    lowcomm wan fault --link all --loss 1% --seed 7    # 1 % loss each way on every link
    lowcomm wan fault --link 0>1 --loss 0.5% --for 30s --at 5s
    lowcomm wan fault --clear
    lowcomm wan status                                 # the faults and their packet counts
    """
    import math

    from ..tools.wan import WanError, fault, state
    from ..tools.wan_faults import FaultError, make, parse_duration, parse_link, parse_rate
    if not (opts.down_for or opts.loss or opts.clear):
        raise FaultError("give --down DURATION, --loss RATE or --clear")
    if opts.hold and not opts.down_for:
        raise FaultError("--hold goes with --down")
    if (opts.seed is not None or opts.loss_for) and not opts.loss:
        raise FaultError("--seed and --for go with --loss (--down carries its own length)")
    if opts.seed is not None and opts.seed < 0:
        raise FaultError(f"--seed {opts.seed}: use a whole number >= 0")
    start = parse_duration(opts.at, "--at")
    down_s = parse_duration(opts.down_for, "--down") if opts.down_for else None
    rate = parse_rate(opts.loss, "--loss") if opts.loss else None
    loss_s = parse_duration(opts.loss_for, "--for") if opts.loss_for else math.inf
    st = state()
    if st is None:
        raise WanError("no emulated WAN is up (lowcomm wan up first)")
    link = parse_link(opts.link, st["dcs"], "--link")
    new = []
    if down_s is not None:
        new.append(make("down", link, at=start, duration=down_s, hold=opts.hold))
    if rate is not None:
        new.append(make("loss", link, at=start, rate=rate, seed=opts.seed or 0,
                        duration=loss_s))
    added = fault(new, clear=opts.clear)
    if opts.clear:
        click.echo("earlier faults ended")
    for f in added:
        click.echo(f"fault {f.describe(f.start - start)}")


@wan.command("down")
@_wan_error
def wan_down():
    """Stop the forwarder and delete every namespace and device `wan up` made."""
    from ..tools.wan import down
    removed = down()
    click.echo("removed: " + (", ".join(removed) if removed else "nothing (no WAN was up)"))


@wan.command("status")
def wan_status():
    """What of the emulated WAN exists now."""
    from ..tools.wan import faults_now, ours, state
    st = state()
    click.echo(json.dumps({"state": st, "exists": ours(), "faults": faults_now() if st else []},
                          indent=2))
