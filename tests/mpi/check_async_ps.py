"""The asynchronous parameter server against trusted references, on 4 ranks.

The first ``S = 2`` ranks serve (sharded), the other two train; every rank asserts (a server on
its shard and its counters, a worker on its model).

* ``max_staleness = 0`` with plain SGD equals one process doing large-batch SGD over the W
  workers' batches, and equals SyncDP on the workers' communicator; with momentum too (the
  servers' optimizer state), with DC-ASGD and the staleness-aware lr switched on (both are
  exact no-ops at staleness 0: a wrong backup or version would show), with a compressor whose
  context must travel, and with a skipped step.
* the ledger's push and pull bytes are what the messages hold;
* SSP (τ = 1) with one worker sleeping: from every worker's own timestamps, no worker ever
  started a step more than τ clocks ahead of another worker's pushes; the servers' clock-lag
  histogram agrees and reaches τ; fully asynchronous (τ = -1) lets the lag grow past it.
"""
import time

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import random_batch, seeded_mlp
from lowcomm.compress import COMPRESSORS, Compressor, build_compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies.ps.async_ps import AsyncPS
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(4,))
S = 2
K, W = SIZE, SIZE - S
SERVER, w = RANK < S, RANK - S
B, STEPS = 4, 5


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


def run(comm, tau=0, momentum=0.0, skip=None, slow_ms=0.0, trace=None, **kw):
    model = make()
    if not SERVER:   # workers start apart: the initial pull must fix that
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * RANK)
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


def assert_same(model, ps, ref, what, rtol=1e-5, atol=1e-6):
    """Workers hold the whole model; a server only its shard."""
    mine = set(ps.shards[ps.index].names) if ps.is_server else None
    off = [f"{name} by {float((p - q).detach().abs().max()):.3g}"
           for (name, p), q in zip(model.named_parameters(), ref.parameters())
           if (mine is None or name in mine) and not torch.allclose(p, q, rtol=rtol, atol=atol)]
    assert not off, f"{what}: {', '.join(off)} differ from the reference"


@pytest.fixture(scope="module")
def synchronous(comm):
    """τ = 0, plain SGD: (model, AsyncPS, its push row, its pull row of the ledger)."""
    push, pull = comm.ledger.get("push"), comm.ledger.get("pull")
    model, ps = run(comm)
    return model, ps, delta(comm.ledger.get("push"), push), delta(comm.ledger.get("pull"), pull)


def delta(after, before):
    return type(after)(**{k: getattr(after, k) - getattr(before, k) for k in ("calls", "bytes_sent", "bytes_recv")})


def test_synchronous_ps_equals_large_batch_sgd_with_the_messages_bytes(synchronous):
    model, ps, push, pull = synchronous
    assert_same(model, ps, reference(), "tau=0 plain SGD")
    if ps.is_server:
        st = ps.server.stats()
        n = ps.shards[ps.index].numel * 4
        assert st["staleness"] == {0: STEPS * W} and st["clock_lag"] == {0: STEPS * W}, f"staleness {st}"
        assert st["applied"] == [STEPS] * W and st["version"] == STEPS, f"counters {st}"
        assert push.calls == STEPS * W and STEPS * W * n < push.bytes_recv < STEPS * W * (n + 512), \
            f"server push bytes {push}"
        assert pull.calls == (STEPS + 1) * W and pull.bytes_sent == (STEPS + 1) * W * (n + 64), \
            f"server pull bytes {pull}"
    else:
        sizes = [sh.numel * 4 for sh in ps.shards]
        assert push.calls == STEPS * S and STEPS * sum(sizes) < push.bytes_sent < STEPS * (sum(sizes) + 512 * S), \
            f"worker push bytes {push}"
        assert pull.bytes_recv == (STEPS + 1) * sum(n + 64 for n in sizes), f"worker pull bytes {pull}"
        assert ps.lag_hist == {0: STEPS}, f"worker lag {ps.lag_hist}"


def test_synchronous_ps_equals_syncdp_on_the_workers(comm, synchronous):
    model, ps, _, _ = synchronous
    sub = comm.split(0 if not SERVER else -1)
    if SERVER:
        assert sub is None, "a server in the workers' communicator"
        return
    m = make()
    opt = lowcomm.SyncDP(m, torch.optim.SGD(m.parameters(), lr=0.1), sub)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(m(x[w * B:(w + 1) * B]), y[w * B:(w + 1) * B]).backward()
        opt.step()
    opt.close()
    assert_same(model, ps, m, "tau=0 vs SyncDP")


VARIANTS = {
    "momentum": (dict(momentum=0.9), dict(momentum=0.9), {}),
    "dc-asgd-and-staleness-lr": (dict(dc_lambda=0.5, staleness_lr=True), {}, {}),
    "no-overlap": (dict(overlap=False), {}, {}),
    "fp16-pushes": (dict(compressor=Half), {}, dict(rtol=1e-2, atol=1e-3)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_synchronous_ps_variants_equal_large_batch_sgd(variant, comm):
    kw, ref_kw, tol = VARIANTS[variant]
    kw = {k: v() if isinstance(v, type) else v for k, v in kw.items()}
    assert_same(*run(comm, **kw), reference(**ref_kw), f"tau=0 {variant}", **tol)


def test_a_skipped_step_drops_that_workers_batch_and_is_counted(comm):
    model, ps = run(comm, skip=(W - 1, 2), nonfinite="skip")
    assert_same(model, ps, reference(skip=(W - 1, 2)), "tau=0, the last worker skips step 2")
    if ps.is_server:
        assert ps.server.stats()["skipped"] == [0] * (W - 1) + [1], "the skip is not counted"


@pytest.mark.parametrize("name", [n for n in COMPRESSORS if n != "none"])
def test_every_compressors_payloads_and_context_travel(name, comm):
    model, ps = run(comm, tau=-1, compressor=build_compressor(CompressorConfig(name=name)))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "non-finite parameters"


def test_ssp_keeps_every_worker_within_tau_of_the_others(comm):
    """Worker 0 sleeps 30 ms per step; the others may run at most τ = 1 clocks ahead."""
    tau, trace = 1, []
    model, ps = run(comm, tau=tau, slow_ms=30, trace=trace)
    traces = comm.allgather_object(trace)
    if ps.is_server:
        lags = ps.server.stats()["clock_lag"]
        assert max(lags) == tau, f"SSP clock lag {lags} must reach τ={tau} and never pass it"
        return
    # worker w began clock c at time t only after every worker had pushed c - τ gradients, so
    # each had begun at least c - τ steps before t
    for t, c in trace:
        for v in range(S, K):
            begun = sum(1 for tv, _ in traces[v] if tv < t)
            assert begun >= c - tau, f"worker {w} began clock {c} at {t:.3f} when worker {v - S} had " \
                f"begun only {begun} steps (τ={tau})"


def test_fully_asynchronous_lets_the_lag_pass_1(comm):
    model, ps = run(comm, tau=-1, slow_ms=30, trace=[])
    if ps.is_server:
        lags = ps.server.stats()["clock_lag"]
        assert max(lags) > 1, f"fully asynchronous: the lag {lags} should pass 1"
    else:
        assert ps.clock == STEPS, f"worker {w} took {ps.clock} steps"
