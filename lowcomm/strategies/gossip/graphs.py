"""Peer graphs for gossip: who sends to whom at step t, and the mixing weights that follow.

A :class:`Graph` on ``size`` ranks is a sequence of directed graphs indexed by the gossip round
``t`` (static graphs have ``period == 1``). Rank ``i`` sends to ``out_peers(i, t)`` and receives
from ``in_peers(i, t)``. Weights follow from the edges:

* D-PSGD (``mixing_matrix``): on a *regular* graph (every rank has the same in- and out-degree
  ``d`` in each round) uniform weights ``W_ij = 1/(d+1)`` over ``{i} ∪ in_peers(i)`` make ``W``
  doubly stochastic (rows: ``d+1`` entries; columns: each rank is the in-peer of exactly ``d``
  ranks). Every built-in graph is regular.
* push-sum (``push_sum_matrix``): rank ``j`` splits its mass evenly over ``{j} ∪ out_peers(j)``,
  ``P_ij = 1/(d_out(j)+1)``: column stochastic on any digraph.

Built-in graphs (``GRAPHS``):

``ring``
    ``i ± 1`` (one peer for 2 ranks, none for 1).
``torus``
    a ``rows × cols`` grid with wrap-around, ``rows`` the largest divisor of K with
    ``rows ≤ √K``; ``i``'s peers are the ranks one row and one column away. A rank count
    with no factorisation ``rows, cols ≥ 2`` (K < 4 or prime) is an error, not a ring in disguise.
``exponential``
    static exponential graph (Assran et al. 2019; Ying et al. 2021, arXiv 2110.13363): ``i``
    sends to ``i + 2^k mod K`` for every ``2^k < K``, so ``⌈log2 K⌉`` peers.
``one-peer-exponential``
    Ying et al. 2021: in round ``t`` rank ``i`` sends to ``i + 2^(t mod τ)`` and receives from
    ``i − 2^(t mod τ)``, ``τ = ⌈log2 K⌉``; one peer per round, weights ½. For K a power of two,
    τ rounds average exactly.
``complete``
    every other rank, weights ``1/K`` (exact averaging in one round).

Example::

    g = build_graph("one-peer-exponential", 8)
    g.out_peers(3, t=2)            # [7]
    g.mixing_matrix(2)             # 8×8 numpy array, doubly stochastic
"""
from __future__ import annotations

import math

import numpy as np

GRAPHS = ("ring", "torus", "exponential", "one-peer-exponential", "complete")


class Graph:
    """A (possibly time-varying) directed graph on ``size`` ranks; round ``t`` uses phase
    ``t % period``. Subclasses define :meth:`out_peers` and :meth:`in_peers`."""

    name = "graph"
    period = 1

    def __init__(self, size: int):
        if int(size) != size or size < 1:
            raise ValueError(f"a graph needs a positive rank count, got {size!r}")
        self.size = int(size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size})"

    def out_peers(self, rank: int, t: int = 0) -> list[int]:
        raise NotImplementedError

    def in_peers(self, rank: int, t: int = 0) -> list[int]:
        raise NotImplementedError

    def all_out_peers(self, rank: int) -> list[int]:
        """Every rank ``rank`` sends to in some round."""
        return sorted({j for t in range(self.period) for j in self.out_peers(rank, t)})

    def all_in_peers(self, rank: int) -> list[int]:
        """Every rank ``rank`` receives from in some round."""
        return sorted({j for t in range(self.period) for j in self.in_peers(rank, t)})

    @property
    def regular(self) -> bool:
        """Every rank has the same in- and out-degree in every round (so uniform weights are
        doubly stochastic). The built-in graphs are regular by construction."""
        for t in range(self.period):
            degrees = {(len(self.in_peers(i, t)), len(self.out_peers(i, t))) for i in range(self.size)}
            if len(degrees) != 1 or len({d for pair in degrees for d in pair}) != 1:
                return False
        return True

    def mixing_matrix(self, t: int = 0) -> np.ndarray:
        """D-PSGD's ``W`` of round ``t`` (``x_i ← Σ_j W_ij x_j``) with uniform weights; only
        doubly stochastic on a regular graph (checked: an error otherwise)."""
        if not self.regular:
            raise ValueError(f"graph {self.name!r} is not regular: uniform weights would not be "
                             "doubly stochastic (use push-sum)")
        return self._uniform_rows(self.in_peers, t)

    def push_sum_matrix(self, t: int = 0) -> np.ndarray:
        """Push-sum's column-stochastic ``P`` of round ``t``: ``P_ij = 1/(d_out(j)+1)``."""
        return self._uniform_rows(self.out_peers, t).T

    def _uniform_rows(self, peers_of, t: int) -> np.ndarray:
        """``M[a, b] = 1/(|peers_of(a)|+1)`` for ``b`` in ``{a} ∪ peers_of(a, t)``, else 0."""
        M = np.zeros((self.size, self.size))
        for a in range(self.size):
            peers = peers_of(a, t)
            for b in [a, *peers]:
                M[a, b] += 1.0 / (len(peers) + 1)
        return M

    def check(self) -> "Graph":
        """Raise ValueError unless in- and out-peers agree (j ∈ out(i) ⇔ i ∈ in(j)), no rank is
        its own peer and no peer is listed twice."""
        for t in range(self.period):
            for i in range(self.size):
                out = self.out_peers(i, t)
                if len(set(out)) != len(out) or i in out or not all(0 <= j < self.size for j in out):
                    raise ValueError(f"graph {self.name!r}: bad out-peers {out} of rank {i} in round {t}")
                for j in out:
                    if i not in self.in_peers(j, t):
                        raise ValueError(f"graph {self.name!r}: {i} sends to {j} in round {t} but "
                                         f"{j} does not receive from {i}")
                for j in self.in_peers(i, t):
                    if i not in self.out_peers(j, t):
                        raise ValueError(f"graph {self.name!r}: {i} receives from {j} in round {t} "
                                         f"but {j} does not send to {i}")
        return self


