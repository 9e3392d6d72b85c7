"""DeMo, SPARTA, SPARTA under DiLoCo, 0/1 Adam, MuLoCo, DES-LOC and NoLoCo on 2 ranks (the world split in two
halves, each running the case) and on 4, each against a reference computed here on every rank:

* DeMo equals the paper's equations (scipy's orthonormal DCT, per-chunk top-k, momentum
  subtraction, mean over the K ranks, sign step) with the all-gather, and with the two-phase
  exchange at full k; its bytes per step are exactly k·(value + index) per chunk through the
  exchange's formula, flat in K for the two-phase exchange;
* SPARTA's averaged subset is the same on every rank and the mean of the ranks' values, the rest
  untouched, its bytes an all-reduce of fraction × the parameters; under DiLoCo the period ends
  with one model;
* 0/1 Adam equals torch Adam on the averaged gradient while every step is dense; its variance
  moves on T_v only and is frozen after ``var_freeze_step``; local steps send nothing and
  synchronisations leave one model; a rank that skips a local step alone keeps the schedule;
* MuLoCo's inner steps are MuonAdamW's (torch's Muon and AdamW) on each rank's own batches;
* DES-LOC equals the paper's equations on K workers simulated in one process (each rank's
  parameters and Adam moments, every step), its bytes per step an all-reduce of the states due;
* NoLoCo equals the reference code's outer step on K workers simulated in one process with the
  same pairings; it sends one model to one peer per outer step and nothing else.
* SparseLoCo equals the paper's Algorithm 1 written out in NumPy (accumulator, chunked top-k,
  the 2-bit quantiser, the outer step), its bytes per outer step are (K − 1)·P for P of its
  format (2-bit values, ⌈log2 chunk⌉-bit indices, plus the quantiser's tables);
* the DisTrO preset is DeMo with 1-bit values (its wire format against the paper's equations
  above) and the MuLoCo-EF-2-bit preset DiLoCo over Muon with error-fed 2-bit pseudo-gradients,
  each with bytes of its formula (each of the three trains the built-in byte LM at its compare
  settings in tests/mpi/check_compare_defaults.py, with every other method).
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.fft
import torch
import torch.nn.functional as F
from torch import nn

import lowcomm
from lowcomm.comm.ledger import Ledger, wire_bytes
from lowcomm.run.evaluate import state_sha256
from lowcomm.run.optimizers import MuonAdamW
from lowcomm.strategies.outer.sparta import SparseAverage
from lowcomm.strategies.optimizers.zeroone_adam import schedule


@pytest.fixture(params=[2, 4], ids=["K2", "K4"])
def group(request, comm):
    """A communicator of K ranks with a ledger of its own: the world, or its half."""
    c = comm if request.param == comm.size else comm.split(comm.rank * request.param // comm.size)
    return c.dup(Ledger())


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def batch(step: int, rank: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g).to(dtype), torch.randint(0, 4, (8,), generator=g)


def grads(model, step, rank):
    model.zero_grad()
    x, y = batch(step, rank, next(model.parameters()).dtype)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def train(opt, model, comm, steps, each=None):
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batch(step, comm.rank, next(model.parameters()).dtype)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if each:
            each(step)


def sent(comm) -> int:
    return sum(r["bytes_sent"] for r in comm.ledger.rows())


# DeMo ------------------------------------------------------------------------------------------
def chunks(shape, s):
    """The chunk sides of a tensor: the largest divisors of its sides within s."""
    def side(n):
        return n if n <= s else max(d for d in range(1, s + 1) if n % d == 0)
    return (side(shape[0]), side(int(np.prod(shape[1:])))) if len(shape) >= 2 else (side(shape[0]),)


def top(coeff: np.ndarray, k: int) -> np.ndarray:
    """The k largest magnitudes of every chunk (``coeff[j]``) kept, the rest zero."""
    out = np.zeros_like(coeff)
    for j, c in enumerate(coeff):
        flat = c.reshape(-1)
        idx = np.argsort(-np.abs(flat))[:min(k, flat.size)]
        out[j].reshape(-1)[idx] = flat[idx]
    return out


def paper_q(m: np.ndarray, s: int, k: int) -> np.ndarray:
    """ExtractFastComponents: the orthonormal DCT-II of every chunk of m, the k largest
    magnitudes of each kept, as an array of the chunks' coefficients (chunk-major)."""
    sides = chunks(m.shape, s)
    m2 = m.reshape(m.shape[0], -1) if m.ndim >= 2 else m
    return top(np.stack([scipy.fft.dctn(m2[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, sides))],
                                        type=2, norm="ortho")
                         for idx in np.ndindex(*[n // c for n, c in zip(m2.shape, sides)])]), k)


def paper_inverse(q: np.ndarray, shape, s: int) -> np.ndarray:
    sides = chunks(shape, s)
    flat = (shape[0], int(np.prod(shape[1:]))) if len(shape) >= 2 else shape
    out = np.zeros(flat)
    for j, idx in enumerate(np.ndindex(*[n // c for n, c in zip(flat, sides)])):
        out[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, sides))] = \
            scipy.fft.idctn(q[j], type=2, norm="ortho")
    return out.reshape(shape)


def paper_demo(K: int, steps: int, lr: float, beta: float, s: int, k: int, wd: float = 0.0,
               nesterov: float = 0.0, reselect: bool = False, signs: bool = False,
               senders: bool = False):
    """Algorithm 1 of Peng et al. 2024 on K simulated ranks, with the reference implementation's
    decoupled weight decay ``x ← x(1 − lr·wd)`` and, where ``nesterov`` = μ > 0, torch SGD's
    Nesterov momentum on the synchronised sign; ``reselect``: the mean Q of the ranks' q is
    re-sparsified to its k largest per chunk with an error E that carries the rest
    (``A = Q + E``, ``Q ← top_k(A)``, ``E ← A − Q``: gTop-k with server error feedback). After
    every step: the parameters and every rank's momentum. ``signs``: DisTrO's 1-bit values, the
    mean taken over the sent coefficients' signs (the momentum still loses the whole q), and the
    step with u itself (a sign step would meet exact ties: u = 0 where ±1 coefficients cancel,
    whose sign float rounding decides; and k below a chunk's size: the output layer's gradient
    sums to zero over the classes, so some coefficients are zero up to rounding, and one bit,
    which cannot say zero, would send whichever sign the rounding left). ``senders``: the
    reference code's mean, each coefficient over the ranks whose q holds it (``scatter_reduce``
    mean), instead of over all K."""
    model = mlp(torch.float64)
    x = [p.detach().numpy().copy() for p in model.parameters()]
    m = [[np.zeros_like(p) for p in x] for _ in range(K)]
    buf, err = [None] * len(x), [0.0] * len(x)
    after = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p, v in zip(model.parameters(), x):
                p.copy_(torch.from_numpy(v))
        qs = []
        for r in range(K):
            g = [t.numpy() for t in grads(model, step, r)]
            q = []
            for i in range(len(x)):
                m[r][i] = beta * m[r][i] + lr * g[i]
                q.append(paper_q(m[r][i], s, k))
                m[r][i] = m[r][i] - paper_inverse(q[-1], x[i].shape, s)
            qs.append(q)
        for i in range(len(x)):
            mean = sum(np.sign(q[i]) if signs else q[i] for q in qs)
            mean = mean / np.maximum(sum((q[i] != 0).astype(float) for q in qs), 1) if senders \
                else mean / K
            if reselect:
                mean, err[i] = top(mean + err[i], k), mean + err[i] - top(mean + err[i], k)
            d = paper_inverse(mean, x[i].shape, s)
            d = d if signs else np.sign(d)
            if nesterov:
                buf[i] = d if buf[i] is None else nesterov * buf[i] + d
                d = d + nesterov * buf[i]
            x[i] = x[i] * (1 - lr * wd) - lr * d
        after.append(([v.copy() for v in x], [[v.copy() for v in mr] for mr in m]))
    return after


@pytest.mark.parametrize("exchange,topk,wd,nesterov,signs,average", [
    ("allgather", 5, 0.1, 0.0, False, "all"), ("two-phase", 64, 0.0, 0.0, False, "all"),
    ("allgather", 5, 0.0, 0.9, False, "all"), ("two-phase", 5, 0.0, 0.0, False, "all"),
    ("allgather", 3, 0.0, 0.0, True, "all"), ("allgather", 5, 0.1, 0.0, False, "senders"),
    ("allgather", 3, 0.0, 0.0, True, "senders")])
def test_demo_equals_the_papers_equations(group, exchange, topk, wd, nesterov, signs, average):
    """With the all-gather at k = 5 of chunks up to 48 elements, and two-phase at full k (its
    owners' re-selection keeps everything): the paper's update and each rank's momentum, step by
    step, to 1e-12; SGD's weight decay is the reference's decoupled one, a Nesterov SGD adds
    Nesterov momentum on the sign. Two-phase at k = 5: the paper's with the mean re-sparsified
    per chunk, the rest carried by the owners' server error. With 1-bit values (DisTrO's wire
    format): the mean of the sent coefficients' signs, stepped with u (see paper_demo).
    ``average = "senders"``: each coefficient averaged over the ranks that sent it (the
    reference code's rule), which differs from the mean over K on these steps."""
    lr, beta, s, steps = 0.01, 0.9, 8, 4
    reselect = exchange == "two-phase" and topk < 48
    want = paper_demo(group.size, steps, lr, beta, s, topk, wd, nesterov, reselect, signs,
                      average == "senders")
    if average == "senders":
        other = paper_demo(group.size, steps, lr, beta, s, topk, wd, nesterov, reselect, signs)
        assert not np.allclose(other[-1][0][0], want[-1][0][0], rtol=0, atol=1e-6)
    model = mlp(torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd, momentum=nesterov,
                            nesterov=nesterov > 0)
    opt = lowcomm.DeMo(model, inner, group, topk=topk, chunk=s, decay=beta, exchange=exchange,
                       value_bits=int(signs), sign=not signs, average=average)
    names = [n for n, _ in model.named_parameters()]

    def check(step):
        params, momenta = want[step - 1]
        for p, w in zip(model.parameters(), params):
            assert np.allclose(p.detach().numpy(), w, rtol=0, atol=1e-12), f"step {step}"
        for n, w in zip(names, momenta[group.rank]):
            assert np.allclose(opt.momentum[n].numpy(), w, rtol=0, atol=1e-12), f"momentum, step {step}"
    train(opt, model, group, steps, check)
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


@pytest.mark.parametrize("exchange", ["two-phase", "allgather"])
def test_demo_bytes_are_k_value_and_index_per_chunk(group, exchange):
    model = mlp()
    opt = lowcomm.DeMo(model, torch.optim.SGD(model.parameters(), lr=0.01), group, topk=3, chunk=8,
                       exchange=exchange)
    # chunks: 16×12 → 8×6 blocks (4 of 48), 16 → 2 of 8, 4×16 → 4×8 blocks (2 of 32), 4 → 1 of 4
    P = (4 + 2 + 2) * 3 * (4 + 2) + 1 * 3 * (4 + 2)
    assert opt.payload_bytes() == P
    K, r = group.size, group.rank
    if exchange == "allgather":
        want = (K - 1) * P
    else:                        # owners' chunks are whole rows: P(rows of j) to each owner j ≠ r,
        want = 0                 # then this owner's re-selected rows to the K − 1 others
        for b in opt.buckets:
            codec = b.comp.codec
            cut = codec.bounds(b.numel, K)
            mine = [codec.payload_nbytes(hi - lo, torch.float32) for lo, hi in zip(cut, cut[1:])]
            want += sum(mine) - mine[r] + (K - 1) * mine[r]
        assert want <= 2 * P                                    # flat in K
    group.ledger.reset()
    train(opt, model, group, 2)
    assert sent(group) == 2 * want
    opt.finish()


# SPARTA ----------------------------------------------------------------------------------------
def test_sparta_averages_one_subset_and_leaves_the_rest(group):
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = lowcomm.Sparta(model, inner, group, fraction=0.05, seed=3)
    twin = SparseAverage([torch.empty_like(p) for p in model.parameters()], 0.05, seed=3)
    n = sum(p.numel() for p in model.parameters())
    assert twin.k == round(0.05 * n) == opt.sparse.k
    local = {}
    inner.register_step_post_hook(lambda *_: local.__setitem__(
        0, torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])))
    for step in range(1, 4):
        group.ledger.reset()
        train(opt, model, group, 1)
        idx = twin.indices()
        now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        mean = torch.stack(group.allgather_object(local[0])).sum(0) / group.size
        rest = torch.ones(n, dtype=torch.bool)
        rest[idx] = False
        assert torch.equal(now[rest], local[0][rest]), "an element outside the subset moved"
        assert torch.allclose(now[idx], mean[idx], rtol=0, atol=1e-6)
        assert len({tuple(t.tolist()) for t in group.allgather_object(now[idx])}) == 1
        # bytes: an all-reduce of k of the n values, i.e. fraction × the dense all-reduce
        assert sent(group) == wire_bytes("allreduce", 4 * twin.k, group.size)[0]
    dense = wire_bytes("allreduce", 4 * n, group.size)[0]
    assert abs(sent(group) / dense - 0.05) < 0.05 / twin.k + 4 / dense
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


def test_sparta_under_diloco_ends_each_period_with_one_model(group):
    model = mlp()
    opt = lowcomm.SpartaDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), group, period=3,
                               fraction=0.05, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0)
    k = opt.sparse.k

    def check(step):
        same = len(set(group.allgather_object(state_sha256(model)))) == 1
        assert same == (step % 3 == 0), f"step {step}"
    group.ledger.reset()
    train(opt, model, group, 2, check)
    assert sent(group) == 2 * wire_bytes("allreduce", 4 * k, group.size)[0]
    train(opt, model, group, 4, lambda s: check(s + 2))
    opt.finish()


