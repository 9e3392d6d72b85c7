"""Gradient compressors and 1-bit Adam on K ranks, every rank asserting:

* Comm.alltoall == the block transpose, ledger charged (K-1)·block;
* bytes: for every method, through SyncDP on a small model (one bucket, and one bucket per
  parameter), the ledger's bytes per step == the analytic payload computed here from the
  parameter shapes (independently of the compressors' code);
* every method trains (loss goes down, parameters agree on all ranks);
* sign-mv: the vote == sign(Σ signs) with 0 on ties; on 3 ranks with one rank sending flipped
  signs, SGD still descends;
* PowerSGD with full rank == the dense average, step after step (warm start and memory on);
* 1-bit Adam == torch Adam on the averaged gradient bit for bit during warm-up; afterwards the
  compressed all-reduce matches its definition, its running average converges (both error
  feedbacks), ranks agree, bytes match;
* state_dict round trip: a restored SyncDP+compressor / OneBitAdam continues bit-identically.

argv[1]: the compressors' collective, "allgather" (default) or "two-phase"; the sections that
do not depend on it (PowerSGD, 1-bit Adam) run with "allgather" only.
"""
import copy
import math
import sys

import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, seeded_mlp
from lowcomm.compress import COMPRESSORS, Compressor, PowerSGD, SignMajorityVote, build_compressor
from lowcomm.compress.base import Segment
from lowcomm.run.config import CompressorConfig
from lowcomm.comm.ledger import Ledger, wire_bytes
from lowcomm.strategies.onebit_adam import OneBitAdam

COLLECTIVE = sys.argv[1] if len(sys.argv) > 1 else "allgather"
comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)
ctl = comm.dup(Ledger(), "control")
ctl.validate = False
B = 8


def agree(t: torch.Tensor) -> bool:
    g = ctl.allgather(t.detach().contiguous())
    return all(torch.equal(g[0], g[k]) for k in range(K))


# 1. alltoall ------------------------------------------------------------------------------------
t = torch.tensor([[100 * r + j, -j] for j in range(K)], dtype=torch.int64)
before = comm.ledger.get("alltoall")
out = comm.alltoall(t)
ok(torch.equal(out, torch.tensor([[100 * j + r, -r] for j in range(K)])), f"alltoall {out.tolist()}")
got = comm.ledger.get("alltoall")
ok(got.bytes_sent - before.bytes_sent == (K - 1) * 16 and got.calls == before.calls + 1,
   "alltoall ledger")
try:
    comm.alltoall(torch.zeros(K + 1, 2))
    ok(False, "alltoall of a wrong first dimension")
except lowcomm.CommError as e:
    ok("shape (size=" in str(e), str(e))


# 2. bytes and training through SyncDP ---------------------------------------------------------
def make():
    return seeded_mlp(12, 40, 24, 3)


def batch(step, k=r):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(K * B, 12, generator=g)
    y = (x[:, :3].argmax(1) + (x[:, 3] > 1).long()) % 3
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


SHAPES = [tuple(p.shape) for p in make().parameters()]
RATIO, LEVELS, QBUCKET, RANK = 0.05, 8, 64, 2


def allreduce(nbytes):
    return wire_bytes("allreduce", nbytes, K)[0]


def chunks(n):
    q, rem = divmod(n, K)
    return [q + (j < rem) for j in range(K)]


def pieces(j):
    """Parameters of the bucket (NOW_SHAPES, in bucket order) with elements in chunk j."""
    c = chunks(NOW)
    lo, hi = sum(c[:j]), sum(c[:j + 1])
    ends = [0]
    for s in NOW_SHAPES:
        ends.append(ends[-1] + math.prod(s))
    return sum(1 for a, b in zip(ends, ends[1:]) if a < hi and b > lo)


def allgather(nbytes, per=None, server=None):
    """All-gather of ``nbytes``; with the two-phase collective ``per(m, P)`` is the payload of
    a chunk of m elements holding P pieces of parameters and ``server(m, P)`` the owner's
    re-compressed one (default ``per``)."""
    if COLLECTIVE == "allgather" or per is None:
        return (K - 1) * nbytes
    c = chunks(NOW)
    server = server or per
    return sum(per(c[j], pieces(j)) for j in range(K) if j != r and c[j]) + \
        ((K - 1) * server(c[r], pieces(r)) if c[r] else 0)


