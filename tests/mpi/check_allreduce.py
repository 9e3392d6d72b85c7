"""Every all-reduce algorithm (and "auto") against vendor MPI_Allreduce, on every rank.

Sizes 0, 1, 7, 1000 (not divisible by K) and ~1M elements, a 2-D tensor, a non-contiguous view;
float32/64/16 and bfloat16; sum and average. Integer-valued data must match exactly (every
dtype holds these sums exactly); random float32/64 data must match to rounding. The ledger's
bytes must equal each algorithm's exact message volume. ``shm`` also runs with tiny segments
(many segments, both halves of its window, one- and two-barrier paths). ``auto``: every rank runs
the same algorithm (the one in a table only rank 0 can read), the nearest measured size decides,
a table of the wrong rank count is an error on every rank, and without a table the α–β rule.
The hierarchical algorithm needs a topology: tests/mpi/check_topology.py.
"""
import json

import numpy as np
import pytest
import torch

import lowcomm
import lowcomm.comm.algorithms as A
import lowcomm.comm.collectives as C
from helpers import vendor_sum
from lowcomm.comm.collectives import chunk_bounds
from lowcomm.comm.tuning import CANDIDATES, TABLE_ENV

ALGORITHMS = [a for a in lowcomm.ALGORITHMS if a != "hierarchical"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
SIZES = [0, 1, 7, 1000, (1 << 20) + 3]


def ring_bytes(n: int, K: int, r: int) -> int:
    b = chunk_bounds(n, K)
    size = lambda i: b[i % K + 1] - b[i % K]  # noqa: E731
    return sum(size(r - s) for s in range(K - 1)) + sum(size(r + 1 - s) for s in range(K - 1))


def tree_bytes(n: int, K: int, r: int) -> int:
    """Reduce: n to the parent; broadcast: n to each child (the same children)."""
    children, m = 0, 1
    while m < K and not r & m:
        children += r + m < K
        m <<= 1
    return n * ((1 if r else 0) + children)


def shm_bytes(n: int, K: int, r: int, es: int) -> int:
    """Per segment: the others' chunks of my copy, my sum K-1 times."""
    seg = max(1, C.SHM_SEGMENT_BYTES // es)
    total = 0
    for a in range(0, n, seg):
        L = min(seg, n - a)
        if L * es <= C.SHM_ONE_SYNC_BYTES:
            total += (K - 1) * L
        else:
            b = chunk_bounds(L, K)
            total += (L - (b[r + 1] - b[r])) + (K - 1) * (b[r + 1] - b[r])
    return total


def rabenseifner_bytes(n: int, K: int, r: int) -> int:
    p = 1 << (K.bit_length() - 1)
    q = K - p
    if r < 2 * q and r % 2 == 0:
        return n
    b = chunk_bounds(n, p)
    me = r // 2 if r < 2 * q else r - q
    total, lo, hi, d = 0, 0, p, p // 2
    while d >= 1:
        mid = (lo + hi) // 2
        give = (lo, mid) if me & d else (mid, hi)
        total += b[give[1]] - b[give[0]]
        lo, hi = ((mid, hi) if me & d else (lo, mid))
        d //= 2
    d = 1
    while d < p:
        total += b[hi] - b[lo]
        lo, hi = (lo - d, hi) if me & d else (lo, hi + d)
        d *= 2
    return total + (n if r < 2 * q else 0)


def expected_bytes(alg: str, n: int, es: int, K: int, r: int) -> int:
    """Exact bytes this rank sends for one all-reduce of n elements of es bytes."""
    if K == 1 or n == 0:
        return 0
    if alg == "mpi":
        return 2 * (K - 1) * n * es // K
    if alg == "shm":
        return es * shm_bytes(n, K, r, es)
    per = {"ring": ring_bytes, "tree": tree_bytes, "rabenseifner": rabenseifner_bytes}[alg]
    return es * per(n, K, r)


def integers(n: int, dt, seed: int) -> torch.Tensor:
    """Integer-valued data: exact in every dtype, so any error is a real bug."""
    return torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(seed)).to(dt)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_sum_and_average_equal_vendor_allreduce_with_exact_bytes(alg, n, dtype, comm):
    K, r, dt = comm.size, comm.rank, DTYPES[dtype]
    g = torch.Generator().manual_seed(1000 * r + n)
    t = torch.randint(-4, 5, (n,), generator=g).to(dt)
    ref = vendor_sum(t)
    before = comm.ledger.get(f"allreduce.{alg}")
    out = lowcomm.allreduce_(t, comm, alg)
    after = comm.ledger.get(f"allreduce.{alg}")
    a = torch.randint(-4, 5, (n,), generator=g).to(dt)
    avg_ref = vendor_sum(a) / K
    lowcomm.allreduce_(a, comm, alg, op="avg")
    assert out is t, "allreduce_ must return its argument"
    assert np.array_equal(t.double().numpy(), ref), "the sum differs from MPI_Allreduce"
    assert after.calls == before.calls + 1, "one ledger call per all-reduce"
    want = expected_bytes(alg, n, t.element_size(), K, r)
    assert after.bytes_sent - before.bytes_sent == want, \
        f"ledger {after.bytes_sent - before.bytes_sent} bytes, expected {want}"
    tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6
    assert np.allclose(a.double().numpy(), avg_ref, rtol=tol, atol=tol), "the average differs"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_random_data_equals_vendor_allreduce_to_rounding(alg, dtype, comm):
    t = torch.randn(4099, generator=torch.Generator().manual_seed(7 + comm.rank), dtype=DTYPES[dtype])
    ref = vendor_sum(t)
    lowcomm.allreduce_(t, comm, alg)
    assert np.allclose(t.double().numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_a_2d_tensor(alg, comm):
    K = comm.size
    m = torch.full((3, 5), float(comm.rank + 1))
    lowcomm.allreduce_(m, comm, alg)
    assert torch.equal(m, torch.full((3, 5), K * (K + 1) / 2))


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_a_non_contiguous_view_is_written_back_in_place(alg, comm):
    K = comm.size
    base = torch.zeros(6, 4)
    view = base[:, 1]
    view.fill_(comm.rank + 1.0)
    lowcomm.allreduce_(view, comm, alg)
    assert torch.equal(base[:, 1], torch.full((6,), K * (K + 1) / 2)) and base[:, 0].eq(0).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 5, 1000, 1025, 20011])
