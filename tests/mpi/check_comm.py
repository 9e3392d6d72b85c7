"""Comm's own calls, on every rank.

Point-to-point, non-blocking, bcast, allgather, split, the ledger's per-level accounting, and the
metadata check that turns mismatched tensors into a CommError on every rank instead of a hang or
corrupt memory."""
import pytest
import torch

import lowcomm
from lowcomm.comm.ledger import wire_bytes

multi = pytest.mark.mpi(min_size=2)


def neighbours(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


def test_sendrecv_around_a_ring(comm):
    right, left = neighbours(comm)
    got = torch.empty(5, dtype=torch.float64)
    comm.sendrecv_(torch.full((5,), float(comm.rank), dtype=torch.float64), right, got, left)
    assert torch.equal(got, torch.full((5,), float(left), dtype=torch.float64))


def test_isend_irecv_bfloat16(comm):
    right, left = neighbours(comm)
    box = torch.empty(3, dtype=torch.bfloat16)
    reqs = [comm.irecv_(box, left, tag=7),
            comm.isend(torch.full((3,), comm.rank + 0.5, dtype=torch.bfloat16), right, tag=7)]
    for q in reqs:
        q.wait()
    assert torch.equal(box, torch.full((3,), left + 0.5, dtype=torch.bfloat16))


def test_iallreduce_average(comm):
    t = torch.full((10,), float(comm.rank))
    comm.iallreduce_(t, op="avg").wait()
    assert torch.allclose(t, torch.full((10,), (comm.size - 1) / 2))


def test_bcast(comm):
    b = torch.arange(4.0) if comm.rank == 0 else torch.zeros(4)
    comm.bcast_(b, root=0)
    assert torch.equal(b, torch.arange(4.0))


def test_allgather(comm):
    g = comm.allgather(torch.tensor([comm.rank, 10 * comm.rank]))
    assert torch.equal(g, torch.tensor([[i, 10 * i] for i in range(comm.size)]))


def test_iallgather_equals_allgather_and_is_charged_where_it_was_posted(comm):
    """``iallgather`` gives ``allgather``'s tensor; its bytes go to the ledger in force when it
    was posted (``charged_to``), not to the one in force when it completes."""
    from lowcomm.comm.ledger import Ledger
    c = comm.dup(Ledger())
    c.validate = False
    t = torch.arange(5, dtype=torch.int16) + 10 * c.rank
    mine = Ledger()
    with c.charged_to(mine):
        request, out = c.iallgather(t)
    request.wait()
    assert torch.equal(out, c.allgather(t)), "iallgather differs from allgather"
    sent, _ = wire_bytes("allgather", t.numel() * 2, c.size)
    assert mine.get("allgather", c.level).bytes_sent == sent
    assert c.ledger.get("allgather", c.level).bytes_sent == sent     # the blocking one only
    with pytest.raises(lowcomm.CommError, match="contiguous"):
        c.iallgather(torch.ones(4)[::2])
    c.free()


def test_split_files_its_traffic_under_its_level(comm):
    """Even and odd ranks."""
    K, r = comm.size, comm.rank
    sub = comm.split(r % 2, level="half")
    assert sub.size == (K + 1 - r % 2) // 2
    x = torch.ones(8)
    sub.allreduce_(x)
    assert torch.equal(x, torch.full((8,), float(sub.size))), "allreduce on the split"
    row = comm.ledger.get("allreduce.mpi", level="half")
    assert row.calls == 1 and row.bytes_sent == wire_bytes("allreduce", 32, sub.size)[0], row


def test_a_negative_colour_gives_no_communicator(comm):
    assert comm.split(-1) is None


def usable(comm) -> None:
    """The communicator still works after a CommError."""
    y = torch.ones(2)
    comm.allreduce_(y)
    assert torch.equal(y, torch.full((2,), float(comm.size))), "not usable after the CommError"


@multi
def test_mismatched_shapes_are_a_comm_error_naming_op_rank_and_shapes(comm):
    bad = torch.ones(4 if comm.rank == 0 else 5)
    with pytest.raises(lowcomm.CommError) as e:
        lowcomm.allreduce_(bad, comm, "ring")
    msg = str(e.value)
    assert f"rank {comm.rank}" in msg and "allreduce.ring" in msg and "rank 0: float32[4]" in msg \
        and "rank 1: float32[5]" in msg, msg
    usable(comm)


@multi
def test_mismatched_dtypes_are_a_comm_error(comm):
    bad = torch.ones(4, dtype=torch.float32 if comm.rank == 0 else torch.float64)
    with pytest.raises(lowcomm.CommError, match=r"float64\[4\]") as e:
        comm.allreduce_(bad)
    assert "float32[4]" in str(e.value)
    usable(comm)


@multi
def test_different_algorithms_on_different_ranks_are_a_comm_error(comm):
    """They would deadlock."""
    with pytest.raises(lowcomm.CommError, match="another op"):
        lowcomm.allreduce_(torch.ones(4), comm, "ring" if comm.rank == 0 else "tree")
    usable(comm)


@multi
def test_validate_false_sends_no_check(comm):
    quiet = comm.dup()
    quiet.validate = False
    before = comm.ledger.get("check")
    quiet.allreduce_(torch.ones(2))
    assert comm.ledger.get("check").calls == before.calls


def test_a_non_contiguous_send_is_refused(comm):
    with pytest.raises(lowcomm.CommError, match="contiguous"):
        comm.send(torch.ones(4)[::2], neighbours(comm)[0])


@multi
def test_an_idle_wait_gives_the_same_results_through_the_non_blocking_calls_asleep(comm):
    """``Comm.idle``: each blocking call runs as its non-blocking form, tested between sleeps
    that double from ``first_s`` to ``max_s`` (the others wait for a rank 0 that comes 50 ms
    late, so they do sleep)."""
    import time as real_time

    from lowcomm.comm.idle import IdleWait
    naps = []

    class Counting(IdleWait):
        def sleep(self, n):
            naps.append(self.pause(n))
            super().sleep(n)

    c = comm.dup()
    c.idle = Counting(0.001, 0.004)
    right, left = neighbours(c)
    if c.rank == 0:
        real_time.sleep(0.05)
    t = torch.full((1000,), float(c.rank))
    c.allreduce_(t)
    assert torch.equal(t, torch.full((1000,), c.size * (c.size - 1) / 2))
    blocks = c.allgatherv(torch.full((c.rank + 1,), c.rank, dtype=torch.uint8),
                          [j + 1 for j in range(c.size)])
    assert [b.tolist() for b in blocks] == [[j] * (j + 1) for j in range(c.size)]
    got = c.alltoallv([torch.full((2,), 10 * c.rank + j, dtype=torch.uint8) for j in range(c.size)],
                      [2] * c.size)
    assert [b.tolist() for b in got] == [[10 * j + c.rank] * 2 for j in range(c.size)]
    b = torch.arange(4.0) if c.rank == 0 else torch.zeros(4)
    c.bcast_(b, root=0)
    assert torch.equal(b, torch.arange(4.0))
    box = torch.empty(3)
    reqs = [c.irecv_(box, left, tag=3), c.isend(torch.full((3,), float(c.rank)), right, tag=3)]
    for q in reqs:
        q.wait()
    assert torch.equal(box, torch.full((3,), float(left)))
    if c.rank != 0:       # only the non-blocking path sleeps (a blocking call polls)
        assert naps[:3] == [0.001, 0.002, 0.004] and set(naps) <= {0.001, 0.002, 0.004}, \
            f"a rank waiting 50 ms for rank 0 slept {naps}"
    c.free()
