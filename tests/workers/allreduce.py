"""Every all-reduce algorithm (and "auto") against vendor MPI_Allreduce, on every rank.

Sizes 0, 1, 7, 1000 (not divisible by K), a 2-D tensor, a non-contiguous view and ~1M elements;
float32/64/16 and bfloat16; sum and average. Integer-valued data must match exactly (every
dtype holds these sums exactly); random float32/64 data must match to rounding. The ledger's
bytes must equal each algorithm's exact message volume. ``shm`` also runs with tiny segments
(many segments, both halves of its window, one- and two-barrier paths). ``auto``: every rank runs
the same algorithm (the one in a table only rank 0 can read), the nearest measured size decides,
a table of the wrong rank count is an error on every rank, and without a table the α–β rule.
"""
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import lowcomm
from common import Checks
import lowcomm.comm.collectives as C
from lowcomm.comm.collectives import chunk_bounds

comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 1000, (1 << 20) + 3]


def vendor_sum(t: torch.Tensor) -> np.ndarray:
    ref = t.double().numpy().copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    return ref


def expected_bytes(alg: str, n: int, es: int) -> int:
    """Exact bytes this rank sends for one all-reduce of n elements of es bytes."""
    if K == 1 or n == 0:
        return 0
    if alg == "ring":
        b = chunk_bounds(n, K)
        size = lambda i: b[i % K + 1] - b[i % K]  # noqa: E731
        return es * (sum(size(r - s) for s in range(K - 1)) + sum(size(r + 1 - s) for s in range(K - 1)))
    if alg == "tree":
        children, m = 0, 1
        while m < K and not r & m:
            children += r + m < K
            m <<= 1
        parent = 1 if r else 0
        # reduce: n to the parent; broadcast: n to each child (the same children)
        return es * n * (parent + children)
    if alg == "mpi":
        return 2 * (K - 1) * n * es // K
    if alg == "shm":   # per segment: the others' chunks of my copy, my sum K-1 times
        seg = max(1, C.SHM_SEGMENT_BYTES // es)
        total = 0
        for a in range(0, n, seg):
            L = min(seg, n - a)
            if L * es <= C.SHM_ONE_SYNC_BYTES:
                total += (K - 1) * L
            else:
                b = chunk_bounds(L, K)
                total += (L - (b[r + 1] - b[r])) + (K - 1) * (b[r + 1] - b[r])
        return es * total
    if alg == "rabenseifner":
        p = 1 << (K.bit_length() - 1)
        q = K - p
        if r < 2 * q and r % 2 == 0:
            return es * n
        b = chunk_bounds(n, p)
        me = r // 2 if r < 2 * q else r - q
        total, lo, hi, d = 0, 0, p, p // 2
        while d >= 1:
            mid = (lo + hi) // 2
            give = (lo, mid) if me & d else (mid, hi)
            total += b[give[1]] - b[give[0]]
            lo, hi = ((mid, hi) if me & d else (lo, mid))
            d //= 2
        d = 1
        while d < p:
            total += b[hi] - b[lo]
            lo, hi = (lo - d, hi) if me & d else (lo, hi + d)
            d *= 2
        return es * (total + (n if r < 2 * q else 0))
    raise AssertionError(alg)


for alg in [a for a in lowcomm.ALGORITHMS if a != "hierarchical"]:  # per-level rows: test_topology
    for n in SIZES:
        for dt in DTYPES:
            g = torch.Generator().manual_seed(1000 * r + n)
            # integer-valued data: exact in every dtype, so any error is a real bug
            t = torch.randint(-4, 5, (n,), generator=g).to(dt)
            ref = vendor_sum(t)
            before = comm.ledger.get(f"allreduce.{alg}")
            out = lowcomm.allreduce_(t, comm, alg)
            after = comm.ledger.get(f"allreduce.{alg}")
            ok(out is t, "allreduce_ must return its argument")
            ok(np.array_equal(t.double().numpy(), ref), f"{alg} n={n} {dt}: differs from MPI_Allreduce")
            ok(after.calls == before.calls + 1, f"{alg}: one ledger call per all-reduce")
            ok(after.bytes_sent - before.bytes_sent == expected_bytes(alg, n, t.element_size()),
               f"{alg} n={n} {dt}: ledger {after.bytes_sent - before.bytes_sent} bytes, expected "
               f"{expected_bytes(alg, n, t.element_size())}")
            # average
            a = torch.randint(-4, 5, (n,), generator=g).to(dt)
            ref = vendor_sum(a) / K
            lowcomm.allreduce_(a, comm, alg, op="avg")
            tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6
            ok(np.allclose(a.double().numpy(), ref, rtol=tol, atol=tol), f"{alg} avg n={n} {dt}")
    for dt in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(7 + r)
        t = torch.randn(4099, generator=g, dtype=dt)
        ref = vendor_sum(t)
        lowcomm.allreduce_(t, comm, alg)
        ok(np.allclose(t.double().numpy(), ref, rtol=1e-5, atol=1e-5), f"{alg} random {dt}")
    # shapes: 2-D, and a non-contiguous view written back in place
    m = torch.full((3, 5), float(r + 1))
    lowcomm.allreduce_(m, comm, alg)
    ok(torch.equal(m, torch.full((3, 5), K * (K + 1) / 2)), f"{alg} 2-D")
    base = torch.zeros(6, 4)
    view = base[:, 1]
    view.fill_(r + 1.0)
    lowcomm.allreduce_(view, comm, alg)
    ok(torch.equal(base[:, 1], torch.full((6,), K * (K + 1) / 2)) and base[:, 0].eq(0).all(),
       f"{alg} non-contiguous")

# shm with small segments: many segments alternate the window's halves; both barrier paths
saved = C.SHM_SEGMENT_BYTES, C.SHM_ONE_SYNC_BYTES
C.SHM_SEGMENT_BYTES, C.SHM_ONE_SYNC_BYTES = 4096, 1024
small = comm.dup()          # a fresh window sized for these segments
for n in (1, 5, 1000, 1025, 20011):
    for dt in (torch.float32, torch.bfloat16):
        t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(n + r)).to(dt)
        ref = vendor_sum(t)
        before = small.ledger.get("allreduce.shm").bytes_sent
        lowcomm.allreduce_(t, small, "shm")
        ok(np.array_equal(t.double().numpy(), ref), f"shm segmented n={n} {dt}")
        ok(small.ledger.get("allreduce.shm").bytes_sent - before == expected_bytes("shm", n, t.element_size()),
           f"shm segmented n={n} {dt}: ledger bytes")
