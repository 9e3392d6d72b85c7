"""DeMo, SPARTA, SPARTA under DiLoCo, 0/1 Adam, MuLoCo, DES-LOC, NoLoCo, SparseLoCo and the
DisTrO and MuLoCo-EF-2-bit presets: the pieces in one process (DeMo's transform and codec against
the paper's equations written out here, 0/1 Adam's schedule against its rule written out here,
NoLoCo's pairings), then the methods on 2 and 4 ranks under mpirun
(tests/mpi/check_new_methods.py)."""
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import shared_mpi_suite
from lowcomm.compress import Compressor, ErrorFeedback
from lowcomm.compress.bits import pack_uints, unpack_uints
from lowcomm.compress.demo import ChunkedDCT, ChunkTopK, QuantizedChunkTopK, chunk_side
from lowcomm.compress.quantize import StatQuant, stat_quantize
from lowcomm.errors import ArgumentError, ConfigError
from lowcomm.run.api import load_config
from lowcomm.run.registry import build
from lowcomm.strategies.chunks import ChunkBucket
from lowcomm.strategies.optimizers.demo import DeMo
from lowcomm.strategies.gossip.graphs import random_pairs
from lowcomm.strategies.optimizers.zeroone_adam import schedule


# DeMo's transform: the DCT-II of the paper, written out element by element ----------------------
def direct_dct(n: int) -> np.ndarray:
    """C[f, i] = a_f cos(π (2i + 1) f / 2n), a_0 = √(1/n), a_f = √(2/n): the orthonormal DCT-II."""
    out = np.empty((n, n))
    for f in range(n):
        for i in range(n):
            out[f, i] = math.sqrt((1 if f == 0 else 2) / n) * math.cos(math.pi * (2 * i + 1) * f / (2 * n))
    return out


def direct_chunked(x: np.ndarray, target: int) -> np.ndarray:
    """The coefficients of every chunk of x, one row per chunk, in row-major chunk order."""
    if x.ndim >= 2:
        m = x.reshape(x.shape[0], -1)
        n1, n2 = chunk_side(m.shape[0], target), chunk_side(m.shape[1], target)
        d1, d2 = direct_dct(n1), direct_dct(n2)
        return np.stack([(d1 @ m[a:a + n1, b:b + n2] @ d2.T).reshape(-1)
                         for a in range(0, m.shape[0], n1) for b in range(0, m.shape[1], n2)])
    n1 = chunk_side(x.size, target)
    d = direct_dct(n1)
    return np.stack([d @ x[a:a + n1] for a in range(0, x.size, n1)])


@pytest.mark.parametrize("shape,target", [((24, 40), 8), ((12, 5), 4), ((30,), 8), ((7,), 16),
                                          ((6, 2, 4), 4), ((64, 64), 64)])
def test_chunked_dct_is_the_papers_dct_and_its_inverse_is_exact(shape, target):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    t = ChunkedDCT(torch.Size(shape), target)
    c = t.encode(x)
    assert c.shape == (t.rows, t.row)
    assert np.allclose(c.numpy(), direct_chunked(x.numpy(), target), rtol=0, atol=1e-12)
    assert torch.allclose(t.decode(c), x, rtol=0, atol=1e-12)           # DCT-III ∘ DCT-II = I


def test_chunk_sides_are_the_largest_divisors_within_the_target():
    assert [chunk_side(n, 64) for n in (64, 128, 96, 100, 7, 97)] == [64, 64, 48, 50, 7, 1]
    assert ChunkedDCT(torch.Size([128, 96]), 64).sides == (64, 48)


