"""Layouts the ranks agree on: a check made once per communicator, and size balancing."""
from __future__ import annotations

from ..comm.comm import Comm
from ..errors import CommError


def check_agreed(comm: Comm, op: str, signature: str, count: int, what: str = "parameters",
                 mine: str = "") -> None:
    """Check once that every rank of ``comm`` holds the layout ``signature`` of its ``what``
    (``count`` parts): a rank that differs is a CommError ``op`` on every rank, naming the
    ranks (and ``mine``: this rank's layout)."""
    bad = comm.disagreeing(signature, count)
    if bad:
        raise CommError(op, comm.rank, f"ranks {bad} hold differently named or shaped {what} "
                        f"than rank 0{f' (this rank: {mine})' if mine else ''}")


def agreed_dup(comm: Comm, op: str, signature: str, count: int, ledger=None, what: str = "parameters",
               mine: str = "") -> Comm:
    """A duplicate of ``comm`` for a method's fixed-layout traffic (``ledger``: its own, else
    ``comm``'s), after checking once that every rank holds the layout ``signature`` of its
    ``what`` (``count`` parts, :func:`check_agreed`); then no per-call agreement check."""
    out = comm.dup(ledger)
    check_agreed(out, op, signature, count, what, mine)
    out.validate = False
    return out


def balance(sizes: list[int], bins: int) -> list[int]:
    """Greedy size balancing (LPT, Graham 1969): largest item first onto the least-loaded bin
    (ties: the lowest bin). Returns the bin of each item."""
    load = [0] * bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        out[i] = b
        load[b] += sizes[i]
    return out

