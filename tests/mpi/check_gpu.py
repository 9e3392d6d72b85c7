"""CUDA tensors through lowcomm on 2 ranks (``make test-gpu``; one GPU per rank, or both ranks on
one): every all-reduce algorithm on a CUDA tensor equals the exact sum and leaves it on its
device; every registered method trains a BatchNorm model on CUDA and a ``with`` block ends it
with one model — parameters and buffers — on every rank, still on the GPU.

The normal suite never runs this file. Without CUDA it fails (it does not skip): a GPU check
that passes on a machine without a GPU would be a check not made. ``LOWCOMM_TEST_DEVICE=cpu``
runs the same cases on the CPU, to check the file itself."""
import os

import pytest
import torch

import check_optimizer as opt_cases
from lowcomm.comm.collectives import ALGORITHMS, allreduce_
from lowcomm.run.evaluate import state_sha256

pytestmark = pytest.mark.mpi(sizes=(2,))


@pytest.fixture(scope="module")
def device(comm) -> torch.device:
    """This rank's device: GPU ``rank % count`` ($LOWCOMM_TEST_DEVICE=cpu: the CPU)."""
    if os.environ.get("LOWCOMM_TEST_DEVICE") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("make test-gpu needs CUDA: torch.cuda.is_available() is False on rank "
                    f"{comm.rank} (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("algorithm", ["auto", *ALGORITHMS])
def test_allreduce_of_a_device_tensor_is_the_exact_sum_on_that_device(algorithm, dtype, comm, device):
    kwargs = {}
    if algorithm == "hierarchical":           # one rank per datacenter: both levels crossed
        from lowcomm.comm.topology import Topology
        kwargs["levels"] = Topology.from_env(comm, "dc:2,rank:1").comms(comm)
    n = (1 << 20) + 3
    t = (torch.arange(n, device=device) % 7 + comm.rank).to(dtype)
    out = allreduce_(t, comm, algorithm, **kwargs)
    expected = ((torch.arange(n) % 7) * comm.size + comm.size * (comm.size - 1) / 2).to(dtype)
    assert out is t and t.device == device and t.dtype == dtype
    assert torch.equal(t.cpu(), expected), f"{algorithm}: {(t.cpu() != expected).sum()} wrong"


@pytest.mark.parametrize("name", opt_cases.METHODS)
def test_every_method_trains_on_the_device_and_ends_with_one_model(name, comm, device):
    torch.manual_seed(0)
    model = opt_cases.make_model().to(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with opt_cases.METHODS[name](model, inner, comm) as opt:
        if getattr(opt, "is_server", False):
            opt.serve()
        else:
            for step in range(1, opt_cases.STEPS + 1):
                x, y = opt_cases.batch(step, comm.rank)
                opt.zero_grad()
                opt_cases.loss_of(model, x.to(device), y.to(device)).backward()
                opt.step()
    state = list(model.parameters()) + list(model.buffers())
    assert all(t.device.type == device.type for t in state), f"{name} moved a tensor off {device}"
    assert all(torch.isfinite(t.float()).all() for t in state if t.is_floating_point())
    assert len(set(comm.allgather_object(state_sha256(model)))) == 1, "the ranks' states differ"
    assert int(model[1].num_batches_tracked) > 0, "BatchNorm statistics never moved"


@pytest.mark.parametrize("spec", ["zero2", "zero1:algorithm=ring", "zero2:qgz=int4,qwz=int8",
                                  "zero2:partition=tensor"])
def test_zero_on_the_device_equals_syncdp_and_reports_device_memory(spec, comm, device):
    """ZeRO on CUDA parameters (buckets, ranges and collectives staged by Comm): the same model as
    SyncDP (quantized: within 1e-2), on every rank, still on the device; optimizer state per rank
    half of SyncDP's; the memory a run reports is the device's."""
    from lowcomm.run.memory import measure
    import lowcomm

    def run(s):
        torch.manual_seed(0)
        model = opt_cases.make_model().to(device)
        opt = lowcomm.build(s, model, torch.optim.AdamW(model.parameters(), lr=0.01), comm)
        for step in range(1, 5):
            x, y = opt_cases.batch(step, comm.rank)
            opt.zero_grad()
            opt_cases.loss_of(model, x.to(device), y.to(device)).backward()
            opt.step()
        mem = measure(model, opt)
        opt.finish()
        return model, mem
    model, mem = run(spec)
    ref, ref_mem = run("syncdp")
    tol = 1.5 * 4 * 0.01 if "qgz" in spec else 1e-6   # quantized: Adam's steps (<= lr each) apart
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == "cuda" and torch.allclose(p, q, atol=tol, rtol=tol), n
    assert len(set(comm.allgather_object(state_sha256(model)))) == 1
    assert mem["peak_of"] == "cuda" and mem["peak_bytes"] > 0
    assert mem["optimizer_state_bytes"] <= ref_mem["optimizer_state_bytes"] * 0.75, (mem, ref_mem)
