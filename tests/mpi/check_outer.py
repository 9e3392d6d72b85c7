"""Local SGD, DiLoCo and streaming DiLoCo against trusted references, every rank asserting.

equivalence (2 and 3 ranks)
  * ``LocalSGD(period=1) == SyncDP`` for SGD and momentum SGD; ``warmup_steps`` steps of LocalSGD
    are SyncDP steps; ranks agree after an averaging and differ inside a period;
  * ``DiLoCo(outer SGD, lr 1, no momentum) == LocalSGD`` (same period) with SGD and AdamW inside;
  * ``StreamingDiLoCo(1 fragment, delay 0, alpha 0) == DiLoCo`` (Nesterov outer);
  * DiLoCo (Nesterov) and streaming DiLoCo (P fragments, τ > 0, α > 0) == a single-process
    simulation of K workers written from the papers (hand-written Nesterov, no lowcomm code);
  * the pseudo-gradient through ``Compressor.reduce`` (identity) == the dense path, and every
    registered compressor runs (outer parameters equal on all ranks, finite);
  * ledger: one DiLoCo sync moves one all-reduce of the model; P fragments ≈ 1/P each;
  * DiLoCo with dynamic local updates: with every member taking every step, DiLoCo bit for bit;
    with the last rank slowed, it takes fewer steps of each period and passes over the others,
    and the outer parameters are the tokens-weighted average of the local models
    (Liu et al. 2024's weighting, checked against the gathered local models).
resume (2 ranks)
  * run N steps, save ``state_dict()``, rebuild fresh objects, load, continue == uninterrupted,
    bit for bit (in-flight fragments, warm-up, compressor memory);
  * a member that rejoins with a donor's state while a round is in flight (a fleet's heal) holds
    θ' plus only its own progress when the round lands, and is not charged the donor's traffic.
errors (2 ranks)
  * period < 1, fragments > parameter tensors, delay >= period, … raise ArgumentError naming the argument
    before any communication.
"""
import io

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import assert_models_close, assert_models_equal, flat, random_batch, seeded_mlp
from lowcomm.compress import COMPRESSORS, Compressor, build_compressor
from lowcomm.errors import ArgumentError
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies import DiLoCo, LocalSGD, StreamingDiLoCo, SyncDP
from lowcomm.strategies.outer.dylu import DyLUDiLoCo
from lowcomm.strategies.outer.route import Route
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2, 3))
on_two = pytest.mark.mpi(sizes=(2,))
K, B = SIZE, 4
N_TENSORS = 8
LOSSY = [name for name in COMPRESSORS if name != "none"]


def make(perturb=True):
    net = seeded_mlp(10, 32, 32, 3, unused=True)
    if perturb:   # ranks start apart: the strategy's broadcast from rank 0 must fix that
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * RANK)
    return net


def batch(step, k=RANK):
    x, y = random_batch(step, K * B)
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


def sgd(params, momentum=0.0):
    return torch.optim.SGD(params, lr=0.1, momentum=momentum)


