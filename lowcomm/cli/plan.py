"""``lowcomm plan``: which TP × PP × DP compositions of a GPT shape fit a device, and their
modelled compute utilisation with DiLoCo between datacenters (:mod:`lowcomm.tools.plan`;
cli.py registers it)."""
from __future__ import annotations

import dataclasses

import click


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise click.BadParameter(f"a comma list of positive integers, got {text!r}",
                                 param_hint=what)
    return out


@click.command()
@click.option("--shapes", default="10b,70b", show_default=True,
              help="GPT shapes: 10b, 70b, or LAYERS:WIDTH (e.g. 32:4096), comma-separated.")
@click.option("--ranks", default="96,768,3072", show_default=True,
              help="Rank counts of all datacenters together (each a multiple of --dcs).")
@click.option("--dcs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--wan-gbit", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="A datacenter's link to the others, shared by its ranks.")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=80.0,
              show_default=True, help="Per device.")
@click.option("--period", type=click.IntRange(min=1), default=100, show_default=True,
              help="DiLoCo's H between the datacenters.")
def plan(shapes, ranks, dcs, wan_gbit, memory_gb, period):
    """Model which splits of a GPT fit a device and the compute utilisation each reaches with
    DiLoCo between datacenters: memory per rank, step time and utilisation of the best
    composition, beside SyncDP's memory per rank. A model: its assumptions are printed."""
    from ..tools.plan import SHAPES, Setting, Shape, assumptions, table
    chosen = []
    for name in shapes.split(","):
        if name.lower() in SHAPES:
            chosen.append(SHAPES[name.lower()])
            continue
        if name.count(":") != 1:
            raise click.BadParameter(f"{name!r} is no shape: 10b, 70b or LAYERS:WIDTH",
                                     param_hint="--shapes")
        layers, width = _ints(name.replace(":", ","), "--shapes")
        chosen.append(Shape(f"{layers}×{width}", layers, width))
    ks = _ints(ranks, "--ranks")
    bad = [k for k in ks if k % dcs]
    if bad:
        raise click.BadParameter(f"{bad} are not multiples of --dcs {dcs}", param_hint="--ranks")
    st = dataclasses.replace(Setting(), dcs=dcs, wan_gbit=wan_gbit, memory_gb=memory_gb,
                             period=period)
    click.echo(table(chosen, ks, st))
    click.echo("\nassumed: " + assumptions(st))
