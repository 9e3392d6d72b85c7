"""``lowcomm wan up|down|status`` and ``lowcomm topo [--probe]`` (registered in cli.py)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from .errors import LowcommError


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


def _probe_pair(comm, a: int, b: int, small_iters: int = 10, big: int = 4 << 20,
                big_iters: int = 3) -> tuple[float, float]:
    """Ping-pong between ranks a and b: T(n) = 2α + c + n/β (n bytes there, 1 byte back; c the
    MPI library's fixed cost of a large message, e.g. its rendezvous handshake).
    α = median T(1)/2; β from the slope, (n − n/4) / (T(n) − T(n/4))."""
    import torch
    me = comm.rank
    one, buf = torch.zeros(1, dtype=torch.uint8), torch.zeros(big, dtype=torch.uint8)

    def trip(n: int) -> float:
        if me == a:
            t0 = time.perf_counter()
            comm.send(buf[:n], b)
            comm.recv_(one, b)
            return time.perf_counter() - t0
        comm.recv_(buf[:n], a)
        comm.send(one, a)
        return 0.0

    trip(1), trip(big)   # connect and warm up
    small = statistics.median(trip(1) for _ in range(small_iters))
    quarter = statistics.median(trip(big // 4) for _ in range(big_iters))
    large = statistics.median(trip(big) for _ in range(big_iters))
    return small / 2, (big - big // 4) / max(large - quarter, 1e-9)


@click.command()
@click.option("--probe", is_flag=True, help="Measure α and β of every level by ping-pong.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the levels here.")
@click.option("--set", "spec", default="", metavar="SPEC",
              help="Topology spec (default: $LOWCOMM_TOPOLOGY, Slurm, hostfile or discovery).")
def topo(probe, json_path, spec):
    """Print the levels, the ranks of each unit and α, β per level (run under mpirun)."""
    from .cli import _world
    from .ledger import Ledger
    from .topology import LinkModel, Topology
    comm = _world()
    try:
        t = Topology.from_env(comm, spec)
    except LowcommError as e:
        raise click.ClickException(str(e)) from None
    ctl = comm.dup(Ledger(), "probe")
    if probe:
        for level in t.names:
            pair = next(((x, y) for x in range(t.size) for y in range(x + 1, t.size)
                         if t.level_of(x, y) == level), None)
            if pair is None:
                continue
            big = 4 << 20 if t.link(level).bytes_per_s < 1e9 else 32 << 20
            if comm.rank in pair:
                alpha, beta = _probe_pair(ctl, *pair, big=big)
            ctl.barrier()
            alpha, beta = ctl.bcast_object((alpha, beta) if comm.rank == pair[0] else None, pair[0])
            t.links[level] = LinkModel(alpha, beta, f"probe ranks {pair[0]}-{pair[1]}")
    if comm.rank == 0:
        click.echo(f"topology {t.spec()}  ({comm.size} ranks; from {t.source})")
        for i, level in enumerate(t.names[:-1]):
            units = t.units(level)
            click.echo(f"  {level}: " + "  ".join(f"{level}{k}={u}" for k, u in enumerate(units)))
        for level in t.names:
            click.echo(f"  links of level {level!r} (peer group {t.group_size(level)}): {t.link(level)}")
        given = ",".join(f"{n}:{c}@{t.link(n).alpha_s * 1e3:.4g}ms/{t.link(n).bytes_per_s * 8 / 1e6:.5g}mbit"
                         for n, c in (p.split(":") for p in t.spec().split(",")))
        click.echo(f"as config: --set topology={given}")
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps({
                "spec": t.spec(), "source": t.source, "as_config": given,
                "levels": {n: {"alpha_s": t.link(n).alpha_s, "bytes_per_s": t.link(n).bytes_per_s,
                               "source": t.link(n).source, "group_size": t.group_size(n)}
                           for n in t.names},
                "units": {n: t.units(n) for n in t.names[:-1]}}, indent=2) + "\n")
            click.echo(f"wrote {json_path}")
