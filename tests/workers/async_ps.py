"""AsyncPS under mpirun (first ``SERVERS`` ranks serve, the rest train).

* ``max_staleness = 0`` with plain SGD equals one process doing large-batch SGD over the W
  workers' batches, and equals SyncDP on the workers' communicator; with momentum too (the
  servers' optimizer state), with DC-ASGD and the staleness-aware lr switched on (both are
  exact no-ops at staleness 0: a wrong backup or version would show), with a compressor whose
  context must travel, and with a skipped step.
* the ledger's push and pull bytes are what the messages hold;
* SSP (τ = 1) with one worker sleeping: from every worker's own timestamps, no worker ever
  started a step more than τ clocks ahead of another worker's pushes; the servers' clock-lag
  histogram agrees and reaches τ; fully asynchronous (τ = -1) lets the lag grow past it.
usage: async_ps.py SERVERS
"""
import sys
import time

import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, random_batch, seeded_mlp
from lowcomm.compress import COMPRESSORS, Compressor, build_compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies.async_ps import AsyncPS

comm = lowcomm.init()
K, r = comm.size, comm.rank
S = int(sys.argv[1])
W = K - S
ok = Checks(r)
B, STEPS = 4, 5
server = r < S
w = r - S


def make():
    return seeded_mlp(10, 32, 32, 3)


def batch(step):
    return random_batch(step, W * B)


def reference(momentum=0.0, skip=None):
    """One process, batch W·B; ``skip=(worker, step)`` drops that worker's half of that step."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(STEPS):
        x, y = batch(step)
        if skip and skip[1] == step:
            keep = torch.ones(W * B, dtype=torch.bool)
            keep[skip[0] * B:(skip[0] + 1) * B] = False
            x, y = x[keep], y[keep]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


class Half(Compressor):
    """fp16 on the wire; the context (the original dtype) has to reach the server."""
    name = "half"

    def compress(self, x, key, segments):
        return [x.half()], ("dtype", x.dtype)

    def decompress(self, payload, ctx):
        assert ctx == ("dtype", torch.float32), ctx
        return payload[0].to(ctx[1])


def run(tau=0, momentum=0.0, skip=None, slow_ms=0.0, trace=None, **kw):
    model = make()
    if not server:   # workers start apart: the initial pull must fix that
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * r)
    ps = AsyncPS(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), comm,
                 servers=S, max_staleness=tau, **kw)
    if ps.is_server:
        ps.serve()
        ps.close()
        return model, ps
    for step in range(STEPS):
        if trace is not None:
            trace.append((time.time(), ps.clock))
        if slow_ms and w == 0:
            time.sleep(slow_ms / 1000)
        x, y = batch(step)
        x, y = x[w * B:(w + 1) * B], y[w * B:(w + 1) * B]
        ps.zero_grad()
        loss = F.cross_entropy(model(x), y)
        ps.note_loss(loss.item())
        loss.backward()
        if skip == (w, step):
            ps.skip()
        else:
            ps.step()
    ps.done()
    ps.close()
    return model, ps


def same(model, ps, ref, what, rtol=1e-5, atol=1e-6):
    """Workers hold the whole model; a server only its shard."""
    mine = set(ps.shards[ps.index].names) if ps.is_server else None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if mine is None or name in mine:
            ok(torch.allclose(p, q, rtol=rtol, atol=atol),
               f"{what}: {name} differs from the reference by {float((p - q).detach().abs().max()):.3g}")


ref = reference()
model, ps = run()
same(model, ps, ref, "tau=0 plain SGD")
if ps.is_server:
    st = ps.server.stats()
    ok(st["staleness"] == {0: STEPS * W} and st["clock_lag"] == {0: STEPS * W}, f"staleness {st}")
    ok(st["applied"] == [STEPS] * W and st["version"] == STEPS, f"counters {st}")
    n = ps.shards[ps.index].numel * 4
    push, pull = comm.ledger.get("push"), comm.ledger.get("pull")
    ok(push.calls == STEPS * W and STEPS * W * n < push.bytes_recv < STEPS * W * (n + 512),
       f"server push bytes {push}")
    ok(pull.calls == (STEPS + 1) * W and pull.bytes_sent == (STEPS + 1) * W * (n + 64),
       f"server pull bytes {pull}")
else:
    sizes = [sh.numel * 4 for sh in ps.shards]
    push, pull = comm.ledger.get("push"), comm.ledger.get("pull")
    ok(push.calls == STEPS * S and STEPS * sum(sizes) < push.bytes_sent < STEPS * (sum(sizes) + 512 * S),
       f"worker push bytes {push}")
    ok(pull.bytes_recv == (STEPS + 1) * sum(n + 64 for n in sizes), f"worker pull bytes {pull}")
    ok(ps.lag_hist == {0: STEPS}, f"worker lag {ps.lag_hist}")

# SyncDP on the workers alone, same data: the same parameters
sub = comm.split(0 if not server else -1)
if not server:
    m = make()
    opt = lowcomm.SyncDP(m, torch.optim.SGD(m.parameters(), lr=0.1), sub)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(m(x[w * B:(w + 1) * B]), y[w * B:(w + 1) * B]).backward()
        opt.step()
    opt.close()
    same(model, ps, m, "tau=0 vs SyncDP")

same(*run(momentum=0.9), reference(momentum=0.9), "tau=0 momentum")
same(*run(dc_lambda=0.5, staleness_lr=True), ref, "tau=0 with DC-ASGD and staleness lr")
same(*run(overlap=False), ref, "tau=0 without overlap")
same(*run(compressor=Half()), ref, "tau=0 fp16 pushes", rtol=1e-2, atol=1e-3)
model, ps = run(skip=(W - 1, 2), nonfinite="skip")
same(model, ps, reference(skip=(W - 1, 2)), "tau=0, last worker skips step 2")
if ps.is_server:
    ok(ps.server.stats()["skipped"] == [0] * (W - 1) + [1], "skip counted")
for name in COMPRESSORS:       # every registered compressor's payloads and context travel
    if name != "none":
        model, ps = run(tau=-1, compressor=build_compressor(CompressorConfig(name=name)))
        ok(all(bool(torch.isfinite(p).all()) for p in model.parameters()), f"compressor {name}")

# SSP: worker 0 sleeps 30 ms per step; the others may run at most τ clocks ahead
for tau in (1, -1):
    trace = []
    model, ps = run(tau=tau, slow_ms=30, trace=trace)
    traces = comm.allgather_object(trace)
    if ps.is_server:
        lags = ps.server.stats()["clock_lag"]
        if tau == 1:
            ok(max(lags) == tau, f"SSP clock lag {lags} must reach τ={tau} and never pass it")
        elif W > 1:
            ok(max(lags) > 1, f"fully asynchronous: the lag {lags} should pass 1")
    if tau == 1 and not server:
        # worker w began clock c at time t only after every worker had pushed c - τ gradients,
        # so each had begun at least c - τ steps before t
        for t, c in trace:
            for v in range(S, K):
                begun = sum(1 for tv, _ in traces[v] if tv < t)
                ok(begun >= c - tau, f"worker {w} began clock {c} at {t:.3f} when worker "
                   f"{v - S} had begun only {begun} steps (τ={tau})")

ok.report()
