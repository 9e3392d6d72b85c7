"""All-reduce algorithms as plain functions ``fn(comm, buf) -> buf``.

Each algorithm sums a contiguous 1-D CPU tensor in place over ``comm`` using Comm's
point-to-point calls, so the Ledger sees (and counts exactly) every message. Costs on K ranks
for n bytes, with α the per-message latency and β the per-byte time (Thakur, Rabenseifner &
Gropp 2005, "Optimization of Collective Communication Operations in MPICH"):

==============  ===============================  ================================================
algorithm       time                             bytes sent per rank
==============  ===============================  ================================================
ring            2(K-1)α + 2(K-1)/K·nβ            2(K-1)/K·n
rabenseifner    2log₂K·α + 2(K-1)/K·nβ           2(K-1)/K·n (+n for the pairs folded in when K
                                                 is not a power of two)
tree            2⌈log₂K⌉(α + nβ)                 n to the parent + n per child
mpi             vendor choice                    charged 2(K-1)/K·n
shm             2⌈n/S⌉ barriers + ~3n memory     2(K-1)/K·n read by the others (one node only;
                traffic (registered buffer: 2    S = SHM_SEGMENT_BYTES; 1 barrier when small)
                barriers + 2n, a memcpy's)
hierarchical    per level, see below             2(g-1)/g·n inside a group of g, 2(G-1)/G·n/g
                                                 across G groups
==============  ===============================  ================================================

Use :func:`allreduce_` for tensors of any shape, dtype and device; its default ``"auto"`` picks
the fastest per size (:mod:`lowcomm.comm.tuning`) and, on one node, reduces a buffer registered
with the communicator (:meth:`~lowcomm.comm.comm.Comm.shared_tensor`, every rank passing its
own) in place in shared memory.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from .algorithms import (chunk_bounds, gather_ranges, rabenseifner, ranges_size, ring, ring_allgather,
                         ring_reduce_scatter, scatter_ranges, tree)
from .comm import Comm, init
from ..errors import CommError, ConfigError, LowcommError
from .tensors import reduce_op as _reduce_op
from .tuning import agree

if TYPE_CHECKING:   # the topology's communicators are handed in, never looked up
    from .topology import Hierarchy, Levels

Algorithm = Callable[[Comm, torch.Tensor], torch.Tensor]


#: Bytes of one shared-memory segment: each rank's window slot holds two (double buffering),
#: so the window stays bounded (2·SHM_SEGMENT_BYTES per rank) whatever the message size.
SHM_SEGMENT_BYTES = 16 << 20
#: Up to this many bytes the shared-memory all-reduce takes one barrier instead of two: every
#: rank sums the whole segment itself (K-1 passes over n instead of over n/K), which is cheaper
#: than a second round of waiting for every rank while messages are small.
SHM_ONE_SYNC_BYTES = 256 << 10


#: From this many bytes ``auto`` all-reduces a registered buffer (:meth:`Comm.shared_tensor`) in
#: place through the shared window (:func:`_shm_in_place`); below, its barriers cost more than
#: the vendor's small-message path (2 ranks, one core each: 0.74× the vendor at 16 KiB, 1.06×
#: at 128 KiB, 1.6× at 1 MiB; ``lowcomm bench allreduce --algorithms mpi,shm-registered``).
REGISTERED_MIN_BYTES = 128 << 10


def _shm_window(comm: Comm, nbytes: int):
    """The communicator's window, two segments per rank: of ``SHM_SEGMENT_BYTES``, or of the
    next power of two ≥ ``nbytes`` (at least 4 KiB) when that is smaller, so small buckets keep
    a small window. Every rank passes the same ``nbytes``, so a (collective) reallocation for a
    larger message happens on all ranks at the same call."""
    half = min(SHM_SEGMENT_BYTES, 1 << max(12, (max(nbytes, 1) - 1).bit_length()))
    return comm.shared_window(2 * half)


def _shm_segments(win, n: int, es: int):
    """``(start, length, offset into the slot in elements)`` of each segment of ``n`` elements
    (a segment: half the window's slot), alternating between the two halves across segments
    *and* calls (``win.turn``): a rank fills one half while slower ranks may still read the
    other, and it can only come back to a half after a barrier that every rank reaches only
    once done reading it."""
    seg = max(1, min(SHM_SEGMENT_BYTES, win.slot_bytes // 2) // es)
    for a in range(0, n, seg):
        half = getattr(win, "turn", 0)
        win.turn = 1 - half
        yield a, min(seg, n - a), half * seg


def shm(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """Shared-memory all-reduce on one node through an MPI-3 shared window (the intra-node
    reduce-scatter + all-gather through shared buffers of Graham & Shipman 2008, "MPI support
    for multi-core architectures: optimized shared memory collectives"; Li, Hoefler & Snir
    2013, "NUMA-aware shared-memory collective communication for MPI").

    Per segment of at most ``SHM_SEGMENT_BYTES`` (double-buffered in each rank's slot), with
    the buffer cut into K chunks:

    1. rank r copies every chunk but its own into its slot; barrier;
    2. rank r adds chunk r of the other K-1 slots into its own buffer (reading their slots
       directly, no messages, no temporaries) and stores the sum in its slot; barrier;
    3. rank r copies each chunk j ≠ r from rank j's slot into its buffer.

    Up to ``SHM_ONE_SYNC_BYTES``: 1. every rank copies the whole segment in; barrier; 2. every
    rank sums the K slots in rank order into its buffer (one barrier instead of two).
    Each rank moves ~3n bytes through memory, where a ring moves 2(K-1)/K·n out and in through
    the MPI library's transport plus the reduction. Sums are taken in the same order for the
    same element whichever rank computes them, so all ranks end bit-identical. Needs a
    node-local ``comm`` (:meth:`~lowcomm.comm.comm.Comm.node_local`; else a CommError names the
    level). The ledger is charged, sent and received, what other ranks read of this rank's
    slot: (K-1)/K·n of its copy and its sum K-1 times (the ring's 2(K-1)/K·n); small
    messages: (K-1)·n.
    """
    K, r = comm.size, comm.rank
    n = buf.numel()
    if K == 1 or n == 0:
        return buf
    win = _shm_window(comm, buf.numel() * buf.element_size())
    slots = [win.slot(j, buf.dtype) for j in range(K)]
    t0 = time.perf_counter()
    moved = 0
    for a, L, off in _shm_segments(win, n, buf.element_size()):
        step = _shm_one_sync if L * buf.element_size() <= SHM_ONE_SYNC_BYTES else _shm_two_syncs
        moved += step(win, [s[off:off + L] for s in slots], buf[a:a + L], r)
    moved *= buf.element_size()
    comm.ledger.record("shm", comm.level, moved, moved, time.perf_counter() - t0)
    return buf


def _shm_one_sync(win, slots: list[torch.Tensor], seg: torch.Tensor, r: int) -> int:
    """One small segment of :func:`shm`: every rank copies it in; barrier; every rank sums the
    K slots in rank order into ``seg``. Returns the elements the others read of this rank's."""
    slots[r].copy_(seg)
    win.sync("allreduce.shm")
    torch.add(slots[0], slots[1], out=seg)
    for s in slots[2:]:
        seg.add_(s)
    return (len(slots) - 1) * seg.numel()


def _shm_two_syncs(win, slots: list[torch.Tensor], seg: torch.Tensor, r: int) -> int:
    """One segment of :func:`shm` cut into K chunks: the others' chunks in; barrier; this
    rank's chunk summed and stored; barrier; the others' sums out. Returns the elements the
    others read of this rank's slot."""
    K, L = len(slots), seg.numel()
    b = chunk_bounds(L, K)
    lo, hi = b[r], b[r + 1]
    mine = slots[r]
    mine[:lo].copy_(seg[:lo])
    mine[hi:].copy_(seg[hi:])
    win.sync("allreduce.shm")
    own = seg[lo:hi]
    for j in range(1, K):
        own.add_(slots[(r + j) % K][lo:hi])
    mine[lo:hi].copy_(own)
    win.sync("allreduce.shm")
    for j in range(K):
        if j != r:
            seg[b[j]:b[j + 1]].copy_(slots[j][b[j]:b[j + 1]])
    return (L - (hi - lo)) + (K - 1) * (hi - lo)


def _shm_in_place(comm: Comm, buf: torch.Tensor, win, peers: list[torch.Tensor],
                  average: bool = False) -> torch.Tensor:
    """:func:`shm` on a registered buffer (:meth:`~lowcomm.comm.comm.Comm.shared_tensor`): every
    rank's input already lies in the shared window, so nothing is staged. With the buffer cut
    into K chunks:

    1. barrier (every rank's input is written);
    2. rank r adds chunk r of the other K-1 ranks' buffers into its own (in the order r+1,
       r+2, ...; only rank r computes chunk r, so every rank ends with the same bits), divides
       it by K for an average (one pass over n/K instead of over n), then stores it into
       chunk r of every other rank's buffer (no rank reads chunk r of
       a buffer but rank r, so these stores race with nothing);
    3. barrier (every chunk has landed everywhere; no rank writes its buffer again while
       another still reads it).

    Each rank reads chunk r of the K buffers and writes chunk r of the K buffers: 2n bytes
    through memory at any K, what a memcpy of the buffer moves (the staged :func:`shm` moves
    ~3n, a ring 2(K-1)/K·n through the MPI library's transport plus its copies). Charged like
    :func:`shm`."""
    K, r, n = comm.size, comm.rank, buf.numel()
    t0 = time.perf_counter()
    b = chunk_bounds(n, K)
    win.sync("allreduce.shm")
    own = buf[b[r]:b[r + 1]]
    for j in range(1, K):
        own.add_(peers[(r + j) % K][b[r]:b[r + 1]])
    if average:
        own.div_(K)
    for j in range(K):
        if j != r:
            peers[j][b[r]:b[r + 1]].copy_(own)
    win.sync("allreduce.shm")
    moved = ((n - (b[r + 1] - b[r])) + (K - 1) * (b[r + 1] - b[r])) * buf.element_size()
    comm.ledger.record("shm", comm.level, moved, moved, time.perf_counter() - t0)
    return buf


def mpi(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
    """The vendor's ``MPI_Allreduce`` (its own choice of algorithm), as the reference."""
    return comm.allreduce_(buf)


def hierarchical(levels: "Levels", buf: torch.Tensor) -> torch.Tensor:
    """Hierarchical all-reduce over the levels of a topology (Horovod's hierarchical
    allreduce, Sergeev & Del Balso 2018, arXiv:1802.05799; BlueConnect, Cho et al. 2019), with
    ring reduce-scatter / all-gather phases (Thakur, Rabenseifner & Gropp 2005).

    ``levels``: the topology's communicators (:meth:`lowcomm.comm.topology.Topology.comms`), built
    once and passed in; it runs on ``levels.hierarchy``. By name, ``get_algorithm("hierarchical",
    levels=levels)`` gives the ``fn(comm, buf)`` form of the other algorithms.

    1. Cut the buffer into S shards, S = the largest innermost group (e.g. ranks of a node). In
       a group of s ranks, local rank l owns shards j ≡ l (mod s): unequal groups are allowed.
    2. Reduce-scatter inside the group: each rank holds its shards summed over the group —
       through the node's shared window when the group shares one node (as :func:`shm`),
       else around a ring.
    3. For each owned shard pattern, all-reduce the shards among their owners (one rank per
       group) by applying steps 1–4 again one level up; at the outermost level, a ring.
    4. All-gather inside the group (shared window or ring, as in step 2).

    Each phase is filed in the ledger at its own level (``reduce_scatter.shm|ring`` and
    ``allgather.shm|ring`` under the inner level, ``allreduce.ring`` under the outermost), so
    ``Ledger.by_level()`` shows the bytes that crossed each kind of link. With equal groups of
    g ranks, an n-byte all-reduce sends 2(g-1)/g·n inside and 2(G-1)/G·n/g across G groups.

    Example::

        comm = lowcomm.init()
        levels = Topology.parse("dc:2,rank:2").comms(comm)
        lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
    """
    if buf.numel() == 0:
        return buf
    return _hier_run(levels.hierarchy, buf)


hierarchical.files_own_levels = True   # allreduce_ must not fold its phases into one row


def _hier_run(h: "Hierarchy", buf: torch.Tensor) -> torch.Tensor:
    """Steps 1–4 of :func:`hierarchical` on one step's communicators ``h``."""
    if h.flat is not None:
        f = h.flat
        if f.size == 2:    # two parties: swap whole buffers and add: the ring's bytes, one round
            with f.ledger.scope("allreduce.exchange", f.level):
                tmp = torch.empty_like(buf)
                f.sendrecv_(buf, 1 - f.rank, tmp, 1 - f.rank)
                buf.add_(tmp)
        else:
            with f.ledger.scope("allreduce.ring", f.level):
                ring(f, buf)
        return buf
    b = chunk_bounds(buf.numel(), h.shards)
    blocks = [[(b[j], b[j + 1]) for j in owned] for owned in h.owned]
    inner = h.inner
    # ranks of one node reduce through their shared window (shm), others around a ring
    local = inner.size > 1 and inner.node_local()
    kind = "shm" if local else "ring"
    if inner.size > 1:
        with inner.ledger.scope(f"reduce_scatter.{kind}", inner.level):
            (_shm_reduce_scatter if local else ring_reduce_scatter)(inner, buf, blocks)
    for shards, sub in h.cross:
        ranges = [(b[j], b[j + 1]) for j in shards]
        if len(ranges) == 1:
            _hier_run(sub, buf[ranges[0][0]:ranges[0][1]])
        else:
            tmp = gather_ranges(buf, ranges)
            _hier_run(sub, tmp)
            scatter_ranges(buf, ranges, tmp)
    if inner.size > 1:
        with inner.ledger.scope(f"allgather.{kind}", inner.level):
            (_shm_allgather if local else ring_allgather)(inner, buf, blocks)
    return buf


def _clip(ranges, a: int, b: int):
    """The parts of ``ranges`` inside [a, b)."""
    return [(max(lo, a), min(hi, b)) for lo, hi in ranges if max(lo, a) < min(hi, b)]


def _shm_reduce_scatter(comm: Comm, buf, blocks) -> None:
    """Reduce-scatter through the node's shared window (see :func:`shm`): per segment, every
    rank copies it into its slot; barrier; rank r adds the other slots' parts of its blocks
    ``blocks[r]`` into its buffer. Charged what others read of my slot, (their blocks), and
    what I read of theirs, (K-1)·(my blocks): the ring's bytes."""
    K, r, es = comm.size, comm.rank, buf.element_size()
    win = _shm_window(comm, buf.numel() * buf.element_size())
    slots = [win.slot(j, buf.dtype) for j in range(K)]
    t0 = time.perf_counter()
    for a, L, off in _shm_segments(win, buf.numel(), es):
        slots[r][off:off + L].copy_(buf[a:a + L])
        win.sync("reduce_scatter.shm")
        for lo, hi in _clip(blocks[r], a, a + L):
            own = buf[lo:hi]
            for j in range(1, K):
                own.add_(slots[(r + j) % K][off + lo - a:off + hi - a])
    mine = ranges_size(blocks[r])
    comm.ledger.record("shm", comm.level, (buf.numel() - mine) * es, (K - 1) * mine * es,
                       time.perf_counter() - t0)


def _shm_allgather(comm: Comm, buf, blocks) -> None:
    """All-gather through the node's shared window: per segment, rank r copies its blocks into
    its slot; barrier; it copies every other rank's blocks from that rank's slot."""
    K, r, es = comm.size, comm.rank, buf.element_size()
    win = _shm_window(comm, buf.numel() * buf.element_size())
    slots = [win.slot(j, buf.dtype) for j in range(K)]
    t0 = time.perf_counter()
    for a, L, off in _shm_segments(win, buf.numel(), es):
        for lo, hi in _clip(blocks[r], a, a + L):
            slots[r][off + lo - a:off + hi - a].copy_(buf[lo:hi])
        win.sync("allgather.shm")
        for j in range(K):
            if j != r:
                for lo, hi in _clip(blocks[j], a, a + L):
                    buf[lo:hi].copy_(slots[j][off + lo - a:off + hi - a])
    mine = ranges_size(blocks[r])
    comm.ledger.record("shm", comm.level, (K - 1) * mine * es, (buf.numel() - mine) * es,
                       time.perf_counter() - t0)


# by name; "hierarchical" takes the topology's communicators instead of a comm (get_algorithm)
ALGORITHMS: dict[str, Algorithm] = {"mpi": mpi, "ring": ring, "rabenseifner": rabenseifner,
                                    "tree": tree, "shm": shm, "hierarchical": hierarchical}


#: every name an algorithm setting accepts: the algorithms and "auto"
ALGORITHM_NAMES = ("auto", *ALGORITHMS)


def choose(comm: Comm, nbytes: int, levels: "Levels | None" = None) -> str:
    """The algorithm ``"auto"`` runs for an all-reduce of ``nbytes`` on ``comm`` (collective the
    first time on a Comm: the ranks agree on the table; see :mod:`lowcomm.comm.tuning`)."""
    policy = agree(comm, measure=measure_table, shm_segment_bytes=SHM_SEGMENT_BYTES,
                   shm_one_sync_bytes=SHM_ONE_SYNC_BYTES)
    return policy.choose(nbytes, levels)


def _counts(n: int, parts: int) -> list[int]:
    bounds = chunk_bounds(n, parts)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def measure_table(comm: Comm, sizes=None, reps: int = 3) -> dict[int, dict[str, float]]:
    """``auto``'s table measured now (collective; :func:`lowcomm.comm.tuning.agree` runs it
    where the ranks share a node and no table exists): for each size (default
    :data:`~lowcomm.comm.tuning.TUNE_SIZES`) and each of ``mpi``, ``ring``, ``rabenseifner``,
    ``tree``, ``shm`` (and reduce-scatter's and all-gather's ``mpi``, ``ring``, ``shm``, as
    ``reduce_scatter.ring`` etc.), the median over ``reps`` calls (after two warm-ups) of the slowest rank's
    time in µs, the algorithms taking turns. On a duplicate of ``comm`` whose traffic is charged
    to no method; the shared window it used is freed."""
    import statistics

    from .ledger import Ledger
    from .tuning import TUNE_SIZES
    from .tuning import SCATTER_CANDIDATES, SCATTER_OPS
    runs = {a: (lambda b, c, a=a: allreduce_(b, c, a)) for a in ("mpi", "ring", "rabenseifner", "tree", "shm")}
    for op, fn in zip(SCATTER_OPS, (reduce_scatter, allgather_)):
        for a in SCATTER_CANDIDATES:
            runs[f"{op}.{a}"] = lambda b, c, fn=fn, a=a: fn(b, c, _counts(b.numel(), c.size), a)
    algs = tuple(runs)
    scratch = comm.dup(Ledger())
    scratch.validate = False
    out: dict[int, dict[str, float]] = {}
    try:
        for size in sizes or TUNE_SIZES:
            buf = torch.empty(size // 4)
            times: dict[str, list[float]] = {a: [] for a in algs}
            for i in range(2 + reps):              # two warm-ups (the first size's set-up)
                for alg in algs[i % len(algs):] + algs[:i % len(algs)]:
                    buf.fill_(1.0)
                    scratch.barrier()
                    t0 = time.perf_counter()
                    runs[alg](buf, scratch)
                    if i >= 2:
                        times[alg].append(time.perf_counter() - t0)
            mine = {a: statistics.median(t) for a, t in times.items()}
            every = scratch.allgather_object(mine)
            out[size] = {a: round(max(r[a] for r in every) * 1e6, 1) for a in algs}
    finally:
        scratch.free()
    return out


def get_algorithm(name: str, levels: "Levels | None" = None) -> Algorithm:
    """The all-reduce ``fn(comm, buf)`` called ``name``. ``"hierarchical"`` needs ``levels``
    (:meth:`lowcomm.comm.topology.Topology.comms`): it returns a function running
    :func:`hierarchical` on them (its ``comm`` argument is only the caller's view).
    ``"auto"`` returns a function choosing per call (:func:`choose`); it files each call under
    the algorithm it ran."""
    if name == "auto":
        def auto(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
            chosen = choose(comm, buf.numel() * buf.element_size(), levels)
            return get_algorithm(chosen, levels)(comm, buf)
        return auto
    if name not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; known: {', '.join(ALGORITHM_NAMES)}")
    if name != "hierarchical":
        return ALGORITHMS[name]
    if levels is None:
        raise LowcommError("the hierarchical all-reduce needs the topology's communicators: pass "
                           "levels=Topology.from_env(comm, spec).comms(comm) (lowcomm train builds "
                           "them from the topology setting)")

    def fn(comm: Comm, buf: torch.Tensor) -> torch.Tensor:
        if comm.size != levels.size:
            raise CommError("allreduce.hierarchical", comm.rank, f"the topology's levels span "
                            f"{levels.size} ranks, the communicator {comm.size}", buf.numel() * buf.element_size())
        return hierarchical(levels, buf)
    fn.files_own_levels = True
    return fn


def allreduce_(tensor: torch.Tensor, comm: Comm | None = None, algorithm: str = "auto",
               op: str = "sum", levels: "Levels | None" = None) -> torch.Tensor:
    """Sum (``op="sum"``) or average (``op="avg"``) ``tensor`` over ``comm`` in place.

    Any shape, length (0 included), rank count, float dtype and device. ``algorithm="auto"``
    (the default) runs the fastest algorithm for this size and rank count (:func:`choose`). The
    traffic is filed in ``comm.ledger`` as one ``allreduce.<algorithm run>`` call at
    ``comm.level`` (``hierarchical``:
    one row per phase and level, in the ledger of ``levels``, the topology's communicators it
    needs; see :func:`get_algorithm`).

    Example::

        comm = lowcomm.init()
        g = torch.full((1000,), float(comm.rank))
        lowcomm.allreduce_(g, algorithm="ring", op="avg")   # every element = (K-1)/2
    """
    comm = comm or init()
    registered = comm.registered(tensor) if algorithm in ("auto", "shm") and comm.size > 1 else None
    if algorithm == "auto":
        get_algorithm(algorithm, levels)        # the name is checked before any collective
        nbytes = tensor.numel() * tensor.element_size()
        algorithm = "shm" if registered and nbytes >= REGISTERED_MIN_BYTES else choose(comm, nbytes, levels)
    fn = get_algorithm(algorithm, levels)
    avg = _reduce_op(op)
    if algorithm == "mpi":
        return comm.allreduce_(tensor, op)  # checks, stages and records itself
    comm.check(f"allreduce.{algorithm}", tensor)
    if algorithm == "shm" and registered is not None:   # in place in shared memory, average fused
        with comm.ledger.scope("allreduce.shm", comm.level):
            _shm_in_place(comm, tensor.detach().view(-1), *registered, average=avg)
        return tensor
    with comm.staged(tensor) as buf:
        if getattr(fn, "files_own_levels", False):   # hierarchical: one row per level
            fn(comm, buf)
        else:
            with comm.ledger.scope(f"allreduce.{algorithm}", comm.level):
                fn(comm, buf)
        if avg:
            buf.div_(comm.size)
    return tensor


#: the algorithms of :func:`reduce_scatter` and :func:`allgather_` ("auto": on one node's CPU the
#: fastest in the measured table, :meth:`~lowcomm.comm.tuning.Policy.choose_scatter`; else mpi)
SCATTER_ALGORITHMS = ("auto", "mpi", "ring", "shm")


def _scatter_algorithm(comm: Comm, buf: torch.Tensor, algorithm: str, op: str) -> str:
    if algorithm not in SCATTER_ALGORITHMS:
        raise ConfigError("algorithm", f"unknown reduce-scatter/all-gather algorithm {algorithm!r}; "
                          f"known: {', '.join(SCATTER_ALGORITHMS)}")
    if algorithm == "shm" and not (buf.device.type == "cpu" and comm.node_local()):
        raise ConfigError("algorithm", "shm needs CPU tensors and every rank on one node")
    if algorithm == "auto":
        if not (buf.device.type == "cpu" and comm.node_local()):
            return "mpi"
        policy = agree(comm, measure=measure_table, shm_segment_bytes=SHM_SEGMENT_BYTES,
                       shm_one_sync_bytes=SHM_ONE_SYNC_BYTES)
        return policy.choose_scatter(op, buf.numel() * buf.element_size())
    return algorithm


def reduce_scatter(buf: torch.Tensor, comm: Comm, counts: list[int], algorithm: str = "auto",
                   op: str = "sum") -> torch.Tensor:
    """Sum (or average) flat ``buf`` over ``comm``; rank r gets block r (``counts[r]``
    elements, blocks in rank order). ``algorithm``: "mpi" (vendor ``MPI_Reduce_scatter``),
    "ring" (K−1 neighbour exchanges), "shm" (the node's shared window) or "auto" (on one node's
    CPU the fastest measured at this size, as the all-reduce's auto; else mpi). The ring and shm
    reduce in place in ``buf`` and return a view of it. Filed as ``reduce_scatter.<algorithm>``."""
    avg = _reduce_op(op)
    if comm.size == 1:
        return buf.view(-1)
    algorithm = _scatter_algorithm(comm, buf, algorithm, "reduce_scatter")
    if algorithm == "mpi":
        return comm.reduce_scatter(buf, counts, op)
    bounds = [sum(counts[:r]) for r in range(comm.size + 1)]
    blocks = [[(bounds[r], bounds[r + 1])] for r in range(comm.size)]
    comm.check(f"reduce_scatter.{algorithm}", buf)
    with comm.staged(buf) as h, comm.ledger.scope(f"reduce_scatter.{algorithm}", comm.level):
        (_shm_reduce_scatter if algorithm == "shm" else ring_reduce_scatter)(comm, h, blocks)
        mine = h[bounds[comm.rank]:bounds[comm.rank + 1]]
        if avg:
            mine.div_(comm.size)
    return buf.view(-1)[bounds[comm.rank]:bounds[comm.rank + 1]]


def allgather_(buf: torch.Tensor, comm: Comm, counts: list[int], algorithm: str = "auto") -> torch.Tensor:
    """In place: block r of flat ``buf`` (``counts``, in rank order) as rank r holds it, on
    every rank. ``algorithm`` as :func:`reduce_scatter` (vendor: ``MPI_Allgatherv``)."""
    if comm.size == 1:
        return buf
    algorithm = _scatter_algorithm(comm, buf, algorithm, "allgather")
    if algorithm == "mpi":
        return comm.allgather_blocks_(buf, counts)
    bounds = [sum(counts[:r]) for r in range(comm.size + 1)]
    blocks = [[(bounds[r], bounds[r + 1])] for r in range(comm.size)]
    comm.check(f"allgather.{algorithm}", buf)
    with comm.staged(buf) as h, comm.ledger.scope(f"allgather.{algorithm}", comm.level):
        (_shm_allgather if algorithm == "shm" else ring_allgather)(comm, h, blocks)
    return buf


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