def momentum_sgd(params):
    return sgd(params, 0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


INNER = {"sgd": sgd, "adamw": adamw}


def train(cls, steps, inner=sgd, model=None, first=0, strategy=None, **kw):
    """``steps`` steps of ``cls`` (a Strategy class) on the world; returns (model, strategy),
    left open."""
    model = model or make()
    opt = strategy or cls(model, inner(model.parameters()), lowcomm.init(), **kw)
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


def agree(t):
    """Whether every rank holds the same tensor."""
    seen = lowcomm.init().allgather(t.contiguous())
    return all(torch.equal(seen[k], seen[0]) for k in range(K))


def inner_steps(models, opts, step):
    """One inner step of each of K simulated workers on its own batch."""
    for k in range(K):
        x, y = batch(step, k)
        opts[k].zero_grad()
        F.cross_entropy(models[k](x), y).backward()
        opts[k].step()


def simulate(steps, inner, period, fragments, delay, alpha, lr=0.7, mu=0.9, nesterov=True,
             merge="mix"):
    """K workers in one process, from the papers: inner steps, then per fragment p at local step
    s with s % H == offset_p: Δ_p = mean_k(θ_p − θ_{k,p}); after step s + τ: Nesterov (or plain)
    SGD on θ_p with Δ_p, and θ_{k,p} ← α θ_{k,p} + (1 − α) θ_p (merge "mix", Douillard et al.)
    or θ_{k,p} ← θ_p + θ_{k,p} − θ_{k,p}(s) (merge "add-local", DaSGD); merge "eager" (Kale et al.
    2025): at s worker k restarts from θ̃_k = the outer step on g̃_k = Δ̄_p^prev + (Δ_{k,p} −
    Δ_{k,p}^prev)/K (θ_p and momentum untouched), and after s + τ takes θ_p + θ_{k,p} − θ̃_k.
    Returns this rank's model."""
    models = [make(perturb=False) for _ in range(K)]
    opts = [inner(m.parameters()) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    outer = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    buf = {}
    pending = []                                  # (apply_at, members, {name: Δ}, [{name: θ_k(s)}])
    last_avg = {n: torch.zeros_like(outer[n]) for n in names}           # eager: Δ̄^prev
    last_mine = [{n: torch.zeros_like(outer[n]) for n in names} for _ in range(K)]   # Δ_k^prev

    def outer_step(n, g):
        b = mu * buf[n] + g if n in buf else g.clone()
        return outer[n] - lr * (g + mu * b if nesterov else b), b

    def apply(item):
        _, members, delta, sent = item
        for n in members:
            outer[n], buf[n] = outer_step(n, delta[n])
            last_avg[n] = delta[n]
            with torch.no_grad():
                for k, m in enumerate(models):
                    p = dict(m.named_parameters())[n]
                    if merge in ("add-local", "eager"):
                        p.copy_(outer[n] + (p - sent[k][n]))
                    else:
                        p.copy_(alpha * p + (1 - alpha) * outer[n])

    for step in range(steps):
        inner_steps(models, opts, step)
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
                        if merge == "eager":
                            for k, m in enumerate(models):
                                params = dict(m.named_parameters())
                                for n in members:
                                    mine = outer[n] - sent[k][n]
                                    proxy = last_avg[n] + (mine - last_mine[k][n]) / K
                                    last_mine[k][n] = mine
                                    sent[k][n] = outer_step(n, proxy)[0]
                                    with torch.no_grad():
                                        params[n].copy_(sent[k][n])
                        pending.append((s + delay, members, delta, sent))
    assert set(names) == {n for f, _ in fragments for n in f}
    return models[RANK]


def layout(strategy):
    return [([n for n, _, _, _ in f.members], f.offset) for f in strategy.fragments]


def whole_model():
    return [([n for n, _ in make().named_parameters()], 0)]


# equivalence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_localsgd_period_1_equals_syncdp(momentum):
    inner = lambda ps: sgd(ps, momentum)  # noqa: E731
    assert_models_close(run(LocalSGD, 5, inner, period=1), run(SyncDP, 5, inner), "localsgd vs syncdp")


def test_localsgd_warm_up_steps_are_syncdp_steps():
    assert_models_close(run(LocalSGD, 3, period=4, warmup_steps=3), run(SyncDP, 3), "warm-up vs syncdp")


def test_ranks_drift_inside_a_period_and_agree_after_an_averaging():
    model, opt = train(LocalSGD, 2, period=3)
    inside = agree(flat(model))
    train(None, 1, model=model, first=2, strategy=opt)
    after = agree(flat(model))
    opt.close()
    assert not inside, "ranks should differ inside a period (different data)"
    assert after, "ranks should agree after an averaging"
    assert opt.syncs and opt.syncs[-1][0] == 3, f"one sync at step 3, got {opt.syncs}"


def test_localsgd_period_3_is_not_syncdp():
    """The comparisons' sensitivity."""
    far = flat(run(LocalSGD, 5, period=3)) - flat(run(SyncDP, 5))
    assert float(far.abs().max()) > 1e-4


PLAIN_OUTER = dict(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)


@pytest.mark.parametrize("inner", INNER)
def test_diloco_with_outer_sgd_lr_1_equals_localsgd(inner):
    """7 steps: it ends mid-period."""
    assert_models_close(run(DiLoCo, 7, INNER[inner], period=3, **PLAIN_OUTER),
                        run(LocalSGD, 7, INNER[inner], period=3), f"diloco vs localsgd ({inner} inside)")


def test_diloco_equals_localsgd_with_warm_up():
    assert_models_close(run(DiLoCo, 7, period=3, warmup_steps=2, **PLAIN_OUTER),
                        run(LocalSGD, 7, period=3, warmup_steps=2), "diloco vs localsgd with warm-up")


@pytest.mark.parametrize("inner", INNER)
def test_streaming_with_one_fragment_no_delay_and_alpha_0_equals_diloco(inner):
    assert_models_equal(run(StreamingDiLoCo, 8, INNER[inner], period=3, fragments=1, delay=0, alpha=0.0),
                        run(DiLoCo, 8, INNER[inner], period=3), f"streaming vs diloco ({inner} inside)")


def test_diloco_nesterov_equals_the_simulation():
    assert_models_close(run(DiLoCo, 8, period=3), simulate(8, sgd, 3, whole_model(), 0, 0.0),
                        "diloco (nesterov) vs simulation")


def test_diloco_heavy_ball_equals_the_simulation():
    sim = simulate(8, sgd, 3, whole_model(), 0, 0.0, lr=0.5, mu=0.5, nesterov=False)
    got = run(DiLoCo, 8, period=3, outer_optimizer="sgd", outer_lr=0.5, outer_momentum=0.5)
    assert_models_close(got, sim, "diloco (heavy-ball outer) vs simulation")


@pytest.mark.parametrize("P, delay, alpha, merge, inner", [
    (3, 1, 0.5, "mix", "sgd"), (2, 3, 0.0, "mix", "adamw"), (N_TENSORS, 2, 0.25, "mix", "sgd"),
    (2, 3, 0.0, "add-local", "adamw"), (N_TENSORS, 1, 0.0, "add-local", "sgd"),
    (1, 2, 0.0, "eager", "adamw"), (3, 3, 0.0, "eager", "sgd")])
def test_streaming_equals_the_simulation(P, delay, alpha, merge, inner):
    model, st = train(StreamingDiLoCo, 11, INNER[inner], period=4, fragments=P, delay=delay,
                      alpha=alpha, merge=merge)
    st.close()
    assert len({f.offset for f in st.fragments}) == min(P, 4), f"staggered offsets {layout(st)}"
    sim = simulate(11, INNER[inner], 4, layout(st), delay, alpha, merge=merge)
    assert_models_close(model, sim, "streaming vs simulation")


def test_add_local_keeps_the_delays_progress_that_mix_drops():
    """The sensitivity: add-local differs from mix (α = 0) at τ > 0."""
    far = flat(run(StreamingDiLoCo, 11, period=4, fragments=2, delay=3, merge="add-local")) - \
        flat(run(StreamingDiLoCo, 11, period=4, fragments=2, delay=3))
    assert float(far.abs().max()) > 1e-4


def test_eager_updates_differ_from_add_local_and_keep_the_outer_state_agreed():
    """The sensitivity: restarting from the eager outer step is not add-local; θ and the outer
    momentum stay the exact average's on every rank (only the local models differ)."""
    model, st = train(StreamingDiLoCo, 11, adamw, period=4, delay=2, merge="eager")
    st.close()
    far = flat(model) - flat(run(StreamingDiLoCo, 11, adamw, period=4, delay=2, merge="add-local"))
    assert float(far.abs().max()) > 1e-5
    assert all(agree(p.detach()) for p in st.outer_params), "outer parameters differ across ranks"
    assert all(agree(v) for s in st.outer_optimizer.state.values() for v in s.values()
               if torch.is_tensor(v)), "outer momentum differs across ranks"
    assert not agree(flat(model)), "the local models should differ after the eager restarts"


def test_add_local_at_delay_0_equals_mix_bit_for_bit():
    """At τ = 0 there is no local progress to keep."""
    assert_models_equal(run(StreamingDiLoCo, 8, period=3, fragments=2, delay=0, merge="add-local"),
                        run(StreamingDiLoCo, 8, period=3, fragments=2, delay=0), "add-local vs mix")


def test_the_identity_compressor_equals_the_dense_pseudo_gradient():
    """Through the Compressor.reduce path."""
    assert_models_close(run(StreamingDiLoCo, 8, period=3, fragments=2, delay=1, compressor=Compressor()),
                        run(StreamingDiLoCo, 8, period=3, fragments=2, delay=1), "identity vs dense")


@pytest.mark.parametrize("cname", LOSSY)
def test_every_compressor_compresses_the_pseudo_gradient(cname):
    comp = build_compressor(CompressorConfig(name=cname, start_iter=0))
    model, st = train(StreamingDiLoCo, 9, period=3, fragments=2, delay=1, compressor=comp)
    state = st.state_dict()
    st.close()
    assert all(agree(p.detach()) for p in st.outer_params), "outer parameters differ across ranks"
    assert all(bool(torch.isfinite(p).all()) for p in st.outer_params), "not finite"
    assert "compressor" in state, "compressor state not saved"


def test_int8_two_phase_moves_each_fragments_analytic_bytes():
    """int8: chunks of c_j elements + one scale each."""
    comp = build_compressor(CompressorConfig(name="int8", collective="two-phase"))
    _, st = train(StreamingDiLoCo, 12, period=6, fragments=3, delay=2, compressor=comp)
    st.close()
    assert st.syncs, "no sync"
    for _, f, b in st.syncs:
        q, rem = divmod(st.fragments[f].numel, K)
        c = [q + (j < rem) for j in range(K)]
        want = sum(c[j] + 4 for j in range(K) if j != RANK) + (K - 1) * (c[RANK] + 4)
        assert b == want, f"fragment {f}: {b} bytes, analytic {want}"
    assert all(agree(p.detach()) for p in st.outer_params), "outer parameters differ across ranks"


@pytest.mark.parametrize("cname", ["int8", "topk", "ef-sign"])
def test_an_all_gather_between_two_units_is_posted_bit_identical_to_the_thread(cname, monkeypatch):
    """Between two units an all-gathered pseudo-gradient is posted from the training thread
    (``MPI_Iallgather``, moved on by the steps' own calls; no reduction thread): the models, the
    outer parameters and every fragment's bytes equal the reduction thread's, bit for bit
    (3 ranks: the thread both times)."""
    def go(post: bool):
        if not post:
            monkeypatch.setattr(Route, "can_post", lambda self, fragments: False)
        comp = build_compressor(CompressorConfig(name=cname, collective="allgather", start_iter=0))
        model, st = train(StreamingDiLoCo, 11, period=4, fragments=2, delay=2, merge="add-local",
                          compressor=comp)
        monkeypatch.undo()
        st.close()
        return model, st
    posted_model, posted = go(True)
    thread_model, thread = go(False)
    assert posted._posting == (K == 2) and not thread._posting, f"posting {posted._posting} at {K} ranks"
    assert_models_equal(posted_model, thread_model, f"{cname} posted vs on the reduction thread")
    assert all(torch.equal(p, q) for p, q in zip(posted.outer_params, thread.outer_params))
    assert posted.syncs == thread.syncs and posted.syncs, f"{posted.syncs} vs {thread.syncs}"
    assert posted.comm.ledger.get("allgather", "world").bytes_sent == \
        thread.comm.ledger.get("allgather", "world").bytes_sent > 0


N_BYTES = 4 * sum(p.numel() for p in make(perturb=False).parameters())


def test_a_diloco_sync_is_one_dense_allreduce_of_the_model():
    _, st = train(DiLoCo, 6, period=3)
    st.close()
    assert [s for s, _, _ in st.syncs] == [3, 6], f"syncs {st.syncs}"
    assert all(b == 2 * (K - 1) * N_BYTES // K for _, _, b in st.syncs), f"sync bytes {st.syncs}"


def test_fragments_split_the_sync_staggered():
    _, st = train(StreamingDiLoCo, 12, period=6, fragments=3, delay=2)
    st.close()
    numel = [f.numel for f in st.fragments]
    assert sum(numel) == N_BYTES // 4, f"fragments must cover the model once: {numel}"
    assert all(b == 2 * (K - 1) * 4 * numel[f] // K for _, f, b in st.syncs), f"fragment bytes {st.syncs}"
    assert sorted(s for s, _, _ in st.syncs) == [2, 4, 6, 8, 10, 12], f"staggered syncs {st.syncs}"
    assert [f for _, f, _ in st.syncs] == [0, 1, 2] * 2, f"fragment order {st.syncs}"


# resume -----------------------------------------------------------------------------------------
RESUME = {
    "streaming-in-flight": (StreamingDiLoCo, adamw, 7,
                            dict(period=4, fragments=2, delay=2, alpha=0.5, warmup_steps=2)),
    "streaming-add-local-in-flight": (StreamingDiLoCo, adamw, 6,
                                      dict(period=4, fragments=2, delay=3, merge="add-local")),
    "eager-in-flight": (StreamingDiLoCo, adamw, 7, dict(period=4, fragments=2, delay=2,
                                                       merge="eager")),
    "streaming-in-warm-up": (StreamingDiLoCo, adamw, 1,
                             dict(period=4, fragments=2, delay=2, alpha=0.5, warmup_steps=2)),
    "localsgd-momentum-in-warm-up": (LocalSGD, momentum_sgd, 2, dict(period=3, warmup_steps=3)),
    "diloco-nesterov": (DiLoCo, adamw, 4, dict(period=3)),
    **{f"streaming-{c}": (StreamingDiLoCo, sgd, 5, dict(period=3, fragments=2, delay=1,
                                                         compressor=CompressorConfig(name=c, start_iter=0)))
       for c in LOSSY},
}
TOTAL = 11


def unlike():
    """A fresh model whose parameters differ from any run's: the load, not the init, decides."""
    fresh = make()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(-1.0)
    return fresh


def saved(st, model):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "strategy": st.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@on_two
@pytest.mark.parametrize("case", RESUME)
def test_a_state_dict_round_trip_continues_bit_identically(case, comm):
    cls, inner, at, kw = RESUME[case]

    def kwargs():
        return {**kw, "compressor": build_compressor(kw["compressor"])} if "compressor" in kw else kw
    ref = run(cls, TOTAL, inner, **kwargs())
    model, st = train(cls, at, inner, **kwargs())
    in_flight = bool(st._in_flight)
    state = saved(st, model)
    st.close()
    fresh = unlike()
    st2 = cls(fresh, inner(fresh.parameters()), comm, **kwargs())
    fresh.load_state_dict(state["model"])
    st2.load_state_dict(state["strategy"])
    train(None, TOTAL - at, model=fresh, first=at, strategy=st2)
    st2.close()
    if case.endswith("in-flight"):
        assert in_flight, f"a reduction should be in flight at step {at}"
    assert_models_equal(fresh, ref, f"resumed at step {at}")


@on_two
@pytest.mark.parametrize("merge", ["add-local", "eager"])
def test_a_member_joining_with_a_round_in_flight_keeps_only_its_own_progress(merge, comm):
    """A donor's state taken with a round in flight (sent at step 4, landing after step 6), as a
    fleet's rejoining datacenter takes it (``joined()``): the member starts from θ and, its inner
    learning rate 0 (no progress of its own), holds exactly the donor's θ' once the round lands —
    not θ' minus the donor's progress before the send — and its record of the round has no
    bytes (the donor sent them)."""
    kw = dict(period=4, fragments=1, delay=2, merge=merge)
    model, st = train(StreamingDiLoCo, 4, adamw, **kw)
    assert st._in_flight, "a round should be in flight at step 4"
    donors = (st.fragments[0].pack() - st.outer_params[0]).abs().max()
    assert donors > 1e-3, f"the donor's model should be away from θ at the send ({donors})"
    state = saved(st, model)
    fresh = unlike()
    st2 = StreamingDiLoCo(fresh, adamw(fresh.parameters()), comm, **kw)
    fresh.load_state_dict(state["model"])
    st2.load_state_dict(state["strategy"])
    st2.joined()
    assert torch.equal(st2.fragments[0].pack(), st.outer_params[0]), "joined: the model is θ"
    for group in st2.optimizer.param_groups:
        group["lr"] = 0.0
    train(None, 2, model=fresh, first=4, strategy=st2)
    train(None, 2, model=model, first=4, strategy=st)
    st.close()
    st2.close()
    assert torch.equal(st2.outer_params[0], st.outer_params[0]), "the donor's θ' and the member's"
    gap = (st2.fragments[0].pack() - st.outer_params[0]).abs().max()
    assert gap <= 1e-6, f"the member's model is θ' + {gap}, not θ'"
    assert st2.syncs[-1] == [4, 0, 0] and st.syncs[-1][:2] == [4, 0] and st.syncs[-1][2] > 0, \
        (st2.syncs, st.syncs)


# errors -----------------------------------------------------------------------------------------
ERRORS = {
    "localsgd-period": ("period", lambda m, o, c: LocalSGD(m, o, c, period=0), [">= 1"]),
    "diloco-period": ("period", lambda m, o, c: DiLoCo(m, o, c, period=0), [">= 1"]),
    "fragments": ("fragments", lambda m, o, c: StreamingDiLoCo(
        m, o, c, period=20, fragments=N_TENSORS + 1), [f"only {N_TENSORS} trainable parameter tensors"]),
    "delay": ("delay", lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=4),
              ["period=4"]),
    "alpha": ("alpha", lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, alpha=1.5), []),
    "merge": ("merge", lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, merge="average"),
              ["add-local"]),
    "add-local-alpha": ("alpha", lambda m, o, c: StreamingDiLoCo(
        m, o, c, period=4, merge="add-local", alpha=0.5), ["alpha = 0"]),
    "eager-delay-0": ("delay", lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, merge="eager"),
                      ["delay ≥ 1"]),
    "eager-alpha": ("alpha", lambda m, o, c: StreamingDiLoCo(
        m, o, c, period=4, delay=1, merge="eager", alpha=0.5), ["alpha = 0"]),
    "outer-momentum": ("outer_momentum", lambda m, o, c: DiLoCo(m, o, c, period=4, outer_momentum=0.0),
                       ["Nesterov"]),
    "outer-optimizer": ("outer_optimizer",
                        lambda m, o, c: DiLoCo(m, o, c, period=4, outer_optimizer="adam"), []),
    "dylu-min-steps": ("min_steps", lambda m, o, c: DyLUDiLoCo(m, o, c, period=4, min_steps=5),
                       ["period=4"]),
    "nesterov-every": ("nesterov_every", lambda m, o, c: DiLoCo(m, o, c, period=4,
                                                                nesterov_every=3),
                       ["delayed-nesterov"]),
}


