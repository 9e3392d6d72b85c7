"""All-reduce algorithms on point-to-point messages: ring, Rabenseifner's and a binomial tree
(Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH"), and the ring's reduce-scatter and all-gather over blocks of any sizes. Each sums a
contiguous 1-D CPU tensor in place through Comm's point-to-point calls, so the ledger counts
every message; the costs are tabled in :mod:`lowcomm.comm.collectives`."""
from __future__ import annotations

import torch

from .comm import Comm


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Offsets splitting ``n`` elements into ``parts`` near-equal chunks (the first ``n % parts``
    chunks one longer): ``parts + 1`` offsets from 0 to n."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds


#: The ring's reduce-scatter moves chunks larger than this in segments, pipelined.
RING_SEGMENT_BYTES = 1 << 20


def ring(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Ring all-reduce: reduce-scatter then all-gather around a ring (Patarasuk & Yuan 2009,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations"), the
    reduce-scatter segmented and pipelined.

    1. Split ``buf`` into K chunks. For s = 0..K-2, rank r sends chunk (r-s) mod K to r+1 and
       adds the chunk (r-s-1) mod K received from r-1. Rank r now owns the sum of chunk r+1.
       A chunk over ``RING_SEGMENT_BYTES`` goes in segments: all its sends are posted at once
       (``Isend``), and the receive of segment i+1 (``Irecv``, into the other of two segment
       buffers) is posted before segment i is added in place into the chunk.
    2. For s = 0..K-2, rank r sends chunk (r+1-s) mod K to r+1 and receives chunk (r-s) mod K
       from r-1 straight into ``buf``.
    """
    K, r = comm.size, comm.rank
    if K == 1 or buf.numel() == 0:
        return buf
    b = chunk_bounds(buf.numel(), K)
    seg = lambda i: buf[b[i]:b[i + 1]]  # noqa: E731
    right, left = (r + 1) % K, (r - 1) % K
    S = max(1, RING_SEGMENT_BYTES // buf.element_size())
    tmp = torch.empty(2 * min(S, b[1] - b[0]), dtype=buf.dtype)
    for s in range(K - 1):
        out, into = seg((r - s) % K), seg((r - s - 1) % K)
        if into.numel() <= S and out.numel() <= S:
            got = tmp[:into.numel()]
            comm.sendrecv_(out, right, got, left)
            into.add_(got)
            continue
        sends = [comm.isend(out[a:a + S], right) for a in range(0, out.numel(), S)]
        parts = list(range(0, into.numel(), S))

        def post(j):
            t = tmp[(j % 2) * S:(j % 2) * S + min(S, into.numel() - parts[j])]
            return comm.irecv_(t, left), t
        pending = post(0)
        for j, a in enumerate(parts):
            req, t = pending
            req.wait()
            if j + 1 < len(parts):
                pending = post(j + 1)      # in flight while this segment is added
            into[a:a + t.numel()].add_(t)
        for q in sends:
            q.wait()
    for s in range(K - 1):
        comm.sendrecv_(seg((r + 1 - s) % K), right, seg((r - s) % K), left)
    return buf


def rabenseifner(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, recursive-doubling
    all-gather (Rabenseifner 2004; Thakur et al. 2005).

    With p = 2^⌊log₂K⌋ and q = K - p:

    0. The first 2q ranks pair up; each even rank sends its whole vector to the odd one and
       sits out (so p ranks remain, renumbered 0..p-1).
    1. For d = p/2, p/4, ..., 1: exchange half of the current window with partner ``i xor d``
       and add the half kept. Rank i ends owning the sum of segment i of p.
    2. For d = 1, 2, ..., p/2: exchange windows with ``i xor d``, doubling the owned window.
    3. Odd ranks of the first 2q send the result back to their even partner.

    """
    K, r = comm.size, comm.rank
    n = buf.numel()
    if K == 1 or n == 0:
        return buf
    p = 1 << (K.bit_length() - 1)
    q = K - p
    if r < 2 * q:
        if r % 2 == 0:
            comm.send(buf, r + 1)
            comm.recv_(buf, r + 1)
            return buf
        tmp = torch.empty_like(buf)
        buf.add_(comm.recv_(tmp, r - 1))
        me = r // 2
    else:
        me = r - q
    real = lambda i: 2 * i + 1 if i < q else i + q  # noqa: E731
    b = chunk_bounds(n, p)
    span = lambda lo, hi: buf[b[lo]:b[hi]]  # noqa: E731
    tmp = torch.empty(b[p // 2] if p > 1 else 0, dtype=buf.dtype)
    lo, hi, d = 0, p, p // 2
    while d >= 1:
        mid = (lo + hi) // 2
        (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
        keep = span(klo, khi)
        comm.sendrecv_(span(glo, ghi), real(me ^ d), tmp[:keep.numel()], real(me ^ d))
        keep.add_(tmp[:keep.numel()])
        lo, hi, d = klo, khi, d // 2
    d = 1
    while d < p:
        olo, ohi = (lo - d, lo) if me & d else (hi, hi + d)
        comm.sendrecv_(span(lo, hi), real(me ^ d), span(olo, ohi), real(me ^ d))
        lo, hi, d = min(lo, olo), max(hi, ohi), d * 2
    if r < 2 * q:
        comm.send(buf, r - 1)
    return buf


def tree(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Binomial-tree all-reduce: binomial reduce to rank 0, then binomial broadcast.

    1. For m = 1, 2, 4, ...: a rank with bit m set sends its partial sum to rank - m and stops;
       otherwise it adds what rank + m sends (if that rank exists).
    2. Rank r receives the result from r - lowbit(r), then sends it to r + m for every power of
       two m below lowbit(r) (rank 0: below K).

    Latency-optimal (2⌈log₂K⌉ messages) but every message carries all n bytes.
    """
    K, r = comm.size, comm.rank
    if K == 1 or buf.numel() == 0:
        return buf
    tmp = torch.empty_like(buf)
    m = 1
    while m < K:
        if r & m:
            comm.send(buf, r - m)
            break
        if r + m < K:
            buf.add_(comm.recv_(tmp, r + m))
        m <<= 1
    m = 1
    while m < K:
        if r & m:
            comm.recv_(buf, r - m)
            break
        m <<= 1
    m >>= 1
    while m > 0:
        if r + m < K:
            comm.send(buf, r + m)
        m >>= 1
    return buf


def gather_ranges(buf, ranges):
    """The elements of ``buf`` in ``ranges`` (``[lo, hi)`` pairs), one tensor."""
    if len(ranges) == 1:
        return buf[ranges[0][0]:ranges[0][1]]
    return torch.cat([buf[lo:hi] for lo, hi in ranges]) if ranges else buf[:0]


def scatter_ranges(buf, ranges, src, add: bool = False) -> None:
    """``src`` written (or added) into ``buf``'s ``ranges`` in order."""
    off = 0
    for lo, hi in ranges:
        part = src[off:off + hi - lo]
        buf[lo:hi].add_(part) if add else buf[lo:hi].copy_(part)
        off += hi - lo


def ranges_size(ranges) -> int:
    """How many elements ``ranges`` cover."""
    return sum(hi - lo for lo, hi in ranges)


def ring_reduce_scatter(comm: Comm, buf, blocks) -> None:
    """Ring reduce-scatter over blocks of any sizes (Thakur, Rabenseifner & Gropp 2005 §4.5):
    for s = 0..K-2 rank r sends block (r-s-1) mod K to r+1 and adds block (r-s-2) mod K from
    r-1 into its own copy; rank r then holds the sum of block r."""
    K, r = comm.size, comm.rank
    right, left = (r + 1) % K, (r - 1) % K
    tmp = torch.empty(max(ranges_size(x) for x in blocks), dtype=buf.dtype)
    for s in range(K - 1):
        out = gather_ranges(buf, blocks[(r - s - 1) % K]).contiguous()
        into = blocks[(r - s - 2) % K]
        got = tmp[:ranges_size(into)]
        comm.sendrecv_(out, right, got, left)
        scatter_ranges(buf, into, got, add=True)


def ring_allgather(comm: Comm, buf, blocks) -> None:
    """Ring all-gather: for s = 0..K-2 rank r sends block (r-s) mod K to r+1 and stores block
    (r-s-1) mod K from r-1."""
    K, r = comm.size, comm.rank
    right, left = (r + 1) % K, (r - 1) % K
    tmp = torch.empty(max(ranges_size(x) for x in blocks), dtype=buf.dtype)
    for s in range(K - 1):
        out = gather_ranges(buf, blocks[(r - s) % K]).contiguous()
        into = blocks[(r - s - 1) % K]
        if len(into) == 1:
            comm.sendrecv_(out, right, buf[into[0][0]:into[0][1]], left)
        else:
            got = tmp[:ranges_size(into)]
            comm.sendrecv_(out, right, got, left)
            scatter_ranges(buf, into, got)


__all__ = ["RING_SEGMENT_BYTES", "chunk_bounds", "gather_ranges", "rabenseifner", "ranges_size", "ring",
           "ring_allgather", "ring_reduce_scatter", "scatter_ranges", "tree"]