@pytest.mark.parametrize("average", ["all", "senders"])
@pytest.mark.parametrize("bits", [0, 1])
def test_chunk_topk_mean_of_k_ranks_is_the_chosen_average(average, bits):
    """The mean of K = 3 ranks' top-3 of 16-element chunks, against a loop over the ranks'
    (index, value) pairs: "all" divides each coefficient's sum by K, "senders" (the DeMo
    reference's scatter_reduce mean) by the number of ranks that sent it; both differ here."""
    K, row, k, rows = 3, 16, 3, 5
    codec = QuantizedChunkTopK(row, k, 1, packed_indices=False, average=average) if bits else \
        ChunkTopK(row, k, average)
    payloads = [codec.encode(torch.randn(rows * row, generator=torch.Generator().manual_seed(r)),
                             "w", None) for r in range(K)]
    got = codec.decompress_mean([torch.stack([p[0][i] for p in payloads]) for i in
                                 range(len(payloads[0][0]))], payloads[0][1], K)
    sums, senders = {}, {}
    for r in range(K):
        x = torch.randn(rows * row, generator=torch.Generator().manual_seed(r)).view(rows, row)
        for j in range(rows):
            for i in x[j].abs().topk(k).indices.tolist():
                v = (1.0 if x[j, i] > 0 else -1.0) if bits else float(x[j, i])
                sums[j, i] = sums.get((j, i), 0.0) + v
                senders[j, i] = senders.get((j, i), 0) + 1
    want = torch.zeros(rows, row)
    for (j, i), total in sums.items():
        want[j, i] = total / (senders[j, i] if average == "senders" else K)
    assert torch.allclose(got.view(rows, row), want, rtol=0, atol=1e-6)
    assert any(n < K for n in senders.values())       # the two rules differ on this data
    with pytest.raises(ValueError, match="average must be one of all, senders, got 'mean'"):
        ChunkTopK(row, k, "mean")


def test_chunk_topk_at_full_k_is_exact_and_its_bytes_are_k_value_and_index_per_chunk():
    x = torch.randn(6 * 16, generator=torch.Generator().manual_seed(2))
    full = ChunkTopK(16, 32)                           # k is clamped to the chunk's 16
    payload, ctx = full.encode(x, "w", None)
    assert torch.equal(full.decompress(payload, ctx), x)
    sparse = ChunkTopK(16, 3)
    payload, ctx = sparse.encode(x, "w", None)
    assert [t.dtype for t in payload] == [torch.float32, torch.int16]
    assert sparse.payload_nbytes(x.numel(), torch.float32) == 6 * 3 * (4 + 2)
    assert sum(t.numel() * t.element_size() for t in payload) == 6 * 3 * (4 + 2)
    kept = sparse.decompress(payload, ctx).view(6, 16)
    for row, orig in zip(kept, x.view(6, 16)):         # the 3 largest magnitudes of each chunk
        top = orig.abs().topk(3).indices
        assert torch.equal(row[top], orig[top]) and int((row != 0).sum()) == 3
    assert sparse.bounds(6 * 16, 4) == [0, 32, 64, 80, 96]       # owners get whole chunks


def test_demo_resized_keeps_the_mean_momentum_and_cuts_the_server_errors_again():
    """2 old ranks → 3: each new rank's momentum is the old ranks' mean; the owners' server
    errors (rows 0–1 on old rank 0, rows 2–3 on old rank 1) make the whole bucket, which the
    3 new owners cut as their two-phase exchange does (rows 0–1, 2, 3)."""
    loop = object.__new__(DeMo)
    loop.name = "demo"
    loop.buckets = [ChunkBucket("demo4", [("w", None, 0, None, 0, 16)],
                            Compressor(ErrorFeedback(ChunkTopK(4, 2)), "two-phase"))]
    err = torch.arange(1.0, 17.0)

    def old(r):
        return {"model": {"w": torch.zeros(4, 4)}, "strategy": {"t": 5, "compressors": {"demo4": {
            "encoder": {"residuals": {"w": torch.full((16,), float(r + 1))}, "codec": {}},
            "exchange": {"server_error": {"demo4": err[8 * r:8 * (r + 1)]}}}}}}
    cuts = [(0, 8), (8, 12), (12, 16)]
    for r in range(3):
        loop.comm = SimpleNamespace(size=3, rank=r)
        state = loop.reshard([old(0), old(1)])["strategy"]["compressors"]["demo4"]
        assert torch.equal(state["encoder"]["residuals"]["w"], torch.full((16,), 1.5))
        assert torch.equal(state["exchange"]["server_error"]["demo4"], err[cuts[r][0]:cuts[r][1]])


