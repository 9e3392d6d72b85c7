"""Local SGD / DiLoCo / streaming DiLoCo on K ranks against trusted references, every rank
asserting. Sections (argv[1]):

equivalence
  * ``LocalSGD(period=1) == SyncDP`` for SGD and momentum SGD; ``warmup_steps`` steps of LocalSGD
    are SyncDP steps; ranks agree after an averaging and differ inside a period;
  * ``DiLoCo(outer SGD, lr 1, no momentum) == LocalSGD`` (same period) with SGD and AdamW inside;
  * ``StreamingDiLoCo(1 fragment, delay 0, alpha 0) == DiLoCo`` (Nesterov outer);
  * DiLoCo (Nesterov) and streaming DiLoCo (P fragments, τ > 0, α > 0) == a single-process
    simulation of K workers written from the papers (hand-written Nesterov, no lowcomm code);
  * the pseudo-gradient through ``Compressor.reduce`` (identity) == the dense path, and every
    registered compressor runs (outer parameters equal on all ranks, finite);
  * ledger: one DiLoCo sync moves one all-reduce of the model; P fragments ≈ 1/P each.
resume
  * run N steps, save ``state_dict()``, rebuild fresh objects, load, continue == uninterrupted,
    bit for bit (in-flight fragments, warm-up, compressor memory).
errors
  * period < 1, fragments > parameter tensors, delay >= period, … raise ConfigError naming the key
    before any communication.
"""
import io
import sys

import torch
import torch.nn.functional as F

import lowcomm
from common import Checks, seeded_mlp, random_batch
from lowcomm.compress import COMPRESSORS, Compressor, build_compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies import DiLoCo, LocalSGD, StreamingDiLoCo, SyncDP

comm = lowcomm.init()
K, r = comm.size, comm.rank
ok = Checks(r)
B = 4
SECTION = sys.argv[1]


N_TENSORS = 8


def make(perturb=True):
    net = seeded_mlp(10, 32, 32, 3, unused=True)
    if perturb:   # ranks start apart: the strategy's broadcast from rank 0 must fix that
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * r)
    return net


def batch(step, k=None):
    x, y = random_batch(step, K * B)
    k = r if k is None else k
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def sgd(params, momentum=0.0):
    return torch.optim.SGD(params, lr=0.1, momentum=momentum)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def train(cls, steps, inner=sgd, model=None, first=0, strategy=None, **kw):
    """``steps`` steps of ``cls`` (a Strategy class); returns (model, strategy), left open."""
    model = model or make()
    opt = strategy or cls(model, inner(model.parameters()), comm, **kw)
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def run(cls, steps, inner=sgd, **kw):
    model, opt = train(cls, steps, inner, **kw)
    opt.close()
    return model