@on_two
@pytest.mark.parametrize("case", ERRORS)
def test_a_bad_argument_is_an_argument_error_before_any_communication(case, comm):
    """A wrong Python argument is an ArgumentError naming the argument (not a config key)."""
    key, build, words = ERRORS[case]
    m = make()
    with pytest.raises(ArgumentError) as e:
        build(m, sgd(m.parameters()), comm)
    t = torch.ones(3)
    comm.allreduce_(t)             # the job goes on after a refused construction: still in step
    assert e.value.key == key and f"argument '{key}'" in str(e.value) and all(w in str(e.value) for w in words), \
        f"expected {key} {words}: {e.value}"
    assert torch.equal(t, torch.full((3,), float(K))), "communication after the error"


def _dylu_run(steps, slow=1.0, opt=None, first=0, now=None, **kw):
    """``steps`` steps of DyLUDiLoCo (``opt``, or a new one) from step ``first`` in a loop that
    asks takes_step() first, on a clock (``now``: a one-element list) that each computed step
    moves on by 1 s (by ``slow`` s on the last rank: a slower member), so the speeds are the
    loop's, not the machine's; returns (model, opt, the local models and weights of every
    synchronisation)."""
    now = now if now is not None else [0.0]
    if opt is None:
        model = make()
        opt = DyLUDiLoCo(model, sgd(model.parameters()), lowcomm.init(), **kw)
        opt.clock = lambda: now[0]
    model = opt.model
    rounds = []
    plain = opt._outgoing

    def outgoing(f, local):                       # each member's local model, at the round
        rounds.append((local.clone(), opt.h_local))
        return plain(f, local)
    opt._outgoing = outgoing
    for step in range(first, first + steps):
        if not opt.takes_step():
            opt.pass_step()
            continue
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        now[0] += slow if RANK == K - 1 else 1.0
        opt.step()
    return model, opt, rounds