def test_sparseloco_resized_keeps_theta_and_the_mean_accumulator():
    """θ is the same on every old rank; each new rank's accumulator is the old ranks' mean."""
    from lowcomm.strategies.outer.sparseloco import SparseLoCo
    loop = object.__new__(SparseLoCo)
    loop.buckets = [ChunkBucket("sparseloco4", [("w", None, 0, 16, 0, 16)], Compressor(
        ErrorFeedback(QuantizedChunkTopK(4, 2)), "allgather"))]
    theta = torch.arange(16.0)
    old = [{"outer": theta.clone(), "compressors": {"sparseloco4": {"encoder": {
        "residuals": {"w": torch.full((16,), float(r + 1))}, "codec": {}}}}} for r in range(2)]
    got = loop._reshard_extra(old)
    assert torch.equal(got["outer"], theta)
    assert torch.equal(got["compressors"]["sparseloco4"]["encoder"]["residuals"]["w"],
                       torch.full((16,), 1.5))


# 0/1 Adam's schedule, written out from the rule ------------------------------------------------
def test_zeroone_adam_schedule_follows_the_papers_policies():
    # κ = 2: T_v holds the multiples of an interval that starts at 1 and doubles after every 2
    # variance updates: 1, 2 (interval 1), 4, 6 (interval 2), 8 (interval 4); frozen after step
    # 10. Then a synchronisation at the multiples of the local-step interval, which doubles after
    # every 2 steps up to H = 4: 11, 12 (interval 1), 14 (2), 16, 20, 24 (4)
    kinds = schedule(24, var_freeze_step=10, var_update_scaler=2, local_step_scaler=2,
                     local_step_clipper=4)
    want = ["dense", "dense", "onebit", "dense", "onebit", "dense", "onebit", "dense", "onebit",
            "onebit",
            "sync", "sync", "local", "sync", "local", "sync", "local", "local", "local", "sync",
            "local", "local", "local", "sync"]
    assert kinds == want
    assert set(schedule(40, var_freeze_step=40)) == {"dense", "onebit"}
    assert schedule(16, 100)[:16] == ["dense"] * 16            # DeepSpeed's κ = 16


def deepspeed_zeroone_kinds(steps, F, kappa, scaler, clipper):
    """The kinds of DeepSpeed's ZeroOneAdam steps (zoadam.py's control flow, transcribed as
    rules): its counter s starts with an initialisation step that updates nothing; while not
    frozen, s is dense when s % var_interval == 0 (else 1-bit) and every such step counts towards
    κ, which doubles the interval; frozen, s syncs when s % local_interval == 0, every step counts
    towards local_step_scaler, which doubles the interval up to the clipper; it freezes after a
    step with s > var_freeze_step."""
    s, vi, vc, li, lc, frozen, kinds = 1, 1, 0, 1, 0, False, []
    for _ in range(steps):
        s += 1
        if not frozen:
            kinds.append("dense" if s % vi == 0 else "onebit")
            if s % vi == 0:
                vc += 1
                if vc == kappa:
                    vc, vi = 0, 2 * vi
        else:
            kinds.append("sync" if s % li == 0 else "local")
            lc += 1
            if lc == scaler:
                lc, li = 0, min(clipper, 2 * li)
        frozen = frozen or s > F
    return kinds


