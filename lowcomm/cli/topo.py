"""``lowcomm topo [--probe]``: the run's topology, the ranks of each unit and the α–β figures of
every level, measured by ping-pong with ``--probe`` (cli.py registers it)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from .common import world
from ..errors import LowcommError


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
    from ..comm.ledger import Ledger
    from ..comm.topology import LinkModel, Topology
    comm = world()
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
