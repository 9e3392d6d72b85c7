"""Zero-gradient parameters stay put, and 1-bit Adam equals its equations, on every rank.

* a model with an unused layer (gradients None) and a dead layer (behind a ReLU that never
  fires: weight and bias get gradients of exactly zero) trains under SyncDP with every
  compressor (both collectives where the payloads are gathered) and under 1-bit Adam past its
  warm-up: those parameters are bit-for-bit unchanged, the others moved, the ranks agree;
* 1-bit Adam's compression stage equals a direct implementation of its update
  (lowcomm.strategies.optimizers.onebit_adam, steps 1-6, with the momentum mask and the step bound
  active), and, where the frozen variance is the same for every coordinate, Tang et al.'s
  Algorithm 1 (compress m, then divide by the denominator);
* (2 ranks) 1-bit Adam on the built-in task (d_model 32, one layer, freeze_step 10): no NaN,
  the attention key bias (whose gradient is zero up to rounding) stays put.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import agree, control, flat
from lowcomm.comm.ledger import Ledger
from lowcomm.compress import COMPRESSORS, build_compressor
from lowcomm.run.config import CompressorConfig
from lowcomm.strategies.optimizers.onebit_adam import OneBitAdam
from under_mpi import RANK, SIZE

pytestmark = pytest.mark.mpi(sizes=(2, 3))   # even K: sign-mv's owners send base-3 digits; odd: flags
K = SIZE
GATHERED = ("int8", "qsgd", "topk", "sign", "sign-mv", "ef-sign")
#: every compressor with the collectives it can use (the summed ones ignore it)
RUNS = [(name, coll) for name in COMPRESSORS
        for coll in (("allgather", "two-phase") if name in GATHERED else ("two-phase",))]
STILL = ("unused.weight", "unused.bias", "dead.weight", "dead.bias")


@pytest.fixture(scope="module")
def ctl(comm):
    return control(comm)


def batch(step, k=RANK, B=8):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(K * B, 8, generator=g)
    y = (x[:, :3].argmax(1) + (x[:, 3] > 1).long()) % 3
    return x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]


class Net(torch.nn.Module):
    """Used layers a, b; ``unused`` is never called; ``dead`` sits behind a ReLU that never
    fires (its bias is far below zero), so its weight and bias get gradients of exactly 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.unused = torch.nn.Linear(16, 16)
        self.dead = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.dead.bias.fill_(-1e3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + torch.relu(self.dead(x)).sum(1, keepdim=True)


def train(model, opt, steps):
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def assert_still(model, before, ctl):
    """The zero-gradient parameters bit for bit where they were, the others moved, one model."""
    same = all(agree(ctl, p) for p in model.parameters())
    moved = [f"{name} by {float((p - before[name]).abs().max()):.3g}"
             for name, p in model.named_parameters() if name in STILL and not torch.equal(p, before[name])]
    idle = [name for name, p in model.named_parameters() if name not in STILL and torch.equal(p, before[name])]
    assert not moved, f"moved: {', '.join(moved)}"
    assert not idle, f"did not move (the check can fail): {idle}"
    assert same, "the ranks differ"


@pytest.mark.parametrize("name, coll", RUNS, ids=[f"{n}-{c}" for n, c in RUNS])
def test_unused_and_dead_layers_stay_put_under_a_compressor(name, coll, comm, ctl):
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = CompressorConfig(name=name, collective=coll, start_iter=0, ratio=0.1, approx_rank=2)
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         comm.dup(Ledger()), compressor=build_compressor(cfg))
    train(model, opt, 4)
    opt.close()
    assert_still(model, before, ctl)


def test_unused_and_dead_layers_stay_put_under_onebit_adam_past_its_warm_up(comm, ctl):
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = OneBitAdam(model, torch.optim.Adam(model.parameters(), lr=0.01), comm.dup(Ledger()),
                     freeze_step=2)
    train(model, opt, 8)
    opt.close()
    assert_still(model, before, ctl)


