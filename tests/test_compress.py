"""Compressors in one process: bit packing, compress→decompress against each method's definition,
the Karimireddy et al. counterexample, bad input, state_dict round trips, the Horovod adapter,
and the ``bench compress`` command."""
import math

import numpy as np
import pytest
import torch

from lowcomm.compress import COMPRESSORS, PowerSGD, build_compressor
from lowcomm.compress.base import Segment
from lowcomm.compress.bits import SIGNED_INTS, pack_signs, pack_signs_torch, unpack_bits, unpack_signs
from lowcomm.run.config import CompressorConfig
from lowcomm.run.api import load_config
from lowcomm.errors import ConfigError, LowcommError, NonFiniteError

LOSSY = [n for n in COMPRESSORS if n != "none"]


def cfg(name, **kw):
    return CompressorConfig(name=name, **kw)


def sign_pm(x):   # the 1-bit sign: IEEE sign bit set -> -1, else +1
    return torch.where(torch.signbit(x), -1.0, 1.0).to(x.dtype)


def segments(*shapes):
    out, off = [], 0
    for i, s in enumerate(shapes):
        n = math.prod(s)
        out.append(Segment(f"p{i}", torch.Size(s), off, off + n))
        off += n
    return out, off


# bit packing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_pack_unpack_match_numpy_and_the_device_generic_path(dtype):
    for n in (1, 7, 8, 9, 64, 1001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        x[::5] = 0.0
        x[1::7] = -0.0
        p = pack_signs(x)
        assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
        assert np.array_equal(p.numpy(), np.packbits(torch.signbit(x).numpy(), bitorder="little"))
        assert torch.equal(pack_signs_torch(x.view(SIGNED_INTS[x.element_size()]), (n + 7) // 8), p)
        assert torch.equal(unpack_signs(p, n, dtype), sign_pm(x))
        assert torch.equal(unpack_signs(p, n, torch.float32, 0.25), 0.25 * sign_pm(x).float())
        assert torch.equal(unpack_bits(p, n), torch.signbit(x).to(torch.uint8))
    stack = torch.stack([pack_signs(torch.randn(20)) for _ in range(3)])
    scales = torch.tensor([1.0, 2.0, 3.0])
    rows = unpack_signs(stack, 20, torch.float32, scales)
    assert rows.shape == (3, 20) and torch.equal(rows[2], 3 * unpack_signs(stack[2], 20))


# compress -> decompress == definition -------------------------------------------------------------
X = torch.randn(1000, generator=torch.Generator().manual_seed(1))


def roundtrip(c, x=X, key="k", segs=None):
    payload, ctx = c.compress(x, key, segs)
    return payload, c.decompress(payload, ctx)


def test_casts():
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        payload, y = roundtrip(build_compressor(cfg(name)))
        assert payload[0].dtype == dtype and torch.equal(y, X.to(dtype).float())
    with pytest.raises(LowcommError, match="'k'.*beyond fp16's range"):
        build_compressor(cfg("fp16")).compress(X * 1e5, "bucket0", [Segment("k", X.shape, 0, 1000)])


def blockwise_definition(x, bits, block):
    """The blockwise quantiser's definition, block by block: ``(levels, decoded)``."""
    L = 2 ** (bits - 1) - 1
    qs, ys = [], []
    for b in x.split(block):
        s = b.abs().max() / L
        q = torch.round(b / s) if s > 0 else torch.zeros_like(b)
        qs.append(q)
        ys.append(q * s)
    return torch.cat(qs), torch.cat(ys)


@pytest.mark.parametrize("bits", [8, 4])
def test_blockwise_int8_int4_match_the_definition(bits):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    x[:2048] *= 1e-4                       # a first block 10^4 times smaller than the others
    c = build_compressor(cfg(f"int{bits}"))
    payload, y = roundtrip(c, x)
    q, want = blockwise_definition(x, bits, 2048)
    assert payload[1].shape == (3,), "one float32 scale per block of 2048"
    if bits == 8:
        assert payload[0].dtype == torch.int8 and torch.equal(payload[0], q.to(torch.int8))
    else:
        assert payload[0].dtype == torch.uint8 and payload[0].numel() == 2500, "two to a byte"
    assert torch.equal(y, want)
    L = 2 ** (bits - 1) - 1
    for b, xb, yb in zip(range(3), x.split(2048), y.split(2048)):
        bound = xb.abs().max() / L / 2
        assert float((xb - yb).abs().max()) <= float(bound) * (1 + 1e-6), f"block {b}: |error| <= s/2"
    small = y[:2048]
    kept = (small != 0).float().mean()
    assert kept > (0.9 if bits == 8 else 0.6), f"small gradients next to large ones kept ({kept})"
    assert torch.equal(roundtrip(c, torch.zeros(5))[1], torch.zeros(5))


def test_blockwise_block_setting_and_bytes():
    c = COMPRESSORS["int8"](cfg("int8", block=100))
    payload, _ = roundtrip(c)
    assert payload[1].numel() == 10 and c.nbytes(1000) == 1000 + 40
    assert COMPRESSORS["int4"](cfg("int4", block=100)).nbytes(1001) == 501 + 44
    with pytest.raises(ConfigError, match="compressor.block"):
        cfg("int8", block=0).validate()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_block_longer_than_the_tensor_is_one_scale_without_padding_to_it(bits):
    """block = 2^30 (one scale per bucket, the old rule): the definition with one block, and no
    buffer of 2^30 elements (it took 21 s and 4 GiB for 1000 elements)."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(5))
    c = COMPRESSORS[f"int{bits}"](cfg(f"int{bits}", block=1 << 30))
    payload, y = roundtrip(c, x)
    _, want = blockwise_definition(x, bits, 1001)
    assert payload[1].numel() == 1 and torch.equal(y, want)
    assert max(t.numel() for t in payload) <= 1001


def qsgd_levels(v, norms, u, s):
    """The definition, in float64: q = ⌊sign(v)·|v|/‖v‖·s + u⌋, clamped to [−s, s]."""
    a = v.double() / norms.double() * s
    return torch.floor(a + u.double()).clamp(-s, s).float()


def test_qsgd_definition_and_unbiasedness():
    c = COMPRESSORS["qsgd"](cfg("qsgd", levels=4, bucket_size=100, seed=3))
    twin = COMPRESSORS["qsgd"](cfg("qsgd", levels=4, bucket_size=100, seed=3))
    payload, y = roundtrip(c)
    v = X.view(10, 100)
    norms = torch.linalg.vector_norm(v, dim=1, keepdim=True)
    u = twin.uniforms(1000).view(10, 100)          # the u that c drew, from an equal generator
    assert torch.equal(twin.generator(X.device).get_state(), c.generator(X.device).get_state())
    q = qsgd_levels(v, norms, u, 4)
    assert torch.equal(payload[0], q.view(-1).to(torch.int8))
    assert torch.allclose(y, (norms / 4 * q).view(-1), rtol=1e-6, atol=1e-7)
    mean = torch.stack([roundtrip(c)[1] for _ in range(3000)]).mean(0)
    assert float((mean - X).abs().max()) < 0.1, "E[Q(v)] = v"


def test_qsgd_cheap_uniforms_are_uniform_fresh_per_block_and_across_ranks():
    """The table-and-offset u (QSGD docstring): each block's window is uniform over the L
    stratified points, blocks and calls draw fresh offsets, and fused blocks (here several, and a
    short last bucket) quantise exactly as the definition does on the whole tensor."""
    from lowcomm.compress.quantize import UNIFORM_TABLE, uniform_table
    t = uniform_table(torch.float64, torch.device("cpu"))[:UNIFORM_TABLE]
    assert torch.equal(t.sort().values, (torch.arange(UNIFORM_TABLE, dtype=torch.float64) + 0.5) / UNIFORM_TABLE)
    c = COMPRESSORS["qsgd"](cfg("qsgd", levels=16, bucket_size=512, seed=5))
    u = c.uniforms(3 * c.block() + 1000)
    assert u.min() > 0 and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.01
    blocks = u[:3 * c.block()].view(3, -1)
    assert not torch.equal(blocks[0], blocks[1]) and not torch.equal(u, c.uniforms(u.numel()))
    # every element's u over many calls: uniform (mean 1/2, variance 1/12)
    many = torch.stack([c.uniforms(8) for _ in range(4000)])
    assert (many.mean(0) - 0.5).abs().max() < 0.02 and (many.var(0) - 1 / 12).abs().max() < 0.01
    # the fused blocked pass == the definition with the same u, on several blocks and a short bucket
    x = torch.randn(3 * c.block() + 1000, generator=torch.Generator().manual_seed(9))
    twin = COMPRESSORS["qsgd"](cfg("qsgd", levels=16, bucket_size=512, seed=5))
    twin.load_state_dict(c.state_dict())
    q, norms = c.compress(x, "k")[0]
    u = twin.uniforms(x.numel())
    n, bs = x.numel(), 512
    v = torch.zeros(-(-n // bs) * bs)
    v[:n] = x
    v = v.view(-1, bs)
    ref_norms = torch.linalg.vector_norm(v, dim=1, keepdim=True)
    uu = torch.zeros(v.numel())
    uu[:n] = u
    want = qsgd_levels(v, ref_norms, uu.view(-1, bs), 16).view(-1)[:n]
    diff = (q.float() - want).abs()
    # float32 rounding of y may move an a + u within ~1e-5 of an integer across it (never by more)
    assert diff.max() <= 1 and int((diff > 0).sum()) <= 2, int((diff > 0).sum())
    assert int(q.abs().max()) <= 16 and (q.sign() * x.sign() >= 0).all()
    # the sign·⌊|a| + u⌋ form of the paper draws the same levels with the same probabilities
    p_away = torch.stack([(c.compress(x[:512], "k")[0][0].float().abs() > (x[:512].abs() / x[:512].norm() * 16).floor()).float()
                          for _ in range(2000)]).mean(0)
    frac = (x[:512].abs() / x[:512].norm() * 16).frac()
    assert (p_away - frac).abs().max() < 0.05
    assert torch.allclose(norms, ref_norms.view(-1))
    # norm buckets larger than a block: blocks not aligned to buckets
    from lowcomm.compress.scratch import BLOCK
    big = COMPRESSORS["qsgd"](cfg("qsgd", levels=8, bucket_size=BLOCK + 5, seed=1))
    twin = COMPRESSORS["qsgd"](cfg("qsgd", levels=8, bucket_size=BLOCK + 5, seed=1))
    x = torch.randn(2 * BLOCK + 100, generator=torch.Generator().manual_seed(3))
    q, norms = big.compress(x, "k")[0]
    u = twin.uniforms(x.numel())
    owner = torch.arange(x.numel()) // (BLOCK + 5)
    ref_norms = torch.stack([x[owner == b].norm() for b in range(3)])
    want = qsgd_levels(x, ref_norms[owner], u, 8)
    diff = (q.float() - want).abs()
    assert diff.max() <= 1 and int((diff > 0).sum()) <= 2 and torch.allclose(norms, ref_norms)
    r0, r1 = (COMPRESSORS["qsgd"](cfg("qsgd", seed=5)) for _ in range(2))
    assert not torch.equal(r0.uniforms(1000, rank=0), r1.uniforms(1000, rank=1)), "ranks draw different u"


def test_topk_and_randomk():
    k = int(0.05 * 1000)
    payload, y = roundtrip(COMPRESSORS["topk"](cfg("topk", ratio=0.05)))
    top = X.abs().topk(k).indices
    assert payload[1].dtype == torch.int32 and set(payload[1].tolist()) == set(top.tolist())
    expect = torch.zeros_like(X)
    expect[top] = X[top]
    assert torch.equal(y, expect)
    a = COMPRESSORS["randomk"](cfg("randomk", ratio=0.05, seed=1))
    b = COMPRESSORS["randomk"](cfg("randomk", ratio=0.05, seed=1))
    (pa, ya), (_, yb) = roundtrip(a), roundtrip(b, X * 2)
    assert pa[0].numel() == k and int((ya != 0).sum()) == k and torch.equal(ya[ya != 0].sort().values, pa[0].sort().values)
    assert torch.equal(ya != 0, yb != 0), "ranks seeded alike pick the same indices"
    other = roundtrip(COMPRESSORS["randomk"](cfg("randomk", ratio=0.05, seed=2)))[1]
    assert not torch.equal(ya != 0, other != 0)
    assert not torch.equal(roundtrip(a)[1] != 0, ya != 0), "a new draw per call"


def test_large_buckets_take_the_fused_blocked_paths_and_match_the_definitions():
    """Buckets of several blocks (lowcomm.compress.scratch.BLOCK) and a ragged tail: int8 (its
    quantisation blocks),
    sign, ef-sign (blocked error subtraction) and top-k (sampled threshold) equal their
    definitions."""
    from lowcomm.compress.scratch import BLOCK
    x = torch.randn(3 * BLOCK + 1001, generator=torch.Generator().manual_seed(11))
    payload, y = roundtrip(build_compressor(cfg("int8")), x)
    q, want = blockwise_definition(x, 8, 2048)
    assert torch.equal(payload[0], q.to(torch.int8)) and torch.equal(y, want)
    payload, y = roundtrip(build_compressor(cfg("sign")), x)
    assert torch.allclose(payload[0], x.abs().mean().reshape(1), rtol=1e-5)
    assert torch.equal(y, payload[0] * sign_pm(x))
    x8 = x[:3 * BLOCK + 1000]                                # a multiple of 8: the blocked subtraction
    for xs in (x8, x):
        c = build_compressor(cfg("ef-sign"))
        payload, y = roundtrip(c, xs)
        assert torch.equal(c.encoder.residuals["k"], xs - y)
        payload2, y2 = roundtrip(c, xs)
        assert torch.equal(c.encoder.residuals["k"], (xs + (xs - y)) - y2)
    c = build_compressor(cfg("topk", ratio=0.01))
    k = int(0.01 * x.numel())
    payload, y = roundtrip(c, x)
    assert set(payload[1].tolist()) == set(x.abs().topk(k).indices.tolist())
    assert torch.equal(c.encoder.residuals["k"][payload[1].long()], torch.zeros(k))
    assert torch.equal(c.encoder.residuals["k"] + y, x)


def test_top_indices_is_exact_whatever_the_sample_says():
    """The sample only decides the speed: on data built to mislead it (a period that the
    stride would alias, a sorted ramp, heavy ties, a few huge values) the set equals topk's,
    and the retry and full-sort paths are taken and counted."""
    from lowcomm.compress import sparsify
    n = 1 << 18
    g = torch.Generator().manual_seed(4)
    cases = {"random": torch.randn(n, generator=g),
             "ramp": torch.linspace(-1, 1, n),
             "columns": torch.randn(64, generator=g).repeat(n // 64) + 1e-3 * torch.randn(n, generator=g),
             "spikes": torch.zeros(n).index_fill_(0, torch.randperm(n, generator=g)[:500], 1e3)
             + 1e-4 * torch.randn(n, generator=g)}
    before = dict(sparsify._stats)
    for name, x in cases.items():
        for k in (1, 100, int(0.01 * n), int(0.05 * n)):
            got = sparsify.top_indices(x, k)
            want = x.abs().topk(k).values
            assert got.numel() == k == len(set(got.tolist())), (name, k)
            assert torch.equal(x[got].abs().sort().values, want.sort().values), (name, k)
    assert sparsify._stats["sampled"] > before["sampled"]
    # a sample that sees only large values: its threshold is too high, so retries follow
    x = 1e-3 * torch.randn(n, generator=g)
    stride = sparsify.sample_stride(n)
    x[::stride] = 10 + torch.arange(len(range(0, n, stride)), dtype=torch.float32)
    before = dict(sparsify._stats)
    k = int(0.05 * n)
    got = sparsify.top_indices(x, k)
    assert torch.equal(x[got].abs().sort().values, x.abs().topk(k).values.sort().values)
    assert sparsify._stats["retries"] > before["retries"]


def test_randomk_draws_a_uniform_distinct_subset():
    from lowcomm.compress.sparsify import distinct_sample
    for n, k in ((1 << 20, 10_000), (1000, 50), (1000, 900)):   # the sampled and randperm paths
        a = distinct_sample(n, k, torch.Generator().manual_seed(1), "cpu")
        b = distinct_sample(n, k, torch.Generator().manual_seed(1), "cpu")
        assert torch.equal(a, b) and a.numel() == k == len(set(a.tolist()))
        assert 0 <= int(a.min()) and int(a.max()) < n
    hits = torch.zeros(100)
    g = torch.Generator().manual_seed(2)
    for _ in range(2000):
        hits[distinct_sample(100, 5, g, "cpu")] += 1
    assert (hits / 2000 - 0.05).abs().max() < 0.02, "every index equally likely"
    g = torch.Generator().manual_seed(3)
    first = torch.zeros(100)
    for _ in range(2000):
        first[distinct_sample(100, 5, g, "cpu")[0]] += 1
    assert (first / 2000 - 0.01).abs().max() < 0.015, "in random order"


def test_error_feedback_keeps_no_error_for_bytes_no_parameter_owns():
    c = build_compressor(cfg("topk", ratio=0.1))
    x = torch.randn(30, generator=torch.Generator().manual_seed(5))
    segs = [Segment("a", torch.Size([10]), 0, 10), Segment("b", torch.Size([10]), 20, 30)]
    _, y1 = roundtrip(c, x, "b", segs)
    _, y2 = roundtrip(c, x, "b", segs)
    p = x.clone()
    p[:10] += (x - y1)[:10]
    p[20:] += (x - y1)[20:]
    assert torch.equal(torch.cat([c.encoder.residuals["a"], c.encoder.residuals["b"]]), torch.cat([(p - y2)[:10], (p - y2)[20:]]))


def test_sign_family():
    for name in ("sign", "ef-sign"):
        payload, y = roundtrip(COMPRESSORS[name](cfg(name)))
        assert payload[1].numel() == 125 and payload[0].numel() == 1
        assert torch.allclose(y, X.abs().mean() * sign_pm(X), rtol=1e-6, atol=0)
    payload, y = roundtrip(COMPRESSORS["sign-mv"](cfg("sign-mv")))
    assert [p.numel() for p in payload] == [125, 1] and torch.equal(y, sign_pm(X))   # + zero flags


def test_error_feedback_keeps_what_was_not_sent_per_parameter():
    c = build_compressor(cfg("topk", ratio=0.01))
    segs, n = segments((10, 50), (500,))
    x1, x2 = X.clone(), torch.randn(1000)
    _, y1 = roundtrip(c, x1, "b", segs)
    assert torch.equal(c.encoder.residuals["p0"], (x1 - y1)[:500]) and torch.equal(c.encoder.residuals["p1"], (x1 - y1)[500:])
    payload, y2 = roundtrip(c, x2, "b", segs)
    p = x2 + (x1 - y1)
    assert torch.equal(y2[y2 != 0], p[y2 != 0]) and set(payload[1].tolist()) == set(p.abs().topk(10).indices.tolist())
    assert torch.equal(torch.cat([c.encoder.residuals["p0"], c.encoder.residuals["p1"]]), p - y2)


def test_ef_sign_converges_on_the_karimireddy_counterexample_where_sign_does_not():
    """f(x) = ε|x1 + x2| + |x1 − x2| (Karimireddy et al. 2019, Counterexample 1): sign(∇f) is
    ±(1, −1) off the diagonal, so signSGD never moves x1 + x2 and f stays ≥ ε|x1 + x2|."""
    eps, lr = 0.5, 0.05

    def run(name):
        c = build_compressor(cfg(name))
        x = torch.tensor([1.0, 0.5], dtype=torch.float64)
        best = float("inf")
        for _ in range(400):
            g = eps * torch.sign(x[0] + x[1]) * torch.ones(2, dtype=torch.float64) + \
                torch.sign(x[0] - x[1]) * torch.tensor([1.0, -1.0], dtype=torch.float64)
            payload, ctx = c.compress(g, "x")
            x = x - lr * c.decompress(payload, ctx)
            best = min(best, float(eps * abs(x[0] + x[1]) + abs(x[0] - x[1])))
        return best, float(x[0] + x[1])

    best, total = run("sign")
    assert best >= eps * 1.5 - 1e-9 and total == pytest.approx(1.5)
    best, _ = run("ef-sign")
    assert best < 1e-3


def test_powersgd_alone():
    segs, n = segments((4, 8), (8,), (4, 3, 2))
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    full = PowerSGD(approx_rank=4, start_iter=0, min_compression_rate=0)
    assert len(full.plan(segs)[0]) == 2
    assert torch.allclose(roundtrip(full, x, "b", segs)[1], x, atol=1e-12), "full rank is exact"
    assert not torch.allclose(roundtrip(PowerSGD(approx_rank=3, start_iter=0, min_compression_rate=0),
                                        x, "b", segs)[1], x, atol=1e-3), "rank 3 is not"
    segs, n = segments((6, 8), (8,), (4, 3, 2))
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    low = PowerSGD(approx_rank=1, start_iter=1)
    assert torch.equal(roundtrip(low, x, "b", segs)[1], x), "start_iter: dense"
    payload, y = roundtrip(low, x, "b", segs)
    assert [p.numel() for p in payload] == [6 + 4 + 8, 8 + 6]   # P's + dense bias, Q's
    M = x[:48].view(6, 8)
    assert torch.linalg.matrix_rank(y[:48].view(6, 8)) == 1 and torch.equal(y[48:56], x[48:56])
    assert torch.allclose(low.error["p0"], (M - y[:48].view(6, 8)).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_powersgd_on_a_16_bit_model_orthogonalises_in_float32(dtype):
    """torch has no QR for 16-bit floats ("geqrf_cpu" not implemented for 'BFloat16'): P̂ is
    computed in float32 and returned in the model's dtype; full rank is exact up to its rounding."""
    segs, n = segments((6, 16), (12,), (6, 2, 3))
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
    full = PowerSGD(approx_rank=6, start_iter=0, min_compression_rate=0)
    y = roundtrip(full, x, "b", segs)[1]
    assert y.dtype == dtype and torch.allclose(y.float(), x.float(), rtol=0, atol=0.05)
    low = PowerSGD(approx_rank=2, start_iter=0)
    for _ in range(2):                                     # warm start and error memory
        y = roundtrip(low, x, "b", segs)[1]
    assert y.dtype == dtype and bool(torch.isfinite(y.float()).all())
    assert low.q["p0"].dtype == dtype and low.error["p0"].dtype == dtype


def test_low_rank_products_match_the_gemm_on_both_paths():
    from lowcomm.compress.powersgd import OUTER_MAX_RANK, low_rank_
    g = torch.Generator().manual_seed(6)
    for r in (1, 2, OUTER_MAX_RANK, OUTER_MAX_RANK + 2):       # rank-1 updates, then one GEMM
        for n, m in ((40, 30), (300, 300)):                     # small: a GEMM as well
            P, Qt, M = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, r), (r, m), (n, m)))
            assert torch.allclose(low_rank_(torch.empty(n, m, dtype=torch.float64), P, Qt), P @ Qt, atol=1e-12)
            assert torch.allclose(low_rank_(M.clone(), P, Qt, subtract=True), M - P @ Qt, atol=1e-12)