def test_dynamic_local_updates_at_equal_steps_are_diloco_bit_for_bit():
    model, opt, _ = _dylu_run(8, period=4, outer_optimizer="nesterov")
    opt.close()
    assert opt.passed == 0 and opt.history == [4, 4]
    assert_models_equal(model, run(DiLoCo, 8, period=4), "diloco-dylu (every step) vs diloco")


def test_a_slower_member_takes_fewer_steps_and_counts_for_its_tokens():
    """The last rank at a quarter of the others' speed: H/4 steps of each period after the
    first (Liu et al.'s rule), the rest passed over; θ the h_k-weighted average."""
    H = 8
    model, opt, rounds = _dylu_run(3 * H, slow=4.0, period=H, outer_optimizer="sgd",
                                   outer_lr=1.0, outer_momentum=0.0)
    every = lowcomm.init().allgather_object((opt.history, opt.passed))
    if RANK == K - 1:
        assert (opt.history, opt.passed) == ([H, H // 4, H // 4], 2 * (H - H // 4)), every
    else:
        assert (opt.history, opt.passed) == ([H] * 3, 0), every
    # the last round's outer parameters: the local models averaged with weights h_k (outer SGD,
    # lr 1, no momentum: θ ← θ − Σ w_k (θ − θ_k) / Σ w_k = Σ w_k θ_k / Σ w_k)
    local, w = rounds[-1]
    seen = lowcomm.init().allgather_object((local, w))
    expect = sum(x * wk for x, wk in seen) / sum(wk for _, wk in seen)
    torch.testing.assert_close(opt.outer_params[0].detach(), expect, rtol=1e-5, atol=1e-6)
    assert agree(opt.outer_params[0].detach())
    opt.close()


@on_two
def test_dynamic_local_updates_resume_mid_period_bit_identically(comm):
    """A state dict taken mid-period (the slow member part-way through its share, its period's
    seconds so far saved) continues as the run never stopped."""
    H, kw = 8, dict(period=8, outer_optimizer="delayed-nesterov", nesterov_every=2)
    ref, ref_opt, _ = _dylu_run(4 * H, slow=4.0, **kw)
    ref_opt.close()
    now = [0.0]
    model, opt, _ = _dylu_run(H + 1, slow=4.0, now=now, **kw)
    state = saved(opt, model)
    opt.close()
    fresh = unlike()
    opt2 = DyLUDiLoCo(fresh, sgd(fresh.parameters()), comm, **kw)
    opt2.clock = lambda: now[0]
    fresh.load_state_dict(state["model"])
    opt2.load_state_dict(state["strategy"])
    _dylu_run(3 * H - 1, slow=4.0, opt=opt2, first=H + 1, now=now)
    assert opt2.history == ref_opt.history and opt2.passed == ref_opt.passed, \
        (opt2.history, ref_opt.history)
    opt2.close()
    assert_models_equal(fresh, ref, "diloco-dylu resumed mid-period")



@on_two
@pytest.mark.parametrize("slot,merged", [
    ("send", {0: [6, 14], 1: [10]}),          # sent on the slots 4 and 8 (fragment 1), τ = 2 later
    ("merge", {0: [4, 12], 1: [8, 16]}),      # torchft's: sent τ = 2 before the slots, merged on them
])
def test_streaming_fragments_merge_where_the_slot_convention_says(slot, merged, comm):
    """H = 8, P = 2, τ = 2, α = 0: a fragment is equal on every rank exactly after the steps that
    merge it (the ranks' batches differ, so local steps take them apart). ``slot = "send"``
    merges τ steps after the slots ⌊(p+1)H/P⌋ = 4, 8; ``slot = "merge"`` (torchft's
    convention, ``fragment_sync_delay`` = τ) merges on them."""
    model = make()
    opt = StreamingDiLoCo(model, sgd(model.parameters()), comm, period=8, fragments=2, delay=2,
                          slot=slot)
    seen = {0: [], 1: []}
    for step in range(1, 17):
        train(None, 1, model=model, first=step, strategy=opt)
        for f in opt.fragments:
            mine = torch.cat([p.detach().reshape(-1) for _, p, _, _ in f.members])
            if all(torch.equal(mine, other) for other in comm.allgather_object(mine)):
                seen[f.index].append(step)
    assert seen == merged, seen
    opt.close()


# a round that goes ahead without a late member (a fleet's quorum) -----------------------------
class _ScriptedRounds:
    """The fleet's channel as DiLoCo sees it under ``fleet.quorum``, over this job's ranks (each
    one a datacenter), rounds scripted: in round ``late_round`` the last rank is late (it adds
    nothing, is told so), in the next it catches up (rank 0, the donor, corrects and hands it
    the outer state)."""
    rounds, per_rank, dcs, link = True, False, None, None     # (a lowcomm.comm.roles.Peers)

    def __init__(self, comm, late_round):
        self.comm, self.late_round, self.round = comm, late_round, 0

    def dup(self, ledger=None):
        return self

    def contribute(self, payload, tag, steps, state, algorithm="ring", levels=None,
                   carried=False):
        r, self.round = self.round, self.round + 1
        catching = {k: s for k, s in enumerate(self.comm.allgather_object(
            steps if carried else None)) if s is not None}
        late = r == self.late_round and RANK == K - 1
        members = K - 1 if r == self.late_round else K
        x = self.comm.allgather_object(torch.zeros(0) if late else payload(catching, RANK == 0))
        got = self.comm.bcast_object(state() if catching and RANK == 0 else None)
        if late:
            return "late", None, None
        avg = sum(t for t in x if t.numel()) / members
        return "average", avg, got if RANK in catching else None


class _Span:                         # (a lowcomm.comm.roles.Whole)
    late_rounds, channel, size, rounds, arrivals = True, None, K, False, False


def _late_diloco(model, rounds):
    from lowcomm.strategies.outer.nesting import Nesting
    nest = Nesting(inner=None, inside=None, leaders=rounds, whole=_Span())
    return DiLoCo(model, sgd(model.parameters()), lowcomm.init(), period=3,
                  context=lowcomm.Context(nest=nest))


def simulate_late(steps, period, late_round, lr=0.7, mu=0.9):
    """K workers in one process: DiLoCo whose round ``late_round`` goes without the last worker
    (it keeps its model and θ and trains on), and whose next round weighs each worker's
    pseudo-gradient from the current θ_r by its steps: Δ = Σ_k w_k (θ_r − θ_k) / Σ_k w_k, w_k =
    H, 2H for the late one; Nesterov SGD on θ; every worker then takes θ."""
    models = [make(perturb=False) for _ in range(K)]
    opts = [sgd(m.parameters()) for m in models]
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    buf = {}
    r = 0
    for step in range(steps):
        inner_steps(models, opts, step)
        if (step + 1) % period:
            continue
        taking = range(K - 1) if r == late_round else range(K)
        w = [2 * period if r == late_round + 1 and k == K - 1 else period for k in range(K)]
        for n in theta:
            g = sum(w[k] * (theta[n] - dict(models[k].named_parameters())[n].detach())
                    for k in taking) / sum(w[k] for k in taking)
            buf[n] = mu * buf[n] + g if n in buf else g.clone()
            theta[n] = theta[n] - lr * (g + mu * buf[n])
        with torch.no_grad():
            for k in taking:
                for n, p in models[k].named_parameters():
                    p.copy_(theta[n])
        r += 1
    return models[RANK]


def test_a_late_members_steps_merge_next_round_weighted_and_every_member_takes_one_state():
    """Round 1 goes without the last rank; in round 2 its 2H steps count twice an on-time
    member's, from the θ it trained from corrected to the current one by the donor, who also
    hands it θ and the outer momentum: every rank then holds the same model and outer state,
    as the K-worker simulation does."""
    rounds, model = _ScriptedRounds(lowcomm.init(), late_round=1), make()
    model, st = train(None, 9, model=model, strategy=_late_diloco(model, rounds))
    st.close()
    assert st._late["carried"] == 0 and rounds.round == 3
    assert agree(flat(model)), "the ranks' models differ after the catch-up round"
    assert all(agree(p.detach()) for p in st.outer_params)
    assert all(agree(v) for s in st.outer_optimizer.state.values() for v in s.values()
               if torch.is_tensor(v)), "outer momentum differs after the catch-up"
    assert_models_close(model, simulate_late(9, 3, late_round=1), "late merge vs simulation")
    bytes_sent = {row["op"] for row in st.comm.ledger.rows()}
    assert bytes_sent, "the rounds charged nothing"
