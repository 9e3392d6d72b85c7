"""Comm's own calls on every rank: point-to-point, non-blocking, bcast, allgather, split, the
ledger's per-level accounting, and the metadata check that turns mismatched tensors into a
CommError on every rank instead of a hang or corrupt memory."""
import torch

import lowcomm
from common import Checks
from lowcomm.comm.ledger import wire_bytes

comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)

# blocking and non-blocking point-to-point around a ring
right, left = (r + 1) % K, (r - 1) % K
got = torch.empty(5, dtype=torch.float64)
comm.sendrecv_(torch.full((5,), float(r), dtype=torch.float64), right, got, left)
ok(torch.equal(got, torch.full((5,), float(left), dtype=torch.float64)), "sendrecv")
box = torch.empty(3, dtype=torch.bfloat16)
reqs = [comm.irecv_(box, left, tag=7), comm.isend(torch.full((3,), r + 0.5, dtype=torch.bfloat16), right, tag=7)]
for q in reqs:
    q.wait()
ok(torch.equal(box, torch.full((3,), left + 0.5, dtype=torch.bfloat16)), "isend/irecv bfloat16")

# non-blocking vendor all-reduce
t = torch.full((10,), float(r))
req = comm.iallreduce_(t, op="avg")
req.wait()
ok(torch.allclose(t, torch.full((10,), (K - 1) / 2)), "iallreduce avg")

# broadcast and allgather
b = torch.arange(4.0) if r == 0 else torch.zeros(4)
comm.bcast_(b, root=0)
ok(torch.equal(b, torch.arange(4.0)), "bcast")
g = comm.allgather(torch.tensor([r, 10 * r]))
ok(torch.equal(g, torch.tensor([[i, 10 * i] for i in range(K)])), "allgather")

# split: even and odd ranks, traffic filed under the new level
sub = comm.split(r % 2, level="half")
ok(sub.size == (K + 1 - r % 2) // 2, f"split size {sub.size}")
x = torch.ones(8)
sub.allreduce_(x)
ok(torch.equal(x, torch.full((8,), float(sub.size))), "allreduce on split")
row = comm.ledger.get("allreduce.mpi", level="half")
ok(row.calls == 1 and row.bytes_sent == wire_bytes("allreduce", 32, sub.size)[0], f"level row {row}")
none = comm.split(-1)
ok(none is None, "negative colour gives no communicator")

# mismatched shapes / dtypes: CommError on every rank, naming op, rank and shapes
if K > 1:
    bad = torch.ones(4 if r == 0 else 5)
    try:
        lowcomm.allreduce_(bad, comm, "ring")
        ok(False, "mismatched shapes were reduced")
    except lowcomm.CommError as e:
        msg = str(e)
        ok(f"rank {r}" in msg and "allreduce.ring" in msg and "rank 0: float32[4]" in msg
           and "rank 1: float32[5]" in msg, msg)
    bad = torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
    try:
        comm.allreduce_(bad)
        ok(False, "mismatched dtypes were reduced")
    except lowcomm.CommError as e:
        ok("float64[4]" in str(e) and "float32[4]" in str(e), str(e))
    try:  # different algorithms on different ranks would deadlock: caught too
        lowcomm.allreduce_(torch.ones(4), comm, "ring" if r == 0 else "tree")
        ok(False, "mixed algorithms ran")
    except lowcomm.CommError as e:
        ok("another op" in str(e), str(e))
    # the communicator still works after the error
    y = torch.ones(2)
    comm.allreduce_(y)
    ok(torch.equal(y, torch.full((2,), float(K))), "usable after CommError")
    # with validation off, nothing extra is sent
    quiet = comm.dup()
    quiet.validate = False
    before = comm.ledger.get("check")
    quiet.allreduce_(torch.ones(2))
    ok(comm.ledger.get("check").calls == before.calls, "validate=False skips the check")

try:
    comm.send(torch.ones(4)[::2], right)
    ok(False, "non-contiguous send accepted")
except lowcomm.CommError as e:
    ok("contiguous" in str(e), str(e))
ok.report()