def bucket_bytes(name, shapes):
    """Analytic bytes sent per rank for one bucket holding ``shapes`` (in bucket order)."""
    global NOW, NOW_SHAPES
    n = NOW = sum(math.prod(s) for s in shapes)
    NOW_SHAPES, S = shapes, len(shapes)
    k = max(1, int(RATIO * n))
    if name == "none":
        return allreduce(4 * n)
    if name in ("fp16", "bf16"):
        return allreduce(2 * n)
    if name == "int8":
        return allgather(n + 4, lambda m, P: m + 4)
    if name == "qsgd":
        return allgather(n + 4 * -(-n // QBUCKET), lambda m, P: m + 4 * -(-m // QBUCKET))
    if name == "topk":
        return allgather(k * (4 + 4), lambda m, P: max(1, int(RATIO * m)) * 8)
    if name == "randomk":
        return allreduce(4 * k)
    # the 1-bit methods: + one bit per parameter (per piece of one in a chunk), "all zero"
    if name in ("sign", "ef-sign"):
        return allgather(-(-n // 8) + 4 + -(-S // 8), lambda m, P: -(-m // 8) + 4 + -(-P // 8))
    if name == "sign-mv":     # the vote: 1 bit on odd K, a base-3 digit (5 per byte) on even K
        return allgather(-(-n // 8) + -(-S // 8), lambda m, P: -(-m // 8) + -(-P // 8),
                         (lambda m, P: -(-m // 8) + -(-P // 8)) if K % 2 else (lambda m, P: -(-m // 5)))
    if name == "powersgd":
        p = q = 0
        for s in shapes:
            rows, cols = s[0], math.prod(s[1:])
            if len(s) >= 2 and rows * cols > RANK * (rows + cols):
                p, q = p + RANK * rows, q + RANK * cols
            else:
                p += math.prod(s)
        return allreduce(4 * p) + (allreduce(4 * q) if q else 0)
    raise KeyError(name)


def sent(ledger):
    return sum(row["bytes_sent"] for row in ledger.rows() if row["op"] != "check")


def syncdp(name, bucket_mb, lr=0.05, **extra):
    model = make()
    cfg = CompressorConfig(name=name, ratio=RATIO, levels=LEVELS, bucket_size=QBUCKET,
                           approx_rank=RANK, start_iter=0, collective=COLLECTIVE, **extra)
    run = comm.dup(Ledger())
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), run,
                         bucket_mb=bucket_mb, compressor=build_compressor(cfg))
    return model, opt, run


def train(model, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def full_loss(model):
    xs, ys = zip(*(batch(s, k) for s in range(3) for k in range(K)))
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)))


for name in COMPRESSORS:
    for bucket_mb, layout in ((64.0, [SHAPES[::-1]]), (1e-6, [[s] for s in SHAPES[::-1]])):
        # sign-mv's update has unit magnitude per coordinate: a smaller step
        model, opt, run = syncdp(name, bucket_mb, lr=0.005 if name == "sign-mv" else 0.05)
        start = full_loss(model)
        for step in range(3):
            before = sent(run.ledger)
            train(model, opt, 1, step)
            expected = sum(bucket_bytes(name, shapes) for shapes in layout)
            ok(sent(run.ledger) - before == expected,
               f"{name} bucket_mb={bucket_mb} step {step}: {sent(run.ledger) - before} bytes, "
               f"analytic {expected} ({run.ledger.rows()})")
        if bucket_mb == 64.0:
            train(model, opt, 40, 3)
            end = full_loss(model)
            ok(end < 0.9 * start, f"{name}: loss {start:.3f} -> {end:.3f}")
            ok(all(agree(p) for p in model.parameters()), f"{name}: parameters differ across ranks")
        opt.close()

# 3. sign-mv: the vote and the tie rule; descends with one rank flipping --------------------
x = torch.randn(101, generator=torch.Generator().manual_seed(7 + r))
x[::10] = 0.0
mv = Compressor(SignMajorityVote(), COLLECTIVE)
vote = mv.reduce(x.clone(), "v", comm, [])
signs = torch.where(torch.signbit(ctl.allgather(x)), -1.0, 1.0)
ok(torch.equal(vote, torch.sign(signs.sum(0))), "sign-mv == sign(Σ_k sign(x_k))")
if K % 2 == 0:
    ok(bool((vote == 0).any()), "an even rank count shows ties (0)")


class Flipped(SignMajorityVote):
    """A faulty rank: sends the signs of −x."""

    def encode(self, x, key, segments, rank=None):
        return super().encode(-x, key, segments, rank)


if K == 3:
    torch.manual_seed(0)
    A = torch.randn(30, 20, generator=torch.Generator().manual_seed(3))
    target = torch.randn(20, generator=torch.Generator().manual_seed(4))
    w = torch.nn.Linear(20, 1, bias=False)
    with torch.no_grad():
        w.weight.zero_()
    comp = Compressor(Flipped() if r == 2 else SignMajorityVote(), COLLECTIVE)
    opt = lowcomm.SyncDP(w, torch.optim.SGD(w.parameters(), lr=0.01), comm, compressor=comp)

    @torch.no_grad()
    def objective():
        return float(((A @ (w.weight.view(-1) - target)) ** 2).mean())

    f0 = objective()
    for step in range(300):
        noise = torch.randn(30, generator=torch.Generator().manual_seed(1000 * step + r)) * 0.1
        opt.zero_grad()
        (((A @ (w.weight.view(-1) - target)) + noise) ** 2).mean().backward()
        opt.step()
    opt.close()
    ok(objective() < 0.1 * f0, f"sign-mv with one flipping rank: {f0:.3f} -> {objective():.3f}")
    ok(agree(w.weight), "sign-mv: ranks agree")

if COLLECTIVE == "allgather":     # sections 4 and 5 do not use a compressor's collective
    # 4. PowerSGD full rank == dense ----------------------------------------------------------------
    segs, off = [], 0
    for name, shape in (("w1", (5, 9)), ("w2", (5, 5)), ("b", (7,)), ("w3", (5, 3, 2))):
        n = math.prod(shape)
        segs.append(Segment(name, torch.Size(shape), off, off + n))
        off += n
    ps = PowerSGD(approx_rank=5, start_iter=1, min_compression_rate=0.0)
    ok(len(ps.plan(segs)[0]) == 3, "every matrix compressed")
    for step in range(4):
        g = torch.randn(off, generator=torch.Generator().manual_seed(50 * step + r), dtype=torch.float64)
        dense = ctl.allgather(g).mean(0)
        approx = Compressor(ps).reduce(g.clone(), "bucket0", comm, segs)
        ok(torch.allclose(approx, dense, rtol=0, atol=1e-10),
           f"PowerSGD full rank step {step}: {float((approx - dense).abs().max()):.3g}")
    try:
        Compressor(PowerSGD(approx_rank=6)).reduce(g.clone(), "x", comm, segs)
        ok(False, "approx_rank 6 > 5 accepted")
    except ValueError as e:
        ok("'w1'" in str(e) and "5×9" in str(e), str(e))
    # a bfloat16 model: the orthogonalisation runs in float32 (torch has no bfloat16 QR), the
    # full-rank average equals the dense one up to bfloat16's rounding
    ps = PowerSGD(approx_rank=5, start_iter=0, min_compression_rate=0.0)
    g = torch.randn(off, generator=torch.Generator().manual_seed(60 + r)).to(torch.bfloat16)
    approx = Compressor(ps).reduce(g.clone(), "bf16", comm, segs)
    dense = ctl.allgather(g.float()).mean(0)
    ok(approx.dtype == torch.bfloat16 and torch.allclose(approx.float(), dense, rtol=0, atol=0.05),
       f"PowerSGD on bfloat16: {approx.dtype}, off by {float((approx.float() - dense).abs().max()):.3g}")

    # 5. 1-bit Adam ---------------------------------------------------------------------------------
    FREEZE, LR = 4, 0.01


    def onebit(steps, model=None, opt=None, first=0):
        if model is None:
            model = make()
            opt = OneBitAdam(model, torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01),
                             comm.dup(Ledger()), freeze_step=FREEZE)
        train(model, opt, steps, first)
        return model, opt


    def reference_adam(steps):
        """torch Adam on the average of the K ranks' gradients (summed in rank order)."""
        model = make()
        adam = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01)
        for step in range(steps):
            grads = []
            for k in range(K):
                model.zero_grad()
                x, y = batch(step, k)
                F.cross_entropy(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                total = grads[0][i].clone()
                for k in range(1, K):
                    total += grads[k][i]
                p.grad = total / K
            adam.step()
        return model


    model, opt = onebit(FREEZE)
    ref = reference_adam(FREEZE)
    same = [torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    if K == 2:   # a sum of two is the same in any order: bit for bit
        ok(all(same), "1-bit Adam warm-up == torch Adam bit for bit")
    else:
        ok(all(torch.allclose(p, q, rtol=0, atol=1e-7) for p, q in zip(model.parameters(), ref.parameters())),
           "1-bit Adam warm-up == torch Adam")
    d = sum(p.numel() for p in model.parameters())
    ok(opt._comm.ledger.get("allreduce.mpi").bytes_sent == FREEZE * allreduce(4 * d), "warm-up bytes")
    ledger = opt._comm.ledger
    b0 = sent(ledger)
    onebit(1, model, opt, FREEZE)
    D = -(-d // (8 * K)) * 8 * K
    ok(sent(ledger) - b0 == 2 * (K - 1) * (D // (8 * K) + 4),
       f"compressed step bytes {sent(ledger) - b0}, analytic {2 * (K - 1) * (D // (8 * K) + 4)}")
    start = full_loss(model)
    onebit(40, model, opt, FREEZE + 1)
    ok(full_loss(model) < 0.8 * start, f"1-bit Adam: loss {start:.3f} -> {full_loss(model):.3f}")
    ok(all(agree(p) for p in model.parameters()), "1-bit Adam: parameters agree across ranks")

    # the compressed all-reduce against its definition (first call: zero errors)
    model = make()
    ob = OneBitAdam(model, torch.optim.Adam(model.parameters()), comm.dup(Ledger()), freeze_step=1)
    u = torch.zeros(ob.D)
    u[:d] = torch.randn(d, generator=torch.Generator().manual_seed(9 + r))
    U = ctl.allgather(u)                                      # (K, D)


    def C(v, n):      # (‖v‖₂/√n) sign(v), sign(+0) = +1
        return torch.linalg.vector_norm(v) / math.sqrt(n) * torch.where(torch.signbit(v), -1.0, 1.0)


    worker = torch.stack([C(U[k], d) for k in range(K)])
    c = ob.chunk
    expect = torch.zeros(ob.D)
    for j in range(K):
        real = max(0, min(c, d - j * c))
        w = worker[:, j * c:(j + 1) * c].mean(0)
        if real:
            expect[j * c:j * c + real] = C(w[:real], real)
    m = ob.compressed_allreduce(u.clone())
    ok(torch.allclose(m[:d], expect[:d], rtol=1e-5, atol=1e-6), "compressed all-reduce == definition")
    ok(agree(m), "compressed all-reduce: ranks agree")
    # a constant input: the running mean of the error-compensated outputs converges to the average
    acc = m.clone()
    T = 60
    for _ in range(T - 1):
        acc += ob.compressed_allreduce(u.clone())
    mean_u = U.mean(0)
    err = float(torch.linalg.vector_norm(acc[:d] / T - mean_u[:d]) / torch.linalg.vector_norm(mean_u[:d]))
    ok(err < 0.1, f"error feedback: running mean off by {err:.3f}")
    one = float(torch.linalg.vector_norm(m[:d] - mean_u[:d]) / torch.linalg.vector_norm(mean_u[:d]))
    ok(err < 0.2 * one, f"error feedback must shrink the error: {one:.3f} -> {err:.3f}")
    ob.close()

# 6. state_dict round trip: continue bit-identically ------------------------------------------
for name in [n for n in COMPRESSORS if n != "none"] + (["onebit-adam"] if COLLECTIVE == "allgather" else []):
    if name == "onebit-adam":
        model, opt = onebit(FREEZE + 2)
    else:
        model, opt, _ = syncdp(name, 1e-6)
        train(model, opt, 4)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 3, 10)
    if name == "onebit-adam":
        model2 = make()
        opt2 = OneBitAdam(model2, torch.optim.Adam(model2.parameters(), lr=LR, weight_decay=0.01),
                          comm.dup(Ledger()), freeze_step=FREEZE)
    else:
        model2, opt2, _ = syncdp(name, 1e-6)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, 3, 10)
    ok(all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters())),
       f"{name}: restored run differs")
    opt.close()
    opt2.close()
ok.report()
