"""``lowcomm bench compress``: each compressor's compress / decompress throughput on one gradient,
beside a memcpy of the same bytes timed in the same run, and its break-even against a link.

One process, no communication: the figures say what a method costs a rank's CPU per step, to
set beside the bytes it saves (:mod:`lowcomm.tools.bench` measures the collectives)."""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .bench import _check_known

#: the link of the break-even column of ``lowcomm bench compress``: 10 Gbit/s
BREAK_EVEN_GBIT = 10.0


def bench_compress(methods: list[str], numel: int = 2048 * 2048, iters: int = 10, warmup: int = 2,
                   cfg=None, link_gbit: float = BREAK_EVEN_GBIT, clock: str = "wall") -> list[dict]:
    """Single-process compress / decompress throughput of each method on one float32 gradient
    of ``numel`` elements (a square-ish matrix), beside a memcpy of the same bytes timed in the
    same run. GB/s = gradient bytes / median seconds; ``vs memcpy`` = memcpy's median seconds /
    the method's, with a memcpy timed just before every timed call (interleaved: on a shared
    machine both see the same load); the memcpy row: the median of all those copies.
    Method ``pack`` times the bit packing and unpacking alone (sign methods and 1-bit Adam).
    ``clock``: "wall" (``time.perf_counter``) or "cpu" (this thread's CPU time,
    ``time.thread_time``: time spent descheduled by other processes does not count, so ratios
    taken on a busy machine move less; memory contention still shows).

    Break-even: ``cost_ms`` = compress + decompress (median each), ``saved_ms`` = the time the
    bytes it saves (gradient − payload) take on a ``link_gbit`` link, ``cost_vs_saved`` =
    cost / saved (below 1: it pays for itself on that link, for one rank's one send)."""
    from ..compress import COMPRESSORS
    from ..compress.base import Segment

    for m in methods:
        _check_known(m, [*COMPRESSORS, "pack"], "method")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"unknown clock {clock!r}; known: wall, cpu")
    rows_n = max(1, int(numel ** 0.5))
    while numel % rows_n:
        rows_n -= 1
    shape = (rows_n, numel // rows_n)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    segs = [Segment("grad", torch.Size(shape), 0, numel)]
    timer = _Interleaved(x, warmup, iters, time.perf_counter if clock == "wall" else time.thread_time)
    rows = [_compress_row(m, x, segs, timer, cfg) for m in methods]
    rows.insert(0, timer.memcpy_row())
    return _break_even(rows, numel * 4, link_gbit, clock)


class _Interleaved:
    """Times a function against a memcpy of ``x`` timed just before each of its iterations
    (interleaved, so on a shared machine both see the same load); keeps every copy's time."""

    def __init__(self, x: torch.Tensor, warmup: int, iters: int, now):
        self.x, self.dst = x, torch.empty_like(x)
        self.warmup, self.iters, self.now = warmup, iters, now
        self.copies: list[float] = []

    def memcpy(self) -> None:
        self.dst.copy_(self.x)

    def median(self, fn) -> tuple[float, float]:
        """Median seconds of ``fn`` and of the memcpy before each of its iterations."""
        for _ in range(self.warmup):
            fn()
        times, refs = [], []
        for _ in range(self.iters):
            t0 = self.now()
            self.memcpy()
            t1 = self.now()
            fn()
            times.append(self.now() - t1)
            refs.append(t1 - t0)
        self.copies.extend(refs)
        return statistics.median(times), statistics.median(refs)

    def memcpy_row(self) -> dict:
        """The memcpy row: the median of every copy timed (timed alone if none was)."""
        if not self.copies:
            self.median(self.memcpy)
        nbytes = self.x.numel() * 4
        mc = nbytes / statistics.median(self.copies) / 1e9
        return {"method": "memcpy", "compress_GBps": mc, "decompress_GBps": mc,
                "payload_bytes": nbytes, "compress_vs_memcpy": 1.0, "decompress_vs_memcpy": 1.0}


def _compress_row(m: str, x: torch.Tensor, segs, timer: _Interleaved, cfg) -> dict:
    """Method ``m``'s row of :func:`bench_compress` (``pack``: the bit packing alone)."""
    from ..compress import COMPRESSORS, build_compressor
    from ..compress.bits import pack_signs, unpack_signs
    from ..run.config import CompressorConfig

    numel = x.numel()
    if m == "pack":
        (t, tm), p = timer.median(lambda: pack_signs(x)), pack_signs(x)
        u, um = timer.median(lambda: unpack_signs(p, numel, torch.float32, 0.5))
        name, payload_bytes = "pack/unpack", p.numel()
    else:
        base = cfg or CompressorConfig()
        c = build_compressor(dataclasses.replace(base, name=m, start_iter=0)) or COMPRESSORS["none"](base)
        t, tm = timer.median(lambda: c.compress(x, "bench", segs))
        payload, ctx = c.compress(x, "bench", segs)
        u, um = timer.median(lambda: c.decompress(payload, ctx))
        name, payload_bytes = m, sum(q.numel() * q.element_size() for q in payload)
    nbytes = numel * 4
    return {"method": name, "compress_GBps": nbytes / t / 1e9, "decompress_GBps": nbytes / u / 1e9,
            "payload_bytes": payload_bytes, "compress_vs_memcpy": tm / t, "decompress_vs_memcpy": um / u}


def _break_even(rows: list[dict], nbytes: int, link_gbit: float, clock: str) -> list[dict]:
    """Each row's ratio, cost (compress + decompress) and the time the bytes it saves take on
    a ``link_gbit`` link."""
    if link_gbit <= 0:
        raise ValueError(f"link_gbit must be > 0, got {link_gbit}")
    for row in rows:
        row["ratio"] = nbytes / row["payload_bytes"]
        row["cost_ms"] = (nbytes / row["compress_GBps"] + nbytes / row["decompress_GBps"]) / 1e6
        row["saved_ms"] = (nbytes - row["payload_bytes"]) * 8 / (link_gbit * 1e9) * 1e3
        row["cost_vs_saved"] = row["cost_ms"] / row["saved_ms"] if row["saved_ms"] > 0 else None
        row["link_gbit"] = link_gbit
        row["clock"] = clock
    rows[0]["cost_ms"] = rows[0]["cost_vs_saved"] = None      # memcpy: the reference, no method
    return rows


def format_compress(rows: list[dict]) -> str:
    gbit = rows[0]["link_gbit"] if rows else BREAK_EVEN_GBIT
    lines = [f"{'method':>12} {'payload(B)':>11} {'ratio':>7} {'compress GB/s':>14} {'vs memcpy':>10} "
             f"{'decompress GB/s':>16} {'vs memcpy':>10} {'c+d ms':>8} {f'saved@{gbit:g}G ms':>15} "
             f"{'cost/saved':>11}"]
    for r in rows:
        cost = f"{r['cost_ms']:8.2f}" if r["cost_ms"] is not None else f"{'-':>8}"
        ratio = f"{r['cost_vs_saved']:11.2f}" if r["cost_vs_saved"] is not None else f"{'-':>11}"
        lines.append(f"{r['method']:>12} {r['payload_bytes']:>11} {r['ratio']:>7.1f} "
                     f"{r['compress_GBps']:>14.2f} {r['compress_vs_memcpy']:>10.2f} "
                     f"{r['decompress_GBps']:>16.2f} {r['decompress_vs_memcpy']:>10.2f} "
                     f"{cost} {r['saved_ms']:15.2f} {ratio}")
    lines.append(f"c+d ms: compress + decompress; saved@{gbit:g}G: the time the bytes a method saves "
                 f"(gradient - payload) take on a {gbit:g} Gbit/s link; cost/saved > 1: it costs "
                 f"more time than it saves there")
    return "\n".join(lines)
