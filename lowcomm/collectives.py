"""All-reduce algorithms as plain functions ``fn(comm, buf) -> buf``.

Each algorithm sums a contiguous 1-D CPU tensor in place over ``comm`` using Comm's
point-to-point calls, so the Ledger sees (and counts exactly) every message. Costs on K ranks
for n bytes, with α the per-message latency and β the per-byte time (Thakur, Rabenseifner &
Gropp 2005, "Optimization of Collective Communication Operations in MPICH"):

==============  ==========================  =============================================
algorithm       time                         bytes sent per rank
==============  ==========================  =============================================
ring            2(K-1)α + 2(K-1)/K·nβ        2(K-1)/K·n
rabenseifner    2log₂K·α + 2(K-1)/K·nβ       2(K-1)/K·n (+n for the pairs folded in when
                                             K is not a power of two)
tree            2⌈log₂K⌉(α + nβ)             n to the parent + n per child
mpi             vendor choice                charged 2(K-1)/K·n
hierarchical    per level, see below         2(g-1)/g·n inside a group of g, 2(G-1)/G·n/g
                                             across G groups
==============  ==========================  =============================================

Use :func:`allreduce_` for tensors of any shape, dtype and device.
"""
from __future__ import annotations

from typing import Callable

import torch

from .comm import Comm, _reduce_op, init

Algorithm = Callable[[Comm, torch.Tensor], torch.Tensor]


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Offsets splitting ``n`` elements into ``parts`` near-equal chunks (the first ``n % parts``
    chunks one longer): ``parts + 1`` offsets from 0 to n."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds


def ring(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Ring all-reduce: reduce-scatter then all-gather around a ring (Patarasuk & Yuan 2009,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations").

    1. Split ``buf`` into K chunks. For s = 0..K-2, rank r sends chunk (r-s) mod K to r+1 and
       adds the chunk (r-s-1) mod K received from r-1. Rank r now owns the sum of chunk r+1.
    2. For s = 0..K-2, rank r sends chunk (r+1-s) mod K to r+1 and stores chunk (r-s) mod K
       received from r-1.
    """
    K, r = comm.size, comm.rank
    if K == 1 or buf.numel() == 0:
        return buf
    b = chunk_bounds(buf.numel(), K)
    seg = lambda i: buf[b[i]:b[i + 1]]  # noqa: E731
    right, left = (r + 1) % K, (r - 1) % K
    tmp = torch.empty(b[1] - b[0], dtype=buf.dtype)
    for s in range(K - 1):
        out, into = seg((r - s) % K), seg((r - s - 1) % K)
        comm.sendrecv_(out, right, tmp[:into.numel()], left)
        into.add_(tmp[:into.numel()])
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


def mpi(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """The vendor's ``MPI_Allreduce`` (its own choice of algorithm), as the reference."""
    return comm.allreduce_(buf)


def hierarchical(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Hierarchical all-reduce over the levels of ``comm``'s topology (Horovod's hierarchical
    allreduce, Sergeev & Del Balso 2018, arXiv:1802.05799; BlueConnect, Cho et al. 2019), with
    ring reduce-scatter / all-gather phases (Thakur, Rabenseifner & Gropp 2005).

    The topology is ``comm.topology`` (see :meth:`lowcomm.topology.Topology.attach`), the run's
    attached one when ``comm`` is a duplicate of its world, else read from the environment
    (``$LOWCOMM_TOPOLOGY``, Slurm, hostfile or MPI's shared-memory split) on first use.

    1. Cut the buffer into S shards, S = the largest innermost group (e.g. ranks of a node). In
       a group of s ranks, local rank l owns shards j ≡ l (mod s): unequal groups are allowed.
    2. Ring reduce-scatter inside the group: each rank holds its shards summed over the group.
    3. For each owned shard pattern, all-reduce the shards among their owners (one rank per
       group) by applying steps 1–4 again one level up; at the outermost level, a ring.
    4. Ring all-gather inside the group.

    Each phase is filed in the ledger at its own level (``reduce_scatter.ring`` and
    ``allgather.ring`` under the inner level, ``allreduce.ring`` under the outermost), so
    ``Ledger.by_level()`` shows the bytes that crossed each kind of link. With equal groups of
    g ranks, an n-byte all-reduce sends 2(g-1)/g·n inside and 2(G-1)/G·n/g across G groups.

    Example::

        comm = lowcomm.init()
        Topology.parse("dc:2,rank:2").attach(comm)
        lowcomm.allreduce_(t, comm, "hierarchical")
    """
    from .topology import topology_of
    if buf.numel() == 0:
        return buf
    return topology_of(comm).plan(comm).run(buf)


hierarchical.files_own_levels = True   # allreduce_ must not fold its phases into one row


ALGORITHMS: dict[str, Algorithm] = {"mpi": mpi, "ring": ring, "rabenseifner": rabenseifner,
                                    "tree": tree, "hierarchical": hierarchical}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def allreduce_(tensor: torch.Tensor, comm: Comm | None = None, algorithm: str = "mpi",
               op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or average (``op="avg"``) ``tensor`` over ``comm`` in place.

    Any shape, length (0 included), rank count, float dtype and device. The traffic is filed
    in ``comm.ledger`` as one ``allreduce.<algorithm>`` call at ``comm.level``.

    Example::

        comm = lowcomm.init()
        g = torch.full((1000,), float(comm.rank))
        lowcomm.allreduce_(g, algorithm="ring", op="avg")   # every element = (K-1)/2
    """
    comm = comm or init()
    fn = get_algorithm(algorithm)
    avg = _reduce_op(op)
    if algorithm == "mpi":
        return comm.allreduce_(tensor, op)  # checks, stages and records itself
    comm.check(f"allreduce.{algorithm}", tensor)
    with comm.staged(tensor) as buf:
        if getattr(fn, "files_own_levels", False):   # hierarchical: one row per level
            fn(comm, buf)
        else:
            with comm.ledger.scope(f"allreduce.{algorithm}", comm.level):
                fn(comm, buf)
        if avg:
            buf.div_(comm.size)
    return tensor


def broadcast_(comm: Comm, tensors: list[torch.Tensor], root: int = 0) -> None:
    """Broadcast a list of tensors from ``root`` in place, one flat message per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for _, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([t.detach().reshape(-1) for t in group]) if group else torch.empty(0)
        comm.bcast_(flat, root)
        offset = 0
        for t in group:
            t.detach().copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