def deepspeed_onebit_dense_updates(freeze_step, steps=50):
    """DeepSpeed's OnebitAdam (adam.py's control flow): the initialisation step s = 1 updates
    nothing; every later step is dense Adam until one ends with s >= freeze_step."""
    s, frozen, dense = 1, False, 0
    for _ in range(steps):
        s += 1
        if frozen:
            break
        dense += 1
        frozen = s >= freeze_step
    return dense


@pytest.mark.parametrize("F,kappa,scaler,clipper", [(10, 2, 2, 4), (9, 3, 1, 8), (6, 1, 3, 2),
                                                    (1, 16, 2, 16)])
def test_zeroone_adam_on_deepspeeds_counter_takes_deepspeeds_steps(F, kappa, scaler, clipper):
    want = deepspeed_zeroone_kinds(30, F, kappa, scaler, clipper)
    assert schedule(30, F, kappa, scaler, clipper, counter="deepspeed") == want
    steps = schedule(30, F, kappa, scaler, clipper)          # the default: one step out of phase
    assert steps[:F].count("dense") + steps[:F].count("onebit") == F == \
        want[:F].count("dense") + want[:F].count("onebit")   # frozen after the same step
    if kappa < F or clipper > 1:
        assert steps != want


@pytest.mark.parametrize("freeze_step", [1, 2, 3, 10])
def test_onebit_adam_on_deepspeeds_counter_warms_up_as_deepspeed(freeze_step):
    from lowcomm.strategies.optimizers.onebit_adam import warmup_steps
    assert warmup_steps(freeze_step, "deepspeed") == deepspeed_onebit_dense_updates(freeze_step)
    assert warmup_steps(freeze_step) == freeze_step


@pytest.mark.parametrize("overrides,key,message", [
    (["strategy.name=onebit-adam", "strategy.counter=ds"], "strategy.counter", "deepspeed"),
    (["strategy.name=onebit-adam", "strategy.scale=layer"], "strategy.scale", "tensor"),
    (["strategy.name=streaming-diloco", "strategy.slot=middle"], "strategy.slot", "merge"),
    (["strategy.name=zeroone-adam", "optimizer.name=adam", "strategy.counter=ds"], "strategy.counter",
     "deepspeed"),
    (["strategy.name=zeroone-adam", "optimizer.name=sgd"], "optimizer.name", "zeroone-adam steps torch Adam"),
    (["strategy.name=zeroone-adam", "optimizer.name=adam", "compressor.name=int8"], "compressor.name",
     "zeroone-adam compresses"),
    (["strategy.name=zeroone-adam", "optimizer.name=adam", "strategy.var_update_scaler=0"],
     "strategy.var_update_scaler", ">= 1"),
    (["strategy.name=demo", "compressor.name=topk"], "compressor.name", "demo compresses"),
    (["strategy.name=demo", "strategy.exchange=ring"], "strategy.exchange", "known: auto"),
    (["strategy.name=demo", "strategy.decay=1"], "strategy.decay", r"\[0, 1\)"),
    (["strategy.name=demo", "strategy.topk=0"], "strategy.topk", ">= 1"),
    (["strategy.name=sparta", "strategy.fraction=0"], "strategy.fraction", r"\(0, 1\]"),
    (["strategy.name=sparta", "compressor.name=int8"], "compressor.name", "sparta averages parameters"),
    (["strategy.name=sparta-diloco", "strategy.fraction=1.5"], "strategy.fraction", r"\(0, 1\]"),
    (["strategy.name=sparta-diloco", "strategy.fragments=2"], "strategy.fragments", "streaming-diloco"),
    (["strategy.name=desloc", "optimizer.name=sgd"], "optimizer.name", "desloc averages torch Adam"),
    (["strategy.name=desloc", "compressor.name=int8"], "compressor.name", "desloc sends no gradients"),
    (["strategy.name=desloc", "strategy.period_v=0"], "strategy.period_v", ">= 1"),
    (["strategy.name=noloco", "strategy.outer_momentum=1"], "strategy.outer_momentum", r"\[0, 1\)"),
    (["strategy.name=noloco", "strategy.gamma=0"], "strategy.gamma", r"\(0, inf\]"),
    (["strategy.name=noloco", "strategy.seed=-1"], "strategy.seed", ">= 0"),
    (["strategy.name=noloco", "compressor.name=int8"], "compressor.name", "noloco exchanges parameters"),
    (["strategy.name=sparseloco", "strategy.decay=1.5"], "strategy.decay", r"\[0, 1\]"),
    (["strategy.name=sparseloco", "strategy.topk=0"], "strategy.topk", ">= 1"),
    (["strategy.name=sparseloco", "strategy.compressor=int8"], "strategy.compressor", "itself"),
    (["strategy.name=distro", "strategy.exchange=two-phase"], "strategy.exchange", "allgather"),
    (["strategy.name=demo", "strategy.value_bits=2"], "strategy.value_bits", "0 .full values. or 1"),
    (["strategy.name=demo", "strategy.average=senders"], "strategy.exchange", "needs every rank's pairs"),
    (["strategy.name=demo", "strategy.average=some"], "strategy.average", "senders"),
    (["strategy.name=muloco-ef2bit"], "optimizer.name", "Muon inside"),
    (["strategy.name=muloco-ef2bit", "optimizer.name=muon", "strategy.compressor=int8"],
     "strategy.compressor", "2-bit quantiser"),
])
def test_bad_settings_are_errors_naming_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert e.value.key == key