def test_shm_with_small_segments(n, dtype, comm, monkeypatch):
    """Many segments alternate the window's halves; both barrier paths."""
    monkeypatch.setattr(C, "SHM_SEGMENT_BYTES", 4096)
    monkeypatch.setattr(C, "SHM_ONE_SYNC_BYTES", 1024)
    small = comm.dup()          # a fresh window sized for these segments
    t = integers(n, DTYPES[dtype], n + comm.rank)
    ref = vendor_sum(t)
    before = small.ledger.get("allreduce.shm").bytes_sent
    lowcomm.allreduce_(t, small, "shm")
    assert np.array_equal(t.double().numpy(), ref), "differs from MPI_Allreduce"
    got = small.ledger.get("allreduce.shm").bytes_sent - before
    want = expected_bytes("shm", n, t.element_size(), comm.size, comm.rank)
    assert got == want, f"ledger {got} bytes, expected {want}"


@pytest.mark.parametrize("n", [1, 5, 1000, 1025])
def test_ring_with_small_segments(n, comm, monkeypatch):
    """Chunks over RING_SEGMENT_BYTES go in segments (sends posted at once, the next receive in
    flight while one is added): the vendor's sum, and the ring's bytes."""
    monkeypatch.setattr(A, "RING_SEGMENT_BYTES", 64)
    t = integers(n, torch.float32, n + comm.rank)
    ref = vendor_sum(t)
    before = comm.ledger.get("allreduce.ring").bytes_sent
    lowcomm.allreduce_(t, comm, "ring")
    assert np.array_equal(t.double().numpy(), ref), "differs from MPI_Allreduce"
    got = comm.ledger.get("allreduce.ring").bytes_sent - before
    assert got == expected_bytes("ring", n, 4, comm.size, comm.rank), got


