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
import lowcomm
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


def shared_gpu(comm, device) -> bool:
    """Whether ranks share a GPU (NCCL, hence fsdp on CUDA, refuses that)."""
    import socket
    where = comm.allgather_object((socket.gethostname(), str(device)))
    return device.type == "cuda" and len(set(where)) < comm.size


@pytest.mark.parametrize("name", opt_cases.METHODS)
def test_every_method_trains_on_the_device_and_ends_with_one_model(name, comm, device):
    torch.manual_seed(0)
    model = opt_cases.make_model().to(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "fsdp" and shared_gpu(comm, device):     # see test_fsdp_over_nccl...
        with pytest.raises(lowcomm.CommError, match="NCCL needs one GPU per rank"):
            opt_cases.METHODS[name](model, inner, comm)
        return
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


@pytest.mark.mpi(sizes=(1, 2))   # one GPU: `launchers/local.sh -n 1 ... -k fsdp_over_nccl` runs NCCL
def test_fsdp_over_nccl_trains_gpt2_as_syncdp_does(comm, device):
    """FSDP2 over NCCL (lowcomm's torch.distributed group, ``cuda:nccl,cpu:gloo``) on a
    transformers GPT-2, each GPT2Block its own unit, against SyncDP on the same device (SGD with
    momentum: to 1e-5; CUDA's embedding backward adds atomically, so not bit for bit); a sharded
    checkpoint resumes bit for bit; ``finish`` leaves the whole model on the GPU on every rank.
    Where ranks share one GPU, NCCL cannot run them: the method must say so by name."""
    import io
    transformers = pytest.importorskip("transformers")

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).to(device)

    def train(model, opt, steps):
        for step in steps:
            x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(
                100 * step + comm.rank)).to(device)
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    model = gpt2()
    if shared_gpu(comm, device):
        with pytest.raises(lowcomm.CommError, match="NCCL needs one GPU per rank"):
            lowcomm.build("fsdp:wrap=GPT2Block", model, sgd(model), comm)
        return
    opt = lowcomm.build("fsdp:wrap=GPT2Block", model, sgd(model), comm)
    train(model, opt, range(2))
    buf = io.BytesIO()
    torch.save({"model": opt.model_state_dict(), "strategy": opt.state_dict()}, buf)
    train(model, opt, range(2, 4))
    opt.finish()
    again = gpt2()
    opt2 = lowcomm.build("fsdp:wrap=GPT2Block", again, sgd(again), comm)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    opt2.load_model_state_dict(saved["model"])
    opt2.load_state_dict(saved["strategy"])
    train(again, opt2, range(2, 4))
    opt2.finish()
    ref = gpt2()
    dp = lowcomm.SyncDP(ref, sgd(ref), comm)
    train(ref, dp, range(4))
    dp.finish()
    assert all(p.device == device for p in model.parameters()), "finish moved the model"
    assert state_sha256(again) == state_sha256(model), "the resumed run differs"
    assert len(set(comm.allgather_object(state_sha256(model)))) == 1, "the ranks' models differ"
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"{n}: FSDP and SyncDP differ"
