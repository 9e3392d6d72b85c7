"""``lowcomm wan up|down|status``: the emulated WAN's click group (cli.py registers it; this
module imports no other command module)."""
from __future__ import annotations

import json

import click


def _wan_error(fn):
    def run(*args, **kwargs):
        from .wan import WanError
        try:
            return fn(*args, **kwargs)
        except WanError as e:
            raise click.ClickException(str(e)) from None
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


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
@_wan_error
def wan_up(dcs, delay_ms, rate_mbit, links, queue_kb, mtu):
    """Create namespaces lowcomm-dc0.. with TUN devices and start the forwarder."""
    from .wan import WanSpec, up
    spec = WanSpec(dcs, delay_ms, rate_mbit, queue_kb, mtu)
    for text in links:
        spec.set_link(text)
    st = up(spec)
    click.echo(f"WAN up: {dcs} datacenters, forwarder pid {st['pid']}")
    for i, (ns, addr) in enumerate(zip(st["namespaces"], st["addresses"])):
        click.echo(f"  dc{i}: namespace {ns}, address {addr}")
    for x in spec.links:
        click.echo(f"  dc{x.a} -> dc{x.b}: {x.delay_ms:g} ms, {x.rate_mbit:g} Mbit/s, "
                   f"queue {x.queue_bytes // 1024} KiB")


@wan.command("down")
@_wan_error
def wan_down():
    """Stop the forwarder and delete every namespace and device `wan up` made."""
    from .wan import down
    removed = down()
    click.echo("removed: " + (", ".join(removed) if removed else "nothing (no WAN was up)"))


@wan.command("status")
def wan_status():
    """What of the emulated WAN exists now."""
    from .wan import ours, state
    st = state()
    click.echo(json.dumps({"state": st, "exists": ours()}, indent=2))