class Circulant(Graph):
    """Rank ``i`` sends to ``i + o mod K`` for each offset ``o`` of the round's offset set."""

    def __init__(self, name: str, size: int, offsets: list[list[int]]):
        super().__init__(size)
        self.name = name
        # dedupe (ring on 2 ranks: +1 ≡ −1) and drop offsets ≡ 0
        self._offsets = [sorted({o % self.size for o in phase} - {0}) for phase in offsets] or [[]]
        self.period = len(self._offsets)

    def out_peers(self, rank: int, t: int = 0) -> list[int]:
        return [(rank + o) % self.size for o in self._offsets[t % self.period]]

    def in_peers(self, rank: int, t: int = 0) -> list[int]:
        return [(rank - o) % self.size for o in self._offsets[t % self.period]]


class Torus(Graph):
    """2-D torus ``rows × cols`` (row-major ranks), four neighbours (fewer where a side is 2)."""

    name = "torus"

    def __init__(self, size: int, rows: int | None = None):
        super().__init__(size)
        if rows is None:
            rows = max(r for r in range(1, math.isqrt(self.size) + 1) if self.size % r == 0)
        if rows < 2 or self.size % rows or self.size // rows < 2:
            why = "prime" if self.size > 3 else "fewer than 4"
            raise ValueError(f"torus needs the rank count to factor as rows × cols with both ≥ 2; "
                             f"{self.size} ranks is {why} (use ring or exponential)")
        self.rows, self.cols = rows, self.size // rows

    def out_peers(self, rank: int, t: int = 0) -> list[int]:
        a, b = divmod(rank, self.cols)
        R, C = self.rows, self.cols
        cand = [((a - 1) % R) * C + b, ((a + 1) % R) * C + b, a * C + (b - 1) % C, a * C + (b + 1) % C]
        return sorted(set(cand) - {rank})

    in_peers = out_peers   # undirected


class EdgeGraph(Graph):
    """A static digraph from explicit edges ``(src, dst)`` (e.g. an irregular one for push-sum)."""

    def __init__(self, size: int, edges, name: str = "edges"):
        super().__init__(size)
        self.name = name
        self._out = [sorted({d for s, d in edges if s == i}) for i in range(self.size)]
        self._in = [sorted({s for s, d in edges if d == i}) for i in range(self.size)]
        self.check()

    def out_peers(self, rank: int, t: int = 0) -> list[int]:
        return list(self._out[rank])

    def in_peers(self, rank: int, t: int = 0) -> list[int]:
        return list(self._in[rank])


def _powers_of_two_below(size: int) -> list[int]:
    return [1 << k for k in range(max(size - 1, 0).bit_length())]


def build_graph(name: str, size: int) -> Graph:
    """The built-in graph ``name`` (one of ``GRAPHS``) on ``size`` ranks; ValueError naming the
    problem where it cannot be built."""
    if name not in GRAPHS:
        raise ValueError(f"unknown graph {name!r}; known: {', '.join(GRAPHS)}")
    if name == "torus":
        return Torus(size)
    if int(size) != size or size < 1:
        raise ValueError(f"a graph needs a positive rank count, got {size!r}")
    if name == "ring":
        return Circulant(name, size, [[1, -1]])
    if name == "complete":
        return Circulant(name, size, [list(range(1, size))])
    powers = _powers_of_two_below(size)
    if name == "exponential":
        return Circulant(name, size, [powers])
    return Circulant(name, size, [[p] for p in powers])   # one-peer-exponential


def random_pairs(size: int, seed: int, round: int) -> list[int | None]:
    """A random pairing of ``size`` ranks for ``round`` (NoLoCo's outer steps): a uniformly
    random permutation π, drawn from ``(seed, round)`` alone, pairs π[0] with π[1], π[2] with
    π[3], …; with an odd count π[-1] is left alone. Returns each rank's partner (None: alone),
    the same on every rank that asks with the same seed and round, so no rank sends who pairs
    with whom."""
    perm = np.random.default_rng([int(seed), int(round)]).permutation(int(size)).tolist()
    partner: list[int | None] = [None] * int(size)
    for a, b in zip(perm[0::2], perm[1::2]):
        partner[a], partner[b] = b, a
    return partner


def second_eigenvalue(mats: list[np.ndarray]) -> float:
    """Per-round contraction of consensus: ``|λ_2|`` of the product of one period's matrices,
    to the power 1/period (the largest modulus after the eigenvalue 1 of the average)."""
    prod = np.eye(mats[0].shape[0])
    for m in mats:
        prod = m @ prod
    n = prod.shape[0]
    # project out the consensus direction: J = 11ᵀ/n is W's eigenprojection for λ = 1
    rest = prod - np.ones((n, n)) / n
    lam = max(abs(np.linalg.eigvals(rest))) if n > 1 else 0.0
    return float(lam) ** (1.0 / len(mats))
