"""SyncDP on K ranks with batch B equals one process with batch K·B, on every rank.

The reference is plain torch with the same seed; SyncDP runs with every algorithm, with and
without overlap, with gradient accumulation, with a parameter unused on some ranks, and through
the Horovod backend."""
import pytest
import torch
import torch.nn.functional as F

import lowcomm
from helpers import assert_models_close, random_batch, seeded_mlp
from under_mpi import SIZE

# 3: uneven chunks, 4: a power of two; hierarchical needs a topology (check_topology.py)
pytestmark = pytest.mark.mpi(sizes=(1, 3, 4))
B, STEPS = 6, 4
ALGORITHMS = [a for a in lowcomm.ALGORITHMS if a != "hierarchical"]


def make():
    return seeded_mlp(10, 64, 64, 3, unused=True)


def batch(step):
    return random_batch(step, SIZE * B)


@pytest.fixture(scope="module")
def reference():
    """One process, batch K·B, SGD with momentum."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def distributed(comm, passes=1, backend="mpi", **kw):
    r = comm.rank
    model = make()
    with torch.no_grad():   # ranks start apart; SyncDP's broadcast from rank 0 must fix that
        for p in model.parameters():
            p.add_(0.01 * r)
    cls = lowcomm.HorovodDP if backend == "horovod" else lowcomm.SyncDP
    opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
              backward_passes_per_step=passes, **kw)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        for m in range(passes):
            sl = slice(m * B // passes, (m + 1) * B // passes)
            (F.cross_entropy(model(x[sl]), y[sl]) / passes).backward()
        opt.step()
    opt.close()
    return model


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_equals_single_process_large_batch(algorithm, overlap, comm, reference):
    got = distributed(comm, algorithm=algorithm, overlap=overlap, bucket_mb=0.01)
    assert_models_close(got, reference, "SyncDP vs one process on K·B")


def test_two_backward_passes_per_step(comm, reference):
    got = distributed(comm, passes=2, algorithm="ring", bucket_mb=0.01)
    assert_models_close(got, reference, "backward_passes_per_step=2 vs one process on K·B")


def test_one_bucket(comm, reference):
    got = distributed(comm, algorithm="rabenseifner", bucket_mb=64)
    assert_models_close(got, reference, "one bucket vs one process on K·B")


def test_gradients_are_views_of_shared_buckets_reduced_in_place(comm, reference):
    """On one node (CPU, auto): the buckets are registered shared memory and p.grad is the
    bucket's view after a step (no copy out); zero_grad(set_to_none=False) keeps the views, so
    the next backward accumulates into the buckets themselves (no copy in) — the same model."""
    r = comm.rank
    model = make()
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
                         bucket_mb=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
    if SIZE == 1:     # one rank: nothing to exchange, no buckets (the optimizer's own step)
        assert opt.reducer is None and not opt._hooks, "a reducer on one rank"
    else:
        buckets = opt.reducer.buckets
        shared = [opt.reducer._thread_comm.registered(b.flat) is not None for b in buckets]
        assert all(shared), f"buckets in shared memory: {shared}"
        spans = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * 4) for b in buckets]
        views = [any(a <= p.grad.data_ptr() < z for a, z in spans)
                 for n, p in model.named_parameters() if not n.startswith("unused.")]
        assert all(views), f"p.grad not a bucket view for {views.count(False)} parameters"
        assert model.unused.weight.grad is None, "no rank's gradient: None, as under torch DDP"
    opt.close()
    assert_models_close(model, reference, "gradients as bucket views vs one process on K·B")


def test_overlap_auto_follows_the_cores_per_rank(comm):
    """overlap=None: a reducer thread only where a rank has a spare core (CPU model)."""
    model = make()
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    spare = comm.cores_per_rank() >= 2
    thread = opt.reducer is not None and opt.reducer._pool is not None
    assert opt._overlap == spare and thread == (spare and SIZE > 1), \
        f"overlap {opt._overlap} with {comm.cores_per_rank()} cores per rank, thread {thread}"
    opt.close()


def test_a_step_all_reduces_every_gradient_once(comm):
    model = make()
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, algorithm="mpi")
    before = comm.ledger.get("allreduce.mpi")
    x, y = batch(0)
    F.cross_entropy(model(x[comm.rank * B:(comm.rank + 1) * B]),
                    y[comm.rank * B:(comm.rank + 1) * B]).backward()
    opt.step()
    opt.close()
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    slots = 4 * len(list(model.parameters()))      # which tensors any rank had a gradient for
    got = comm.ledger.get("allreduce.mpi").bytes_sent - before.bytes_sent
    assert got == 2 * (SIZE - 1) * (grad_bytes + slots) // SIZE, f"{got} bytes for {grad_bytes} of gradients"


def test_stepping_after_one_of_two_declared_backward_passes_is_an_error(comm):
    """Not a silent partial update."""
    model = make()
    opt = lowcomm.SyncDP(model, torch.optim.SGD(model.parameters(), lr=0.1), comm,
                         backward_passes_per_step=2)
    x, y = batch(0)
    F.cross_entropy(model(x[:B]), y[:B]).backward()
    with pytest.raises(lowcomm.LowcommError, match="1 of 2"):
        opt.step()
    opt.close()


@pytest.mark.mpi(sizes=(3,))
def test_the_horovod_backend_gives_the_same_parameters(comm, reference):
    calls = comm.ledger.get("allreduce.horovod").calls
    hv = distributed(comm, backend="horovod")
    own = distributed(comm, algorithm="ring")
    assert_models_close(hv, reference, "horovod backend vs one process on K·B")
    assert_models_close(hv, own, "horovod vs lowcomm's ring")
    assert comm.ledger.get("allreduce.horovod").calls - calls == STEPS, "horovod steps in the ledger"