class Branch(torch.nn.Module):
    """``a`` always used; ``b`` only while ``use_b``; ``c`` only on the ranks in ``c_on``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)
        self.use_b, self.c_on = True, range(K)

    def forward(self, x):
        out = self.a(x)
        if self.use_b:
            out = out + self.b(x)
        return out + self.c(x) if RANK in self.c_on else out


BRANCH = {   # spec, and the steps of each phase that follow the two with the branch taken
    "syncdp": "syncdp",
    "syncdp-int8": "syncdp:compressor=int8",
    "onebit-adam": "onebit-adam:freeze_step=4",                       # warm-up, then 1-bit
    "zeroone-adam": "zeroone-adam:var_freeze_step=4,var_update_scaler=2",   # dense, sync, local
}


@pytest.mark.parametrize("name", BRANCH)
def test_a_branch_no_rank_takes_any_more_stays_put_under_adam(name, comm, ctl):
    """A branch taken for two steps, then by no rank: its parameters stay bit for bit where the
    last step that used them left them (their gradients None, as under torch and DDP, where
    Adam skips them); before, SyncDP + Adam moved them by 0.039 and 1-bit Adam by 0.077."""
    model = Branch()
    opt = lowcomm.build(BRANCH[name], model, torch.optim.Adam(model.parameters(), lr=0.01), comm.dup(Ledger()))
    train(model, opt, 2)
    assert model.b.weight.grad is not None, "the branch was trained (the check can fail)"
    model.use_b = False
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, opt, 8)
    opt.finish()
    moved = [n for n, p in model.named_parameters() if n.startswith("b.") and not torch.equal(p, before[n])]
    assert not moved, f"{name}: {moved} moved without a gradient on any rank"
    assert not torch.equal(model.a.weight, before["a.weight"]), "a did not move (the check can fail)"
    assert all(agree(ctl, p) for p in model.parameters()), "the ranks differ"


def test_a_branch_one_rank_takes_is_averaged_with_zeros_from_the_others(comm, ctl):
    """Where some ranks have a gradient, SyncDP averages with zeros for the others (torch DDP's
    rule): ``c``, used on rank 0 only, gets (1/K)·g_0."""
    model, ref = Branch(), Branch()
    model.c_on = ref.c_on = (0,)
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm.dup(Ledger()))
    x, y = batch(0)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    g0 = ctl.allgather(ref.c.weight.grad if ref.c.weight.grad is not None else torch.zeros(3, 8))[0]
    assert model.c.weight.grad is not None and torch.allclose(model.c.weight.grad, g0 / K), \
        "c's gradient is not rank 0's over K"
    opt.close()


def C(v: torch.Tensor, n: int) -> torch.Tensor:
    """(‖v‖₂/√n)·sign(v), sign(+0) = +1 (the IEEE sign bit), in v's dtype."""
    scale = (torch.linalg.vector_norm(v) / math.sqrt(n)).float().to(v.dtype) if n else v.new_zeros(())
    return torch.where(torch.signbit(v), -scale, scale)


class Reference:
    """1-bit Adam's compression stage written from its equations, for all K ranks at once (every
    rank runs it on the gathered gradients). ``precondition=False``: Tang et al.'s Algorithm 1
    with torch Adam's bias corrections (compress m, then divide by the denominator). A parameter
    no rank has a gradient for sends zeros and stays put (``present``: 0 on its coordinates)."""

    def __init__(self, opt: OneBitAdam, precondition: bool = True):
        self.opt, self.pre = opt, precondition
        self.d, self.D, self.c = opt.d, opt.D, opt.chunk
        self.worker = torch.zeros(K, self.D)
        self.server = torch.zeros(K, self.c)

    def step(self, params, grads: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
             freeze: int, t: int, present: torch.Tensor):
        """One step from the replicated state; returns the new parameters (flat)."""
        st = [self.opt._state(p) for p in params]     # Adam's, as torch makes it (none yet: zeros)
        x, m, v = flat(params), flat(s["exp_avg"] for s in st), flat(s["exp_avg_sq"] for s in st)
        denom = v.sqrt() / math.sqrt(1 - beta2 ** freeze) + eps
        moved = (v > 0).float()
        bound = max(1.0, (1 - beta1) / math.sqrt(1 - beta2)) * (1 - beta1 ** t)
        sent = torch.zeros(K, self.D)
        for k in range(K):
            mk = beta1 * m + (1 - beta1) * grads[k]
            u = torch.zeros(self.D)
            u[:self.d] = ((mk / denom).clamp(-bound, bound) * moved if self.pre else mk) * present
            p = u + self.worker[k]
            sent[k] = C(p, self.d)
            self.worker[k] = p - sent[k]
            self.worker[k, self.d:] = 0
        out = torch.zeros(self.D)
        for j in range(K):
            real = max(0, min(self.c, self.d - j * self.c))
            w = sent[:, j * self.c:(j + 1) * self.c].mean(0) + self.server[j]
            out[j * self.c:j * self.c + real] = C(w[:real], real)
            self.server[j] = w - out[j * self.c:(j + 1) * self.c]
            self.server[j, real:] = 0
        step = out[:self.d] * moved if self.pre else out[:self.d] / denom
        return x - lr / (1 - beta1 ** t) * step * present