# 0/1 Adam --------------------------------------------------------------------------------------
def test_zeroone_adam_is_torch_adam_while_every_step_is_dense(group):
    """κ = 5: steps 1–5 update the variance, so they are dense Adam steps on the averaged
    gradient, here against torch Adam on the mean of the ranks' gradients (float rounding of the
    sums apart: rtol 1e-6)."""
    model, ref = mlp(), mlp()
    opt = lowcomm.ZeroOneAdam(model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01),
                              group, var_freeze_step=100, var_update_scaler=5)
    adam = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(1, 6):
        every = [grads(ref, step, r) for r in range(group.size)]
        for p, *gs in zip(ref.parameters(), *every):
            p.grad = torch.stack(gs).sum(0) / group.size
        adam.step()
        train_one(opt, model, group, step)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), f"step {step}"
    assert opt.counts["dense"] == 5
    opt.finish()


def train_one(opt, model, comm, step):
    opt.zero_grad()
    x, y = batch(step, comm.rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("counter", ["steps", "deepspeed"])
def test_zeroone_adam_freezes_the_variance_and_steps_locally_between_synchronisations(group, counter):
    """Each step of the schedule, on our step count or DeepSpeed's (one step out of phase):
    the variance moves on dense steps only, the bytes are the kind's, the ranks differ after
    local steps only."""
    kw = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
              counter=counter)
    kinds = schedule(15 if counter == "steps" else 14, **kw)      # ending after a local step
    model = mlp()
    opt = lowcomm.ZeroOneAdam(model, torch.optim.Adam(model.parameters(), lr=0.01), group, **kw)
    d = sum(p.numel() for p in model.parameters())
    K = group.size
    D = -(-d // (8 * K)) * 8 * K
    n = len(list(model.parameters()))                    # + a presence slot (int32) per tensor
    onebit = 2 * (K - 1) * (D // (8 * K) + 4) + wire_bytes("allreduce", 4 * n, K)[0]
    for step, kind in enumerate(kinds, 1):
        v = [opt.optimizer.state[p]["exp_avg_sq"].clone() if p in opt.optimizer.state else None
             for p in model.parameters()]
        group.ledger.reset()
        train_one(opt, model, group, step)
        moved = any(w is None or not torch.equal(w, opt.optimizer.state[p]["exp_avg_sq"])
                    for w, p in zip(v, model.parameters()))
        assert moved == (kind == "dense"), f"step {step} ({kind}): the variance moved: {moved}"
        want = {"dense": wire_bytes("allreduce", 4 * (d + n), K)[0], "onebit": onebit, "sync": onebit,
                "local": 0}[kind]
        assert sent(group) == want, f"step {step} ({kind})"
        same = len(set(group.allgather_object(state_sha256(model)))) == 1
        assert same == (kind != "local"), f"step {step} ({kind})"
    assert opt.counts == {k: kinds.count(k) for k in ("dense", "onebit", "local", "sync")}
    assert kinds[-1] == "local"
    opt.finish()                                 # ends after local steps: one dense average
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


def adam_reference(steps: int, dense, lr=0.01, betas=(0.9, 0.999), eps=1e-8, clip=False):
    """Adam on one rank's batches (rank 0's) in float64, its variance updated only on the steps
    ``dense(t)`` says (bias-corrected by their count): the parameters after each step. ``clip``:
    1-bit Adam's step 3 on the other steps, ``m/δ`` bounded by ``B·(1 − β1^t)``, B =
    max(1, (1 − β1)/√(1 − β2)), and m ← the bounded value times δ."""
    bound = max(1.0, (1 - betas[0]) / (1 - betas[1]) ** 0.5)
    model = mlp(torch.float64)
    x = [p.detach().clone() for p in model.parameters()]
    m, v, n_v, out = [torch.zeros_like(p) for p in x], [torch.zeros_like(p) for p in x], 0, []
    for t in range(1, steps + 1):
        with torch.no_grad():
            for p, w in zip(model.parameters(), x):
                p.copy_(w)
        g = grads(model, t, 0)
        n_v += bool(dense(t))
        for i in range(len(x)):
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g[i]
            if dense(t):
                v[i] = betas[1] * v[i] + (1 - betas[1]) * g[i] * g[i]
            delta = v[i].sqrt() / (1 - betas[1] ** n_v) ** 0.5 + eps
            if clip and not dense(t):
                m[i] = (m[i] / delta).clamp(-bound * (1 - betas[0] ** t), bound * (1 - betas[0] ** t)) * delta
            x[i] = x[i] - lr / (1 - betas[0] ** t) * m[i] / delta
        out.append([w.clone() for w in x])
    return out


def test_the_one_bit_methods_on_one_rank_compress_nothing(comm):
    """One rank has nothing to exchange (DeepSpeed's ``size > 1``): 1-bit Adam past its warm-up
    is Adam with the variance frozen at the switch, and 0/1 Adam's 1-bit steps take the exact
    gradient into the momentum (against Adam written out step by step); neither sends a byte."""
    one = comm.split(comm.rank).dup(Ledger())
    want = adam_reference(8, lambda t: t <= 3, clip=True)
    # three dense steps: freeze_step 3 on the steps taken, 4 on DeepSpeed's counter
    for freeze_step, counter in ((3, "steps"), (4, "deepspeed")):
        model = mlp(torch.float64)
        opt = lowcomm.OneBitAdam(model, torch.optim.Adam(model.parameters(), lr=0.01), one,
                                 freeze_step=freeze_step, counter=counter)

        def check(step):
            for p, w in zip(model.parameters(), want[step - 1]):
                assert torch.allclose(p.detach(), w, rtol=0, atol=1e-12), f"1-bit Adam ({counter}), step {step}"
        train(opt, model, one, 8, check)
        assert sent(one) == 0 and not opt.worker_error.any() and not opt.server_error.any()
        opt.finish()
    kinds = schedule(10, var_freeze_step=6, var_update_scaler=2)
    assert "onebit" in kinds[:6]
    model = mlp(torch.float64)
    opt = lowcomm.ZeroOneAdam(model, torch.optim.Adam(model.parameters(), lr=0.01), one,
                              var_freeze_step=6, var_update_scaler=2)
    want = adam_reference(6, lambda t: kinds[t - 1] == "dense")
    train(opt, model, one, 6, lambda step: [
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12, msg=f"0/1 Adam, step {step}")
        for p, w in zip(model.parameters(), want[step - 1])])
    train(opt, model, one, 4)                    # local and sync steps
    assert sent(one) == 0 and opt.counts["onebit"] == kinds[:6].count("onebit")
    opt.finish()


def test_zeroone_adam_rank_alone_skips_a_local_step_under_amp(group):
    model = mlp()
    opt = lowcomm.ZeroOneAdam(model, torch.optim.Adam(model.parameters(), lr=0.01), group,
                              var_freeze_step=1, local_step_scaler=1, local_step_clipper=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(1, 9):                     # step 5 is local (interval 4 from step 4 on)
        opt.zero_grad()
        x, y = batch(step, group.rank)
        loss = F.cross_entropy(model(x), y) * (float("inf") if step == 5 and group.rank == 1 else 1)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert opt.counts["sync"] == 3 and opt.t == 8            # steps 2, 4, 8
    assert len(set(group.allgather_object(state_sha256(model)))) == 1     # step 8 synchronised
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    opt.finish()


# MuLoCo ----------------------------------------------------------------------------------------
def test_muloco_inner_steps_are_muon_adamw_steps(group):
    model, alone = mlp(), mlp()
    opt = lowcomm.DiLoCo(model, MuonAdamW(model.parameters(), lr=0.02, weight_decay=0.01), group,
                         period=3)
    ref = MuonAdamW(alone.parameters(), lr=0.02, weight_decay=0.01)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
    for step in (1, 2):
        train_one(opt, model, group, step)
        train_one(ref, alone, group, step)
        for p, q in zip(model.parameters(), alone.parameters()):
            assert torch.equal(p, q), f"inner step {step}"
    train_one(opt, model, group, 3)              # the outer step: one model, moved from the start
    assert len(set(group.allgather_object(state_sha256(model)))) == 1
    start = mlp().state_dict()
    assert all(not torch.equal(p, start[k]) for k, p in model.state_dict().items())
    opt.finish()


# DES-LOC ---------------------------------------------------------------------------------------
def paper_desloc(K: int, steps: int, periods: dict, lr: float, betas=(0.9, 0.95), eps=1e-8,
                 wd: float = 0.0):
    """The paper's equations on K simulated workers, in one process, written out here: every
    worker takes an AdamW step on its own gradient (torch's bias corrections, decoupled weight
    decay), then after step t the parameters x, first moments u and second moments v whose
    period divides t are replaced by the workers' mean. After every step: (x, u, v) per worker."""
    model = mlp(torch.float64)
    x0 = [p.detach().clone() for p in model.parameters()]
    x = [[t.clone() for t in x0] for _ in range(K)]
    u = [[torch.zeros_like(t) for t in x0] for _ in range(K)]
    v = [[torch.zeros_like(t) for t in x0] for _ in range(K)]
    (b1, b2), after = betas, []
    for t in range(1, steps + 1):
        for r in range(K):
            with torch.no_grad():
                for p, w in zip(model.parameters(), x[r]):
                    p.copy_(w)
            for i, g in enumerate(grads(model, t, r)):
                u[r][i] = b1 * u[r][i] + (1 - b1) * g
                v[r][i] = b2 * v[r][i] + (1 - b2) * g * g
                denom = (v[r][i] / (1 - b2 ** t)).sqrt() + eps
                x[r][i] = x[r][i] * (1 - lr * wd) - lr / (1 - b1 ** t) * u[r][i] / denom
        for name, state in (("x", x), ("u", u), ("v", v)):
            if t % periods[name] == 0:
                mean = [sum(state[r][i] for r in range(K)) / K for i in range(len(x0))]
                for r in range(K):
                    state[r] = [m.clone() for m in mean]
        after.append(tuple([[w.clone() for w in s[r]] for r in range(K)] for s in (x, u, v)))
    return after


@pytest.mark.parametrize("periods", [(1, 1, 1), (2, 3, 4)], ids=["every-step", "2-3-4"])
def test_desloc_equals_the_papers_equations(group, periods):
    """Against K workers simulated in one process from the equations above, step by step, each
    rank's parameters and both Adam moments to 1e-12 (float64). K_x = K_u = K_v = 1 is not
    Adam on the averaged gradient (the mean of m/√v is not the mean m over the mean √v): the
    simulation is the reference."""
    Kx, Ku, Kv = periods
    lr, wd, steps = 0.01, 0.1, 8
    want = paper_desloc(group.size, steps, {"x": Kx, "u": Ku, "v": Kv}, lr, wd=wd)
    model = mlp(torch.float64)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    opt = lowcomm.DesLoc(model, inner, group, period=Kx, period_u=Ku, period_v=Kv)

    def check(step):
        x, u, v = (s[group.rank] for s in want[step - 1])
        for i, p in enumerate(model.parameters()):
            st = inner.state[p]
            for got, ref, what in ((p, x[i], "x"), (st["exp_avg"], u[i], "u"), (st["exp_avg_sq"], v[i], "v")):
                assert torch.allclose(got.detach(), ref, rtol=0, atol=1e-12), f"{what}, step {step}"
    train(opt, model, group, steps, check)
    assert opt.syncs == {"x": steps // Kx, "u": steps // Ku, "v": steps // Kv}
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


def test_desloc_bytes_are_the_papers_formula(group):
    """Each step sends one all-reduce of the states whose period divides it (d values each), so
    T steps send Σ_t wire(n_t · 4d): the paper's 1/K_x + 1/K_u + 1/K_v of DDP's T all-reduces
    of 4d when T is a multiple of every period. Between averagings of x the ranks' models differ;
    after one they are the same."""
    Kx, Ku, Kv, steps = 2, 3, 4, 12
    model = mlp()
    opt = lowcomm.DesLoc(model, torch.optim.Adam(model.parameters(), lr=0.01), group,
                         period=Kx, period_u=Ku, period_v=Kv)
    d, K = sum(p.numel() for p in model.parameters()), group.size
    group.ledger.reset()
    total = 0

    def check(step):
        nonlocal total
        n = sum(step % k == 0 for k in (Kx, Ku, Kv))
        total += wire_bytes("allreduce", 4 * d * n, K)[0] if n else 0
        assert sent(group) == total, f"step {step}"
        same = len(set(group.allgather_object(state_sha256(model)))) == 1
        assert same == (step % Kx == 0), f"step {step}: the ranks' models agree: {same}"
        if step % Ku == 0:
            moments = group.allgather_object([opt.optimizer.state[p]["exp_avg"] for p in model.parameters()])
            assert all(torch.equal(a, b) for m in moments for a, b in zip(m, moments[0]))
    train(opt, model, group, steps, check)
    ddp = steps * wire_bytes("allreduce", 4 * d, K)[0]
    assert total == ddp * (Fraction(1, Kx) + Fraction(1, Ku) + Fraction(1, Kv))   # 6 + 4 + 3 of 12
    opt.finish()                                 # ends on an averaging: nothing more is sent
    assert sent(group) == total


# NoLoCo ----------------------------------------------------------------------------------------
def reference_noloco(K: int, steps: int, H: int, lr: float, outer_lr: float, outer_momentum: float,
                     gamma: float | None, seed: int):
    """The reference code's outer step (jkolehm/noloco, SparseOptimizerC, groups of 2) on K
    simulated workers in one process, each with its own SGD inner steps: after every H steps,
    with the pairing of this outer step, ``mean`` = the pair's mean of the outer weights φ and
    ``mean_g`` = its mean of θ − φ; ``m += (μ−1)m + β·mean_g + γ·(mean − φ)``, φ += m, θ = φ.
    After every step: each worker's θ."""
    from lowcomm.strategies.gossip.graphs import random_pairs
    gamma = outer_lr if gamma is None else gamma
    models = [mlp(torch.float64) for _ in range(K)]
    inner = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    phi = [[p.detach().clone() for p in m.parameters()] for m in models]
    mom = [[torch.zeros_like(p) for p in ph] for ph in phi]
    after = []
    for t in range(1, steps + 1):
        for r in range(K):
            inner[r].zero_grad()
            x, y = batch(t, r, torch.float64)
            F.cross_entropy(models[r](x), y).backward()
            inner[r].step()
        if t % H == 0:
            pair = random_pairs(K, seed, t // H - 1)
            theta = [[p.detach().clone() for p in m.parameters()] for m in models]
            for r in range(K):
                group = [r] if pair[r] is None else sorted([r, pair[r]])
                for i, p in enumerate(models[r].parameters()):
                    mean = sum(phi[j][i] for j in group) / len(group)
                    mean_g = sum(theta[j][i] - phi[j][i] for j in group) / len(group)
                    mom[r][i] += (outer_momentum - 1) * mom[r][i] + outer_lr * mean_g + \
                        gamma * (mean - phi[r][i])
            for r in range(K):
                with torch.no_grad():
                    for i, p in enumerate(models[r].parameters()):
                        phi[r][i] += mom[r][i]
                        p.copy_(phi[r][i])
        after.append([[p.detach().clone() for p in m.parameters()] for m in models])
    return after


@pytest.mark.parametrize("gamma", [None, 0.3], ids=["gamma=outer_lr", "gamma=0.3"])
def test_noloco_equals_the_reference_update(group, gamma):
    """Each rank's parameters after every step against the reference's outer step on K
    simulated workers with the same pairings, to 1e-12 (float64)."""
    H, steps, lr = 2, 8, 0.05
    want = reference_noloco(group.size, steps, H, lr, 0.7, 0.5, gamma, seed=3)
    model = mlp(torch.float64)
    opt = lowcomm.NoLoCo(model, torch.optim.SGD(model.parameters(), lr=lr), group, period=H,
                         outer_lr=0.7, outer_momentum=0.5, gamma=gamma, seed=3)

    def check(step):
        for p, w in zip(model.parameters(), want[step - 1][group.rank]):
            assert torch.allclose(p.detach(), w, rtol=0, atol=1e-12), f"step {step}"
    train(opt, model, group, steps, check)
    assert opt.rounds == steps // H
    opt.finish()                                 # the rank average, on every rank
    assert len(set(group.allgather_object(state_sha256(model)))) == 1
    final = [torch.stack([want[-1][r][i] for r in range(group.size)]).mean(0)
             for i in range(len(want[-1][0]))]
    for p, w in zip(model.parameters(), final):
        assert torch.allclose(p.detach(), w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma", [None, 0.3], ids=["theta", "theta-and-phi"])
def test_noloco_sends_one_model_to_one_peer_per_outer_step(group, gamma):
    """Inner steps send nothing; an outer step sends this rank's θ (and φ where γ ≠ β) to its
    one peer, 4d bytes (8d) in one sendrecv, the same at K = 2 and 4: no collective. On 4 ranks
    the models differ until finish() averages them (ranks meet in pairs only)."""
    H, steps = 3, 9
    model = mlp()
    opt = lowcomm.NoLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), group, period=H, gamma=gamma)
    d = sum(p.numel() for p in model.parameters())
    message = 4 * d * (1 if gamma is None else 2)
    group.ledger.reset()

    def check(step):
        assert sent(group) == (step // H) * message, f"step {step}"
        assert {r["op"] for r in group.ledger.rows()} <= {"sendrecv"}, group.ledger.rows()
    train(opt, model, group, steps, check)
    if group.size > 2:                           # 4 ranks: pairs, not everyone, meet
        assert len(set(group.allgather_object(state_sha256(model)))) > 1
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


@pytest.mark.parametrize("spec", ["noloco:period=2,seed={r}", "noloco:period={p}",
                                  "desloc:period_u={p}"])
def test_desloc_and_noloco_refuse_ranks_with_other_schedules(group, spec):
    """A rank whose period or seed differs would wait for a peer or an all-reduce that never
    comes: every rank gets a CommError naming the odd rank at build."""
    r, p = group.rank, 2 + (group.rank == group.size - 1)
    model = mlp()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(lowcomm.CommError, match=r"ranks \[[0-9, ]*\] hold differently named or shaped "
                                                r"parameters or (settings|periods)") as e:
        lowcomm.build(spec.format(r=r, p=p), model, inner, group)
    assert f"{group.size - 1}" in str(e.value)


def test_desloc_a_parameter_without_adam_state_on_a_rank_takes_part_with_zero_moments(group):
    """Rank 0 alone uses the second head: on the other ranks torch Adam never made its state.
    At the moments' averaging every rank holds the mean of rank 0's moments and the others'
    zeros (the state torch Adam starts from), and nothing hangs on a missing tensor."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(12, 4), "b": nn.Linear(12, 4)})
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = lowcomm.DesLoc(model, inner, group, period=1, period_u=2, period_v=2)
    before = {}
    inner.register_step_post_hook(lambda *_: before.update(
        {k: inner.state[model["b"].weight][k].clone() for k in ("exp_avg", "exp_avg_sq")}
        if model["b"].weight in inner.state else {}))
    for step in (1, 2):
        opt.zero_grad()
        x, y = batch(step, group.rank)
        out = model["a"](x) + (model["b"](x) if group.rank == 0 else 0)
        F.cross_entropy(out, y).backward()
        opt.step()
    every = group.allgather_object(before)       # just before the averaging of step 2
    st = inner.state[model["b"].weight]
    for k in ("exp_avg", "exp_avg_sq"):
        assert bool(every[0][k].abs().sum() > 0)
        assert all(k not in e for e in every[1:]), "torch Adam made a state for an unused parameter"
        assert torch.allclose(st[k], every[0][k] / group.size, rtol=1e-6, atol=0), k
    opt.finish()
# SparseLoCo ------------------------------------------------------------------------------------
def tiles(m: np.ndarray, s: int) -> np.ndarray:
    """The chunks of m, one row each: a matrix's s×s tiles (sides: the largest divisors within
    s) in row-major tile order, each read row by row; a vector's runs of s."""
    sides = chunks(m.shape, s)
    m2 = m.reshape(m.shape[0], -1) if m.ndim >= 2 else m
    return np.stack([m2[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, sides))].reshape(-1)
                     for idx in np.ndindex(*[n // c for n, c in zip(m2.shape, sides)])])


def untiles(rows: np.ndarray, shape, s: int) -> np.ndarray:
    sides = chunks(shape, s)
    flat = (shape[0], int(np.prod(shape[1:]))) if len(shape) >= 2 else shape
    out = np.zeros(flat)
    for j, idx in enumerate(np.ndindex(*[n // c for n, c in zip(flat, sides)])):
        out[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, sides))] = rows[j].reshape(sides)
    return out.reshape(shape)


def quantized_2bit(v: np.ndarray) -> np.ndarray:
    """The authors' statistical 2-bit quantiser on one block of values: mean μ, 4 bins of width
    6σ/4 (σ unbiased) centred so that code = clip(round((v − μ)/w + 2), 0, 3); each code decodes
    to μ plus the mean of its bin's centred values, both sent as float32."""
    mu = v.mean()
    c = v - mu
    w = 6 * np.sqrt((c ** 2).sum() / max(len(v) - 1, 1)) / 4
    codes = np.clip(np.round(c / (w if w > 0 else 1.0) + 2), 0, 3).astype(int)
    means = np.array([c[codes == j].mean() if (codes == j).any() else 0.0 for j in range(4)])
    return np.float32(mu).astype(np.float64) + means.astype(np.float32).astype(np.float64)[codes]


def paper_sparseloco(K, rounds, H, lr, beta, s, k, alpha):
    """Algorithm 1 of Sarfi et al. 2025 on K simulated ranks with inner SGD: after every outer
    step θ and every rank's accumulator e_r. Per parameter (each has its own chunk size here,
    so its own quantiser block): e_r ← βe_r + (θ − θ_r); of every chunk the k largest |e_r|,
    2-bit quantised; e_r loses what was sent; θ ← θ − α·(1/K)Σ_r sent_r."""
    model = mlp(torch.float64)
    theta = [p.detach().numpy().copy() for p in model.parameters()]
    e = [[np.zeros_like(p) for p in theta] for _ in range(K)]
    after = []
    for t in range(rounds):
        sent = []
        for r in range(K):
            x = [v.copy() for v in theta]
            for h in range(1, H + 1):
                with torch.no_grad():
                    for p, v in zip(model.parameters(), x):
                        p.copy_(torch.from_numpy(v))
                g = [q.numpy() for q in grads(model, t * H + h, r)]
                x = [v - lr * gi for v, gi in zip(x, g)]
            mine = []
            for i in range(len(theta)):
                e[r][i] = beta * e[r][i] + (theta[i] - x[i])
                rows = tiles(e[r][i], s)
                kk = min(k, rows.shape[1])
                idx = np.argsort(-np.abs(rows), axis=1)[:, :kk]
                q = np.zeros_like(rows)
                np.put_along_axis(q, idx, quantized_2bit(np.take_along_axis(rows, idx, 1).reshape(-1))
                                  .reshape(idx.shape), 1)
                e[r][i] = e[r][i] - untiles(q, theta[i].shape, s)
                mine.append(untiles(q, theta[i].shape, s))
            sent.append(mine)
        for i in range(len(theta)):
            theta[i] = theta[i] - alpha * sum(m[i] for m in sent) / K
        after.append(([v.copy() for v in theta], [[v.copy() for v in er] for er in e]))
    return after


def test_sparseloco_equals_the_papers_equations(group):
    """Outer step by outer step, θ and this rank's accumulator against the reference above (to
    1e-6: the exchanged average is summed in float32, the payload's precision)."""
    H, lr, beta, s, k, alpha, rounds = 3, 0.05, 0.9, 8, 3, 0.8, 3
    want = paper_sparseloco(group.size, rounds, H, lr, beta, s, k, alpha)
    model = mlp(torch.float64)
    opt = lowcomm.SparseLoCo(model, torch.optim.SGD(model.parameters(), lr=lr), group, period=H,
                             chunk=s, topk=k, decay=beta, outer_lr=alpha)
    names = [n for n, _ in model.named_parameters()]

    def check(step):
        if step % H:
            return
        params, acc = want[step // H - 1]
        for p, w in zip(model.parameters(), params):
            assert np.allclose(p.detach().numpy(), w, rtol=0, atol=1e-6), f"θ, step {step}"
        for n, w in zip(names, acc[group.rank]):
            assert np.allclose(opt.accumulators[n].numpy(), w, rtol=0, atol=1e-6), f"e, step {step}"
        assert len(set(group.allgather_object(state_sha256(model)))) == 1
    train(opt, model, group, rounds * H, check)
    opt.finish()


def sparseloco_bytes(shapes, s: int, k: int) -> int:
    """P of the format sent: per chunk k values of 2 bits (the paper's) and k indices of
    ⌈log2 chunk⌉ bits, bit-packed per group of equal-size chunks (m values), and a 20-byte
    quantiser table (mean + 4 bin values, float32) per 2048 values."""
    groups: dict[int, int] = {}
    for shape in shapes:
        sides = chunks(shape, s)
        row = int(np.prod(sides))
        groups[row] = groups.get(row, 0) + int(np.prod(shape)) // row * min(k, row)
    return sum(-(-m * 2 // 8) + 20 * -(-m // 2048) + -(-m * max(1, math.ceil(math.log2(row))) // 8)
               for row, m in groups.items())


@pytest.mark.parametrize("width", [16, 128])
def test_sparseloco_bytes_are_k_values_of_2_bits_and_indices_per_chunk(group, width):
    """Per outer step each rank all-gathers P bytes: (K − 1)·P sent. A 128×128 matrix is four
    64×64 tiles of which 64 values each go (1.56 %): 256·(2 + 12) bits + one table."""
    torch.manual_seed(0)
    model = mlp() if width == 16 else nn.Linear(128, 128, bias=False)
    opt = lowcomm.SparseLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), group, period=2)
    P = sparseloco_bytes([tuple(p.shape) for p in model.parameters()], 64, 64)
    if width == 128:
        assert P == 256 * 2 // 8 + 20 + 256 * 12 // 8
    assert opt.payload_bytes() == P
    group.ledger.reset()
    for step in range(1, 5):
        opt.zero_grad()
        x = torch.randn(8, width if width == 128 else 12, generator=torch.Generator().manual_seed(step + 10 * group.rank))
        model(x).square().mean().backward()
        opt.step()
    assert sent(group) == 2 * (group.size - 1) * P             # two outer steps
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


# DisTrO and MuLoCo's error-feedback 2-bit variant: presets ----------------------------------------
def test_distro_is_demo_with_1_bit_values_its_bytes_packed_signs_and_int16_indices(group):
    model = mlp()
    opt = lowcomm.build("distro", model, torch.optim.SGD(model.parameters(), lr=0.01), group)
    assert (opt.topk, opt.chunk, opt.value_bits, opt.exchange) == (4, 64, 1, "allgather")
    # one chunk per tensor (16×12, 16, 4×16, 4: sides within 64), 4 coefficients of each:
    # ⌈4/8⌉ byte of signs and 4 int16 indices per bucket
    P = 4 * (1 + 4 * 2)
    assert opt.payload_bytes() == P
    group.ledger.reset()
    train(opt, model, group, 3)
    assert sent(group) == 3 * (group.size - 1) * P
    opt.finish()
    assert len(set(group.allgather_object(state_sha256(model)))) == 1


def test_muloco_ef2bit_is_diloco_over_muon_with_error_fed_2_bit_pseudo_gradients(group):
    model = mlp()
    opt = lowcomm.build("muloco-ef2bit:period=2", model,
                        MuonAdamW(model.parameters(), lr=0.02, weight_decay=0.01), group)
    assert opt.compressor.error_feedback and opt.compressor.codec.bits == 2
    assert opt.compressor.collective == "allgather" and opt.outer_optimizer.defaults["nesterov"]
    n = sum(p.numel() for p in model.parameters())
    P = -(-n // 4) + 20 * -(-n // 2048)
    group.ledger.reset()
    train(opt, model, group, 4)
    assert sent(group) == 2 * (group.size - 1) * P
    assert len(set(group.allgather_object(state_sha256(model)))) == 1
    opt.finish()
    with pytest.raises(lowcomm.ConfigError, match="Muon inside"):
        lowcomm.build("muloco-ef2bit", mlp(), torch.optim.AdamW(mlp().parameters()), group)