def test_packed_integers_round_trip_in_their_bit_count():
    v = torch.randint(0, 4096, (1001,), generator=torch.Generator().manual_seed(0))
    packed = pack_uints(v, 12)
    assert packed.dtype == torch.uint8 and packed.numel() == (1001 * 12 + 7) // 8
    assert torch.equal(unpack_uints(packed, 1001, 12), v)
    assert torch.equal(unpack_uints(torch.stack([packed, packed]), 1001, 12), torch.stack([v, v]))


def test_statistical_quantiser_decodes_each_bin_to_its_mean():
    """One block: codes = clip(round((x − μ)/w + 2), 0, 3), w = 6σ/4; decoded μ + mean of the
    bin's centred values (float32)."""
    x = torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    codes, table = stat_quantize(x, 2)
    c = (x - x.mean()).numpy()
    w = 6 * c.std(ddof=1) / 4
    want = np.clip(np.round(c / w + 2), 0, 3)
    assert np.array_equal(codes.numpy(), want)
    for j in range(4):
        assert math.isclose(float(table[0, 1 + j]), float(c[want == j].mean()) if (want == j).any()
                            else 0.0, rel_tol=1e-6, abs_tol=1e-7)
    codec = StatQuant(2)
    payload, ctx = codec.encode(x.float(), "w", None)
    assert codec.payload_nbytes(300, torch.float32) == 75 + 20 == sum(t.numel() * t.element_size() for t in payload)
    assert len(torch.unique(codec.decompress(payload, ctx))) <= 4


def test_quantized_chunk_topk_sends_k_values_in_2_bits_and_indices_in_log2_row_bits():
    x = torch.randn(4 * 4096, generator=torch.Generator().manual_seed(4))
    codec = QuantizedChunkTopK(4096, 64, 2, packed_indices=True)
    payload, ctx = codec.encode(x, "w", None)
    m = 4 * 64
    assert codec.payload_nbytes(x.numel(), torch.float32) == m * 2 // 8 + 20 + m * 12 // 8
    assert sum(t.numel() * t.element_size() for t in payload) == m * 2 // 8 + 20 + m * 12 // 8
    sent = codec.decompress(payload, ctx).view(4, 4096)
    for row, orig in zip(sent, x.view(4, 4096)):       # exactly the 64 largest of each chunk
        assert set(row.nonzero().view(-1).tolist()) == set(orig.abs().topk(64).indices.tolist())
    e = x.clone()
    codec.subtract_decoded_(e, payload, ctx)              # error feedback keeps x − D(C(x))
    assert torch.equal(e, x - sent.view(-1))
    signs = QuantizedChunkTopK(4096, 64, 1, packed_indices=False)
    payload, ctx = signs.encode(x, "w", None)
    got = signs.decompress(payload, ctx).view(4, 4096)
    top = x.view(4, 4096).gather(1, x.view(4, 4096).abs().topk(64).indices)
    assert torch.equal(got.gather(1, x.view(4, 4096).abs().topk(64).indices), top.sign())
    e = x.clone()
    signs.subtract_decoded_(e, payload, ctx)              # DisTrO: the selected values leave whole
    assert int((e == 0).sum()) == m and torch.equal(e[e != 0], x[e != 0])