def equal(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        ok(torch.equal(p, q), f"{what}: {name} differs by {float((p - q).detach().abs().max()):.3g}")


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def agree(t):
    """Whether every rank holds the same tensor."""
    seen = comm.allgather(t.contiguous())
    return all(torch.equal(seen[k], seen[0]) for k in range(K))


def simulate(steps, inner, period, fragments, delay, alpha, lr=0.7, mu=0.9, nesterov=True,
             merge="mix"):
    """K workers in one process, from the papers: inner steps, then per fragment p at local step
    s with s % H == offset_p: Δ_p = mean_k(θ_p − θ_{k,p}); after step s + τ: Nesterov (or plain)
    SGD on θ_p with Δ_p, and θ_{k,p} ← α θ_{k,p} + (1 − α) θ_p (merge "mix", Douillard et al.)
    or θ_{k,p} ← θ_p + θ_{k,p} − θ_{k,p}(s) (merge "add-local", DaSGD). Returns worker r's model."""
    models = [make(perturb=False) for _ in range(K)]
    opts = [inner(m.parameters()) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    outer = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    buf = {}
    pending = []                                  # (apply_at, members, {name: Δ}, [{name: θ_k(s)}])

    def apply(item):
        _, members, delta, sent = item
        for n in members:
            buf[n] = mu * buf[n] + delta[n] if n in buf else delta[n].clone()
            outer[n] = outer[n] - lr * (delta[n] + mu * buf[n] if nesterov else buf[n])
            with torch.no_grad():
                for k, m in enumerate(models):
                    p = dict(m.named_parameters())[n]
                    if merge == "add-local":
                        p.copy_(outer[n] + (p - sent[k][n]))
                    else:
                        p.copy_(alpha * p + (1 - alpha) * outer[n])

    for step in range(steps):
        for k in range(K):
            x, y = batch(step, k)
            opts[k].zero_grad()
            F.cross_entropy(models[k](x), y).backward()
            opts[k].step()
        s = step + 1
        for late in (False, True):   # earlier starts land first; a τ = 0 start lands at once
            for item in [i for i in pending if i[0] == s]:
                pending.remove(item)
                apply(item)
            if not late:
                for members, offset in fragments:
                    if s % period == offset:
                        delta = {n: sum(outer[n] - dict(m.named_parameters())[n].detach()
                                        for m in models) / K for n in members}
                        sent = [{n: dict(m.named_parameters())[n].detach().clone() for n in members}
                                for m in models]
                        pending.append((s + delay, members, delta, sent))
    assert set(names) == {n for f, _ in fragments for n in f}
    return models[r]


def layout(strategy):
    return [([n for n, _, _, _ in f.members], f.offset) for f in strategy.fragments]


if SECTION == "equivalence":
    # LocalSGD(period=1) == SyncDP, plain and momentum SGD
    for mom in (0.0, 0.9):
        inner = lambda ps, mom=mom: sgd(ps, mom)  # noqa: E731
        ref = run(SyncDP, 5, inner)
        ok.models_close(run(LocalSGD, 5, inner, period=1), ref, f"localsgd period 1 vs syncdp, momentum {mom}")
    # warm-up steps are SyncDP steps
    ok.models_close(run(LocalSGD, 3, period=4, warmup_steps=3), run(SyncDP, 3), "localsgd warm-up vs syncdp")
    # inside a period ranks drift apart (different data); an averaging brings them together
    model, opt = train(LocalSGD, 2, period=3)
    ok(K == 1 or not agree(flat(model)), "ranks should differ inside a period")
    train(None, 1, model=model, first=2, strategy=opt)
    ok(agree(flat(model)), "ranks should agree after an averaging")
    ok(opt.syncs and opt.syncs[-1][0] == 3, f"one sync at step 3, got {opt.syncs}")
    opt.close()
    # the sensitivity of the comparison: period 3 is not SyncDP
    far = flat(run(LocalSGD, 5, period=3)) - flat(run(SyncDP, 5))
    ok(K == 1 or float(far.abs().max()) > 1e-4, "localsgd period 3 should differ from syncdp")

    # DiLoCo with outer SGD lr 1, no momentum == LocalSGD, same period (7 steps: ends mid-period)
    plain = dict(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
    for name, inner in (("sgd", sgd), ("adamw", adamw)):
        ok.models_close(run(DiLoCo, 7, inner, period=3, **plain), run(LocalSGD, 7, inner, period=3),
              f"diloco outer sgd lr 1 vs localsgd ({name} inside)")
    ok.models_close(run(DiLoCo, 7, period=3, warmup_steps=2, **plain), run(LocalSGD, 7, period=3, warmup_steps=2),
          "diloco vs localsgd with warm-up")

    # StreamingDiLoCo(1 fragment, delay 0, alpha 0) == DiLoCo (Nesterov outer)
    for name, inner in (("sgd", sgd), ("adamw", adamw)):
        equal(run(StreamingDiLoCo, 8, inner, period=3, fragments=1, delay=0, alpha=0.0),
              run(DiLoCo, 8, inner, period=3), f"streaming (P=1, τ=0) vs diloco ({name} inside)")

    # against the single-process simulation of K workers
    sim = simulate(8, sgd, 3, [([n for n, _ in make().named_parameters()], 0)], 0, 0.0)
    ok.models_close(run(DiLoCo, 8, period=3), sim, "diloco (nesterov) vs simulation")
    sim = simulate(8, sgd, 3, [([n for n, _ in make().named_parameters()], 0)], 0, 0.0, lr=0.5,
                   mu=0.5, nesterov=False)
    ok.models_close(run(DiLoCo, 8, period=3, outer_optimizer="sgd", outer_lr=0.5, outer_momentum=0.5), sim,
          "diloco (heavy-ball outer) vs simulation")
    for P, delay, alpha, merge, inner in ((3, 1, 0.5, "mix", sgd), (2, 3, 0.0, "mix", adamw),
                                          (N_TENSORS, 2, 0.25, "mix", sgd), (2, 3, 0.0, "add-local", adamw),
                                          (N_TENSORS, 1, 0.0, "add-local", sgd)):
        model, st = train(StreamingDiLoCo, 11, inner, period=4, fragments=P, delay=delay, alpha=alpha,
                          merge=merge)
        st.close()
        ok(len({f.offset for f in st.fragments}) == min(P, 4), f"staggered offsets {layout(st)}")
        sim = simulate(11, inner, 4, layout(st), delay, alpha, merge=merge)
        ok.models_close(model, sim, f"streaming P={P} τ={delay} α={alpha} {merge} vs simulation")
    # the sensitivity: add-local keeps the τ steps' progress, mix (α = 0) drops it
    far = flat(run(StreamingDiLoCo, 11, period=4, fragments=2, delay=3, merge="add-local")) - \
        flat(run(StreamingDiLoCo, 11, period=4, fragments=2, delay=3))
    ok(float(far.abs().max()) > 1e-4, "add-local should differ from mix at τ > 0")
    # at τ = 0 there is no local progress to keep: add-local == mix, bit for bit
    equal(run(StreamingDiLoCo, 8, period=3, fragments=2, delay=0, merge="add-local"),
          run(StreamingDiLoCo, 8, period=3, fragments=2, delay=0), "add-local at τ = 0 vs mix")

    # compressed pseudo-gradient: the Compressor.reduce path with the identity == dense
    ok.models_close(run(StreamingDiLoCo, 8, period=3, fragments=2, delay=1, compressor=Compressor()),
          run(StreamingDiLoCo, 8, period=3, fragments=2, delay=1), "identity compressor vs dense")
    for cname in COMPRESSORS:
        if cname == "none":
            continue
        comp = build_compressor(CompressorConfig(name=cname, start_iter=0))
        model, st = train(StreamingDiLoCo, 9, period=3, fragments=2, delay=1, compressor=comp)
        state = st.state_dict()
        st.close()
        ok(all(agree(p.detach()) for p in st.outer_params), f"{cname}: outer parameters agree")
        ok(all(bool(torch.isfinite(p).all()) for p in st.outer_params), f"{cname}: finite")
        ok("compressor" in state, f"{cname}: compressor state saved")

    # the two-phase compressed all-reduce serves the pseudo-gradient too: the bytes of every
    # fragment's sync are its analytic volume (int8: chunks of c_j elements + one scale each)
    comp = build_compressor(CompressorConfig(name="int8", collective="two-phase"))
    _, st = train(StreamingDiLoCo, 12, period=6, fragments=3, delay=2, compressor=comp)
    st.close()
    for _, f, b in st.syncs:
        q, rem = divmod(st.fragments[f].numel, K)
        c = [q + (j < rem) for j in range(K)]
        want = sum(c[j] + 4 for j in range(K) if j != comm.rank) + (K - 1) * (c[comm.rank] + 4)
        ok(b == want, f"int8 two-phase fragment {f}: {b} bytes, analytic {want}")
    ok(all(agree(p.detach()) for p in st.outer_params), "int8 two-phase: outer parameters agree")

    # ledger: a DiLoCo sync is one dense all-reduce of the parameters; fragments split it
    n_bytes = 4 * sum(p.numel() for p in make().parameters())
    _, st = train(DiLoCo, 6, period=3)
    st.close()
    ok([s for s, _, _ in st.syncs] == [3, 6], f"diloco syncs at 3 and 6: {st.syncs}")
    ok(all(b == 2 * (K - 1) * n_bytes // K for _, _, b in st.syncs), f"diloco sync bytes {st.syncs}")
    _, st = train(StreamingDiLoCo, 12, period=6, fragments=3, delay=2)
    st.close()
    numel = [f.numel for f in st.fragments]
    ok(sum(numel) == n_bytes // 4, f"fragments cover the model once: {numel}")
    ok(all(b == 2 * (K - 1) * 4 * numel[f] // K for _, f, b in st.syncs), f"fragment bytes {st.syncs}")
    ok(sorted(s for s, _, _ in st.syncs) == [2, 4, 6, 8, 10, 12], f"staggered syncs {st.syncs}")
    ok([f for _, f, _ in st.syncs] == [0, 1, 2] * 2, f"fragment order {st.syncs}")

elif SECTION == "resume":
    def saved(st, model):
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "strategy": st.state_dict()}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    cases = [
        ("streaming, in flight", StreamingDiLoCo, adamw, 7,
         dict(period=4, fragments=2, delay=2, alpha=0.5, warmup_steps=2)),
        ("streaming add-local, in flight", StreamingDiLoCo, adamw, 6,
         dict(period=4, fragments=2, delay=3, merge="add-local")),
        ("streaming, in warm-up", StreamingDiLoCo, adamw, 1,
         dict(period=4, fragments=2, delay=2, alpha=0.5, warmup_steps=2)),
        ("localsgd momentum, in warm-up", LocalSGD, lambda ps: sgd(ps, 0.9), 2,
         dict(period=3, warmup_steps=3)),
        ("diloco nesterov", DiLoCo, adamw, 4, dict(period=3)),
    ]
    for cname in COMPRESSORS:
        if cname != "none":
            cases.append((f"streaming + {cname}", StreamingDiLoCo, sgd, 5,
                          dict(period=3, fragments=2, delay=1,
                               compressor=CompressorConfig(name=cname, start_iter=0))))
    TOTAL = 11
    for what, cls, inner, at, kw in cases:
        def kwargs():
            if "compressor" in kw:
                return {**kw, "compressor": build_compressor(kw["compressor"])}
            return kw
        ref = run(cls, TOTAL, inner, **kwargs())
        model, st = train(cls, at, inner, **kwargs())
        if what.endswith("in flight"):
            ok(bool(st._in_flight), f"{what}: a reduction should be in flight at step {at}")
        state = saved(st, model)
        st.close()
        fresh = make()
        with torch.no_grad():
            for p in fresh.parameters():
                p.mul_(-1.0)        # the load, not the init, must decide
        st2 = cls(fresh, inner(fresh.parameters()), comm, **kwargs())
        fresh.load_state_dict(state["model"])
        st2.load_state_dict(state["strategy"])
        train(None, TOTAL - at, model=fresh, first=at, strategy=st2)
        st2.close()
        equal(fresh, ref, f"resume {what} at step {at}")

elif SECTION == "errors":
    from lowcomm.errors import ArgumentError

    def raises(key, fn, *words):
        """A wrong Python argument is an ArgumentError naming the argument (not a config key)."""
        try:
            fn()
        except ArgumentError as e:
            ok(e.key == key and f"argument '{key}'" in str(e) and all(w in str(e) for w in words),
               f"expected {key} {words}: {e}")
            return
        ok(False, f"no ArgumentError for {key}")

    m = make()
    o = sgd(m.parameters())
    raises("period", lambda: LocalSGD(m, o, comm, period=0), ">= 1")
    raises("period", lambda: DiLoCo(m, o, comm, period=0), ">= 1")
    raises("fragments", lambda: StreamingDiLoCo(m, o, comm, period=20, fragments=N_TENSORS + 1),
           f"only {N_TENSORS} trainable parameter tensors")
    raises("delay", lambda: StreamingDiLoCo(m, o, comm, period=4, fragments=2, delay=4), "period=4")
    raises("alpha", lambda: StreamingDiLoCo(m, o, comm, period=4, alpha=1.5))
    raises("merge", lambda: StreamingDiLoCo(m, o, comm, period=4, merge="average"), "add-local")
    raises("alpha", lambda: StreamingDiLoCo(m, o, comm, period=4, merge="add-local", alpha=0.5),
           "alpha = 0")
    raises("outer_momentum", lambda: DiLoCo(m, o, comm, period=4, outer_momentum=0.0), "Nesterov")
    raises("outer_optimizer", lambda: DiLoCo(m, o, comm, period=4, outer_optimizer="adam"))
    # the job goes on after a refused construction: communication is still in step
    t = torch.ones(3)
    comm.allreduce_(t)
    ok(torch.equal(t, torch.full((3,), float(K))), "communication after the errors")
else:
    raise SystemExit(f"unknown section {SECTION!r}")
ok.report()