C.SHM_SEGMENT_BYTES, C.SHM_ONE_SYNC_BYTES = saved

# auto: every rank runs the algorithm rank 0's table names, at the nearest measured size
tmp = Path(tempfile.gettempdir()) / f"lowcomm-auto-{os.getppid()}-{K}"
table = tmp / "table.json"
if r == 0:
    tmp.mkdir(exist_ok=True)
    table.write_text(json.dumps({"ranks": K, "times_us": {
        "4096": {"mpi": 50.0, "tree": 10.0, "ring": 90.0},
        "1048576": {"mpi": 900.0, "ring": 500.0, "shm": 700.0}}}))
# only rank 0 can read it: the others' path does not exist, yet all follow rank 0
os.environ[lowcomm.comm.tuning.TABLE_ENV] = str(table if r == 0 else tmp / f"missing-{r}.json")
tabled = comm.dup()
tabled.auto_policy = None
for nbytes, want in ((4096, "tree"), (64 << 10, "tree"), (300 << 10, "ring"), (64 << 20, "ring")):
    got = C.choose(tabled, nbytes) if K > 1 else "mpi"
    ok(got == (want if K > 1 else "mpi"), f"auto at {nbytes} bytes chose {got}, table says {want}")
    ok(len(set(comm.allgather_object(got))) == 1, f"auto at {nbytes}: ranks disagree")
for n in (0, 3, 1024, 300000):
    t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(n + 7 * r)).float()
    ref = vendor_sum(t)
    chosen = C.choose(tabled, 4 * n)
    before = tabled.ledger.get(f"allreduce.{chosen}").calls
    lowcomm.allreduce_(t, tabled, "auto")
    ok(np.array_equal(t.double().numpy(), ref), f"auto n={n} ({chosen}) differs from MPI_Allreduce")
    ok(tabled.ledger.get(f"allreduce.{chosen}").calls == before + 1, f"auto n={n}: filed under {chosen}")
# a table measured on another rank count: an error on every rank, naming the file
if r == 0:
    table.write_text(json.dumps({"ranks": K + 1, "times_us": {"4096": {"mpi": 1.0}}}))
wrong = comm.dup()
wrong.auto_policy = None
comm.barrier()
if K > 1:
    try:
        lowcomm.allreduce_(torch.ones(4), wrong, "auto")
        ok(False, "a table of another rank count accepted")
    except lowcomm.LowcommError as e:
        ok(str(table) in str(e) and f"{K + 1} ranks" in str(e), str(e))
else:
    ok(True, "one rank: no table needed")
# no table: the α–β rule (the vendor here: the model never picks shm, only a table does)
os.environ[lowcomm.comm.tuning.TABLE_ENV] = str(tmp / "none.json")
model = comm.dup()
model.auto_policy = None
for nbytes in (4096, 16 << 20):
    got = C.choose(model, nbytes)
    want = "mpi"
    ok(got == want, f"α–β auto at {nbytes} bytes on {K} ranks chose {got}, the rule says {want}")
comm.barrier()
if r == 0:
    table.unlink(missing_ok=True)
    tmp.rmdir()

# the analytic ring volume 2(K-1)/K·n when K divides n
n = 1024 * K
before = comm.ledger.get("allreduce.ring").bytes_sent
lowcomm.allreduce_(torch.ones(n), comm, "ring")
ok(comm.ledger.get("allreduce.ring").bytes_sent - before == 2 * (K - 1) * n * 4 // K, "ring 2(K-1)/K·n")

try:
    lowcomm.allreduce_(torch.ones(3), comm, "butterfly")
    ok(False, "unknown algorithm accepted")
except ValueError as e:
    ok("ring" in str(e) and "butterfly" in str(e), str(e))
ok.report()