def test_presets_expand_to_their_methods_settings():
    from lowcomm.strategies.optimizers.demo import DeMoSettings, DisTrOSettings
    from lowcomm.strategies.outer.diloco import MuLoCoEFSettings
    from lowcomm.run.registry import STRATEGIES
    assert STRATEGIES["distro"].settings is DisTrOSettings and STRATEGIES["distro"].build is \
        STRATEGIES["demo"].build
    assert dataclasses.asdict(DisTrOSettings()) == dataclasses.asdict(
        DeMoSettings(topk=4, chunk=64, value_bits=1, exchange="allgather"))
    assert STRATEGIES["muloco-ef2bit"].build is STRATEGIES["diloco"].build
    s = MuLoCoEFSettings()
    assert (s.outer_optimizer, s.exchange, s.compressor) == ("nesterov", "allgather", "none")


def test_python_constructors_check_their_arguments():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError) as e:
        build("demo:chunk=0", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert e.value.key == "chunk"


def test_python_constructors_of_desloc_and_noloco_check_their_arguments():
    """Before MPI starts (this process never initialises it)."""
    import lowcomm
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError) as e:
        build("noloco:period=0", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert e.value.key == "period"
    with pytest.raises(ArgumentError, match="period"):
        lowcomm.NoLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), period=0)
    with pytest.raises(TypeError, match="DES-LOC wraps torch.optim.Adam or AdamW, got SGD"):
        lowcomm.DesLoc(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="DES-LOC does not support amsgrad=True"):
        lowcomm.DesLoc(model, torch.optim.Adam(model.parameters(), amsgrad=True))


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8])
def test_noloco_pairs_every_rank_with_one_other_a_new_pairing_each_round(size):
    pairings = [random_pairs(size, 5, r) for r in range(20)]
    for partner in pairings:
        alone = [i for i, j in enumerate(partner) if j is None]
        assert len(alone) == size % 2                       # odd: exactly one rank sits out
        assert all(partner[j] == i for i, j in enumerate(partner) if j is not None)   # mutual
        assert all(j != i for i, j in enumerate(partner))
    assert pairings == [random_pairs(size, 5, r) for r in range(20)]    # a function of (seed, round)
    if size > 3:
        assert len({tuple(p) for p in pairings}) > 1                    # not a fixed matching
        assert [random_pairs(size, 6, r) for r in range(20)] != pairings   # the seed matters
    if size <= 4:     # over 20 rounds every rank met every other (the pairs mix the network)
        met = {(i, j) for p in pairings for i, j in enumerate(p) if j is not None}
        assert met == {(i, j) for i in range(size) for j in range(size) if i != j}


@pytest.mark.mpi_checks("check_new_methods.py", np=4, timeout=900)
def test_new_methods_under_mpirun():
    cases = shared_mpi_suite(4, "check_new_methods.py")
    assert any("::test_demo_" in n for n in cases) and any("sparta" in n for n in cases)
    assert any("::test_desloc_" in n for n in cases) and any("::test_noloco_" in n for n in cases)