@pytest.mark.parametrize("precondition", [True, False], ids=["its-equations", "tang-algorithm-1"])
def test_onebit_adam_equals_its_equations_and_the_paper_where_the_variance_is_uniform(precondition, comm, ctl):
    """OneBitAdam against :class:`Reference` for a few compressed steps; with
    ``precondition=False`` the frozen variance is made the same for every coordinate first."""
    FREEZE, LR = 3, 0.01
    model = Net()
    params = list(model.parameters())
    opt = OneBitAdam(model, torch.optim.Adam(params, lr=LR), comm.dup(Ledger()), freeze_step=FREEZE)
    train(model, opt, FREEZE)
    with torch.no_grad():
        for p in params:
            v = opt._state(p)["exp_avg_sq"]
            if not precondition:
                v.fill_(0.25)
            elif p is model.a.weight:     # a few tiny variances: the step bound binds there
                v.view(-1)[:8] = 1e-20
    ref = Reference(opt, precondition)
    off = []
    for step in range(FREEZE, FREEZE + 4):
        xb, yb = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        grads = ctl.allgather(flat(torch.zeros_like(p) if p.grad is None else p.grad for p in params))
        present = flat(torch.full_like(p, float(p.grad is not None)) for p in params)   # same on every rank
        want = ref.step(params, grads, LR, 0.9, 0.999, 1e-8, FREEZE, step + 1, present)
        opt.step()
        if not torch.allclose(flat(params), want, rtol=1e-5, atol=1e-7):
            off.append(f"step {step + 1} by {float((flat(params) - want).abs().max()):.3g}")
    opt.close()
    assert not off, f"off at {', '.join(off)}"
    if precondition:      # v = 0 there: the momentum mask
        still = flat([model.unused.weight, model.unused.bias, model.dead.weight, model.dead.bias])
        assert float(still.abs().max()) > 0 and torch.equal(still, flat(
            [p for n, p in Net().named_parameters() if n in STILL])), "masked parameters moved"


@pytest.mark.mpi(sizes=(2,))
def test_onebit_adam_on_the_builtin_task_keeps_the_key_bias_put_and_no_nan(comm):
    """d_model 32, one layer, freeze_step 10: before, the key bias (gradient zero up to
    rounding, ~1e-12) reached |4e5| and the run died with a NaN by step 100."""
    from lowcomm.tasks import bytelm
    built = []

    def build(cfg):
        built.append(bytelm.model(cfg))
        return built[-1]

    task = lowcomm.from_functions(build, bytelm.loss, bytelm.batch, bytelm.eval_batches)
    summary = lowcomm.train(task, strategy="onebit-adam:freeze_step=10",
                            steps=150, log_every=50, comm=comm,
                            set=["model.d_model=32", "model.n_layers=1", "optimizer.name=adam",
                                 "data.max_bytes=300000", "eval_batches=2"])
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 3.0, \
        f"final loss {summary['final_loss']}"
    key = built[-1].blocks[0].qkv.bias.detach()[32:64]
    assert float(key.abs().max()) < 0.05, f"the attention key bias moved to {float(key.abs().max()):.3g}"