def registered_bytes(n: int, K: int, r: int) -> int:
    """The in-place path: my sum stored into the K-1 other buffers, the others' chunks into mine."""
    b = chunk_bounds(n, K)
    return (n - (b[r + 1] - b[r])) + (K - 1) * (b[r + 1] - b[r])


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 1000, (C.REGISTERED_MIN_BYTES // 2) + 3])
@pytest.mark.parametrize("alg", ["shm", "auto"])
def test_a_registered_buffer_is_reduced_in_place_equal_to_vendor(alg, n, dtype, op, comm):
    """A slice of a buffer from Comm.shared_tensor: shm (and auto from REGISTERED_MIN_BYTES)
    reduce it where it lies; exact sums, the ledger's bytes of the in-place path."""
    K, r, dt = comm.size, comm.rank, DTYPES[dtype]
    reg = comm.dup()
    t = reg.shared_tensor(n + 5, dt)[2:2 + n]
    assert reg.registered(t) is not None and reg.registered(torch.zeros(n, dtype=dt)) is None
    t.copy_(integers(n, dt, 31 * r + n))
    want = vendor_sum(t) / (K if op == "avg" else 1)
    in_place = alg == "shm" or n * t.element_size() >= C.REGISTERED_MIN_BYTES
    before = reg.ledger.get("allreduce.shm").bytes_sent
    lowcomm.allreduce_(t, reg, alg, op=op)
    tol = 0 if op == "sum" else 1e-2 if dt == torch.bfloat16 else 1e-6
    assert np.allclose(t.double().numpy(), want, rtol=tol, atol=tol), "differs from MPI_Allreduce"
    assert len(set(comm.allgather_object(t.double().numpy().tobytes()))) == 1, "ranks differ"
    if in_place:
        got = reg.ledger.get("allreduce.shm").bytes_sent - before
        want_bytes = t.element_size() * registered_bytes(n, K, r) if K > 1 else 0
        assert got == want_bytes, f"ledger {got} bytes, expected {want_bytes} (in place)"


def test_registered_random_data_ends_bit_identical_on_every_rank(comm):
    """Only rank r sums chunk r, so every rank holds the same bits (and MPI's sum to rounding)."""
    reg = comm.dup()
    n = 300001
    t = reg.shared_tensor(n)
    t.copy_(torch.randn(n, generator=torch.Generator().manual_seed(3 + comm.rank)))
    ref = vendor_sum(t)
    for _ in range(3):                  # the window's barriers are reused call after call
        t.copy_(torch.randn(n, generator=torch.Generator().manual_seed(3 + comm.rank)))
        lowcomm.allreduce_(t, reg, "shm")
    assert np.allclose(t.double().numpy(), ref, rtol=1e-5, atol=1e-5)
    assert len(set(comm.allgather_object(t.numpy().tobytes()))) == 1, "ranks differ"


TABLE = {"4096": {"mpi": 50.0, "tree": 10.0, "ring": 90.0},
         "1048576": {"mpi": 900.0, "ring": 500.0, "shm": 700.0}}


@pytest.fixture
def tabled(comm, tmp_path, monkeypatch):
    """A communicator whose ``auto`` reads a table that only rank 0 can read (the others' path
    does not exist, yet all must follow rank 0)."""
    table = tmp_path / "table.json"
    if comm.rank == 0:
        table.write_text(json.dumps({"ranks": comm.size, "times_us": TABLE}))
    monkeypatch.setenv(TABLE_ENV, str(table))
    out = comm.dup()
    out.auto_policy = None
    return out


@pytest.mark.parametrize("nbytes, want", [(4096, "tree"), (64 << 10, "tree"), (300 << 10, "ring"),
                                          (64 << 20, "ring")])
def test_auto_chooses_what_rank_0s_table_says_at_the_nearest_size(nbytes, want, tabled, comm):
    """(One rank has nothing to choose: the vendor's call.)"""
    got = C.choose(tabled, nbytes)
    every = comm.allgather_object(got)
    want = want if comm.size > 1 else "mpi"
    assert got == want, f"chose {got}, the table says {want}"
    assert len(set(every)) == 1, f"ranks disagree: {every}"


@pytest.mark.mpi(min_size=2)
def test_without_a_table_auto_measures_one_writes_it_and_picks_the_fastest(comm, tmp_path, monkeypatch):
    """On one node with no table, the first auto call measures every candidate at every size
    (collective), rank 0 writes the table where auto looks for it, every rank then picks the
    fastest measured algorithm at each size (the same on every rank), and a later Comm reads
    the written table instead of measuring again."""
    from lowcomm.comm.tuning import AUTOTUNE_ENV, TUNE_SIZES, load_table, table_path
    folder = comm.bcast_object(str(tmp_path) + "/")
    monkeypatch.setenv(TABLE_ENV, folder)
    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    calls = []
    real = C.measure_table
    monkeypatch.setattr(C, "measure_table", lambda c: calls.append(1) or real(c, TUNE_SIZES[:3], reps=2))
    fresh = comm.dup()
    fresh.auto_policy = None
    got = {n: C.choose(fresh, n) for n in TUNE_SIZES[:3]}
    assert calls == [1], "measured once, on the first auto call"
    comm.barrier()
    table = load_table(table_path(comm.size), comm.size)
    assert table is not None and sorted(table["times_us"]) == list(TUNE_SIZES[:3]), table
    for n, alg in got.items():
        row = table["times_us"][n]
        plain = {a: t for a, t in row.items() if "." not in a}
        assert set(plain) == {"mpi", "ring", "rabenseifner", "tree", "shm"}, row
        assert alg == min(plain, key=lambda a: (plain[a], CANDIDATES.index(a))), (n, alg, row)
        for op in ("reduce_scatter", "allgather"):     # their auto: the fastest of their rows
            mine = {a.split(".")[1]: t for a, t in row.items() if a.startswith(op + ".")}
            assert set(mine) == {"mpi", "ring", "shm"}, row
            buf = torch.zeros(n // 4)
            assert C._scatter_algorithm(fresh, buf, "auto", op) == \
                min(mine, key=lambda a: (mine[a], ("mpi", "ring", "shm").index(a))), (op, n, row)
    assert len(set(map(str, comm.allgather_object(got)))) == 1, "ranks disagree"
    again = comm.dup()
    again.auto_policy = None
    assert C.choose(again, TUNE_SIZES[0]) == got[TUNE_SIZES[0]] and calls == [1], \
        "a later Comm reads the table written instead of measuring again"


@pytest.mark.parametrize("n", [0, 3, 1024, 300000])
def test_auto_runs_and_files_the_chosen_algorithm(n, tabled, comm):
    t = torch.randint(-4, 5, (n,), generator=torch.Generator().manual_seed(n + 7 * comm.rank)).float()
    ref = vendor_sum(t)
    chosen = C.choose(tabled, 4 * n)
    before = tabled.ledger.get(f"allreduce.{chosen}").calls
    lowcomm.allreduce_(t, tabled, "auto")
    assert np.array_equal(t.double().numpy(), ref), f"auto ({chosen}) differs from MPI_Allreduce"
    assert tabled.ledger.get(f"allreduce.{chosen}").calls == before + 1, f"not filed under {chosen}"


@pytest.mark.mpi(min_size=2)
def test_a_table_of_another_rank_count_is_an_error_on_every_rank_naming_the_file(comm, tmp_path,
                                                                                  monkeypatch):
    table = comm.bcast_object(tmp_path / "table.json")     # rank 0's, named on every rank
    if comm.rank == 0:
        table.write_text(json.dumps({"ranks": comm.size + 1, "times_us": {"4096": {"mpi": 1.0}}}))
    monkeypatch.setenv(TABLE_ENV, str(table))
    wrong = comm.dup()
    wrong.auto_policy = None
    comm.barrier()
    with pytest.raises(lowcomm.LowcommError) as e:
        lowcomm.allreduce_(torch.ones(4), wrong, "auto")
    assert str(table) in str(e.value) and f"{comm.size + 1} ranks" in str(e.value), str(e.value)


@pytest.mark.parametrize("nbytes", [4096, 16 << 20])
def test_without_a_table_auto_follows_the_alpha_beta_rule(nbytes, comm, tmp_path, monkeypatch):
    """Here the vendor: the model never picks shm, only a table does."""
    monkeypatch.setenv(TABLE_ENV, str(tmp_path / "none.json"))
    model = comm.dup()
    model.auto_policy = None
    assert C.choose(model, nbytes) == "mpi"


def test_ring_moves_2_k_minus_1_over_k_of_n_when_k_divides_n(comm):
    K = comm.size
    n = 1024 * K
    before = comm.ledger.get("allreduce.ring").bytes_sent
    lowcomm.allreduce_(torch.ones(n), comm, "ring")
    assert comm.ledger.get("allreduce.ring").bytes_sent - before == 2 * (K - 1) * n * 4 // K


def test_an_unknown_algorithm_is_refused_naming_the_known_ones(comm):
    with pytest.raises(ValueError) as e:
        lowcomm.allreduce_(torch.ones(3), comm, "butterfly")
    assert "ring" in str(e.value) and "butterfly" in str(e.value), str(e.value)