# bad input ---------------------------------------------------------------------------------------
def test_unknown_name_and_bad_values_name_the_key():
    for override, key in [("compressor.name=zip", "compressor.name"),
                          ("compressor.ratio=0", "compressor.ratio"),
                          ("compressor.ratio=1.5", "compressor.ratio"),
                          ("compressor.levels=200", "compressor.levels"),
                          ("compressor.approx_rank=0", "compressor.approx_rank"),
                          ("compressor.error_feedback=true", "compressor.error_feedback"),
                          ("compressor.bucket_size=0", "compressor.bucket_size")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert e.value.key == key, override
    with pytest.raises(ConfigError, match="error_feedback"):
        load_config(None, ["compressor.name=ef-sign", "compressor.error_feedback=false"])
    load_config(None, ["compressor.ratio=1", "compressor.name=topk"])   # the control case
    with pytest.raises(ValueError, match="unknown compressor 'zip'; known: none, fp16"):
        build_compressor(cfg("zip"))
    for bad in (0.0, -0.1, 1.01):
        for name in ("topk", "randomk"):
            with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
                build_compressor(cfg(name, ratio=bad))


def test_rank_larger_than_a_matrix_is_named():
    segs, n = segments((6, 8), (3, 40))
    with pytest.raises(ValueError, match=r"approx_rank=4 is larger than parameter 'p1' \(3×40"):
        build_compressor(cfg("powersgd", approx_rank=4)).compress(torch.randn(n), "b", segs)


@pytest.mark.parametrize("name", LOSSY)
def test_nan_or_inf_is_never_encoded_and_names_the_parameter_and_rank(name):
    segs, n = segments((10, 10), (20,), (30,))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(n)
        x[105] = bad
        with pytest.raises(NonFiniteError) as e:
            build_compressor(cfg(name, start_iter=0)).compress(x, "bucket3", segs)
        assert "'p1'" in str(e.value) and "'p0'" not in str(e.value) and "rank 0" in str(e.value)


# state -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LOSSY)
def test_state_dict_round_trip_continues_identically(name):
    import copy
    segs, n = segments((12, 10), (10,))
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    c = build_compressor(cfg(name, start_iter=1, ratio=0.1))
    for x in xs[:3]:
        roundtrip(c, x, "b", segs)
    state = copy.deepcopy(c.state_dict())
    a = [roundtrip(c, x, "b", segs)[1] for x in xs[3:]]
    d = build_compressor(cfg(name, start_iter=1, ratio=0.1))
    d.load_state_dict(state)
    b = [roundtrip(d, x, "b", segs)[1] for x in xs[3:]]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    fresh = build_compressor(cfg(name, start_iter=1, ratio=0.1))
    stateful = name in ("qsgd", "topk", "randomk", "ef-sign", "powersgd")
    if stateful:   # the check can fail: without the state the results differ
        assert not all(torch.equal(p, roundtrip(fresh, x, "b", segs)[1]) for p, x in zip(a, xs[3:]))


# Horovod adapter ---------------------------------------------------------------------------------
def test_horovod_takes_summable_stateless_compressors_only():
    from lowcomm.strategies.sync.horovod import HorovodCompression, check_compressor
    check_compressor(None)
    h = HorovodCompression(build_compressor(cfg("fp16")))
    t = torch.randn(3, 4)
    c, ctx = h.compress(t)
    assert c.dtype == torch.float16 and c.shape == t.shape and torch.equal(h.decompress(c, ctx), t.half().float())
    for name, why in [("bf16", "bfloat16"), ("topk", "cannot be summed"), ("randomk", "keeps state"),
                      ("powersgd", "cannot be summed"), ("int8", "cannot be summed")]:
        with pytest.raises(LowcommError, match=why):
            check_compressor(build_compressor(cfg(name)))


# bench -------------------------------------------------------------------------------------------
def test_bench_compress_rows_and_packing_speed():
    from lowcomm.tools.compress_bench import bench_compress, format_compress
    rows = bench_compress(["pack", "sign", "topk", "powersgd"], numel=1 << 20, iters=5, warmup=1)
    by = {r["method"]: r for r in rows}
    assert by["sign"]["payload_bytes"] == (1 << 17) + 4 + 1 and by["memcpy"]["ratio"] == 1   # + zero flag
    assert by["powersgd"]["payload_bytes"] == 4 * 2 * (1024 + 1024)
    assert "vs memcpy" in format_compress(rows)
    for r in rows[1:]:   # break-even: compress + decompress against the saved bytes at 10 Gbit/s
        cost = (4 << 20) / r["compress_GBps"] / 1e6 + (4 << 20) / r["decompress_GBps"] / 1e6
        saved = ((4 << 20) - r["payload_bytes"]) * 8 / 10e9 * 1e3
        assert r["cost_ms"] == pytest.approx(cost) and r["saved_ms"] == pytest.approx(saved)
        assert r["cost_vs_saved"] == pytest.approx(cost / saved)
    table = format_compress(rows)
    assert "saved@10G ms" in table and "cost/saved" in table and "costs more time than it saves" in table
    assert bench_compress(["sign"], numel=1 << 12, iters=1, warmup=0, link_gbit=1)[1]["saved_ms"] == \
        pytest.approx(((1 << 14) - (1 << 9) - 4 - 1) * 8 / 1e9 * 1e3)
    with pytest.raises(ValueError, match="unknown method 'zip'"):
        bench_compress(["zip"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ef_sign_leaves_exactly_p_minus_its_decoded_payload(dtype):
    """The blocked path of ef-sign subtracts s·sign(p) from p's own sign bits, not from the
    decoded payload: it must be the same bits, zeros of either sign included."""
    from lowcomm.compress.scratch import BLOCK
    from lowcomm.compress.sign import ScaledSign
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3 * BLOCK + 64, generator=g).to(dtype)
    x[::97] = 0.0
    x[1::101] = -0.0
    comp = ScaledSign("ef-sign")
    p = x.clone()
    payload, ctx = comp.compress_feedback_(p, "k")
    plain, plain_ctx = comp.encode(x.clone(), "k", None)
    assert ctx == plain_ctx and torch.equal(payload[1], plain[1])
    assert torch.allclose(payload[0], plain[0], rtol=1e-6, atol=0)
    bits = SIGNED_INTS[x.element_size()]
    assert torch.equal(p.view(bits), (x - comp.decompress(payload, ctx)).view(bits))


def test_the_docs_codec_example_composes_with_error_feedback():
    """docs/extending.md's "A compressor" example: a codec, error feedback around it, an exchange."""
    import re
    from pathlib import Path

    from lowcomm.compress import TwoPhase
    page = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    section = page[page.index("## A compressor"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env: dict = {}
    exec(compile(code, "docs/extending.md", "exec"), env)
    comp = env["comp"]
    assert isinstance(comp.exchange, TwoPhase) and comp.error_feedback and comp.name == "every-other"
    x = torch.arange(7, dtype=torch.float32)
    payload, ctx = comp.compress(x, "b")
    assert torch.equal(comp.decompress(payload, ctx), torch.tensor([0., 0, 2, 0, 4, 0, 6]))
    assert torch.equal(comp.encoder.residuals["b"], torch.tensor([0., 1, 0, 3, 0, 5, 0]))
    assert comp.codec.payload_nbytes(7, torch.float32) == 16
