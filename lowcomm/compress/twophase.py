"""Compressed all-reduce whose bytes per rank stay flat in the rank count K (two-phase), and the
α–β rule that picks it or the all-gather exchange.

A compressor whose payloads cannot be summed on the wire (int8, QSGD, top-k, sign, sign-mv,
EF-sign) was exchanged by all-gather: each rank sends its whole payload P to K−1 ranks, so its
bytes grow like (K−1)·P. :func:`two_phase_reduce` is the scheme of 1-bit Adam's compressed
all-reduce (Tang et al. 2021, arXiv 2102.02888, Section 4.2; the same shape as the
reduce-scatter + all-gather of a ring all-reduce) for any such compressor: each rank sends about
2(K−1)/K·P. Summable methods (fp16, bf16, random-k) and PowerSGD keep their all-reduces.

``compressor.collective`` = ``"auto"`` | ``"allgather"`` | ``"two-phase"`` chooses; ``auto``
(:func:`choose`) takes the smaller predicted time ``α·rounds + bytes/β`` of one call, with

* all-gather: ``K−1`` rounds, ``(K−1)·P(n)`` bytes sent;
* two-phase: ``2(K−1)`` rounds, ``(K−1)·(P(c) + S(c))`` bytes sent, ``c = ⌈n/K⌉``;

P(m) the payload bytes of m elements, S(m) the owner's re-compressed chunk (= P(m) except
sign-mv's voted chunk on even K), α and β the link model of the communicator's level
(:func:`link_of`: its topology's link for ``comm.level``, the outermost level's for a world
communicator, else :data:`DEFAULT_LINK`, a 20 µs / 10 Gbit/s LAN). A tie goes to all-gather. So
two-phase wins once ``P·(1 − 2/K) ≳ α·β``: on a LAN for buckets above a few tens of kB, on a
25 ms / 100 Mbit/s WAN above ~300 kB. The choice depends only on n, dtype, K and the link, so
every rank makes the same one.

Every caller of ``Compressor.reduce`` gets it: the :class:`~lowcomm.strategies.reducer.Reducer` (SyncDP's
buckets, and the syncdp levels of per-level policies), the outer loops' compressed
pseudo-gradients (DiLoCo, streaming DiLoCo: :mod:`lowcomm.strategies.outer`, on the
communicator of their level, so ``auto`` sees that level's link).

Not used by CHOCO gossip (:mod:`lowcomm.strategies.gossip`): there each rank sends its own
compressed difference to a few neighbours, a point-to-point exchange whose bytes per rank are
already independent of K, and no rank reduces anyone's chunk.
"""
from __future__ import annotations

import torch

from ..comm.collectives import chunk_bounds

COLLECTIVES = ("auto", "allgather", "two-phase")
#: (α seconds per message, β bytes per second) used when no topology names the link: a LAN.
DEFAULT_LINK = (20e-6, 1.25e9)


def check_collective(value: str) -> str:
    if value not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {value!r}")
    return value


def link_of(comm) -> tuple[float, float]:
    """``(α, β)`` of the links ``comm``'s collectives cross: ``comm.link``, which
    :meth:`lowcomm.comm.topology.Topology.comms` sets from the topology (a world communicator: its
    outermost level, which a world collective crosses), else :data:`DEFAULT_LINK`. Makes no
    MPI call."""
    link = getattr(comm, "link", None)
    if link is None:
        return DEFAULT_LINK
    return link.alpha_s, link.bytes_per_s


def predicted_seconds(comp, n: int, dtype: torch.dtype, K: int,
                      link: tuple[float, float] = DEFAULT_LINK) -> dict[str, float]:
    """α–β seconds of one call of each variant for a bucket of ``n`` elements (module docstring)."""
    alpha, beta = link
    if K <= 1:
        return {"allgather": 0.0, "two-phase": 0.0}
    c = -(-n // K)
    return {"allgather": (K - 1) * alpha + (K - 1) * comp.payload_nbytes(n, dtype) / beta,
            "two-phase": 2 * (K - 1) * alpha
            + (K - 1) * (comp.payload_nbytes(c, dtype) + comp.server_nbytes(c, dtype, K)) / beta}


def choose(comp, n: int, dtype: torch.dtype, comm) -> str:
    """``"allgather"`` or ``"two-phase"``: ``comp.collective`` unless it is ``"auto"``, then the
    variant with the smaller :func:`predicted_seconds` on :func:`link_of` ``(comm)``."""
    want = check_collective(comp.collective)
    if not comp.two_phase:
        return "allgather"
    if want != "auto":
        return want
    t = predicted_seconds(comp, n, dtype, comm.size, link_of(comm))
    return "two-phase" if t["two-phase"] < t["allgather"] else "allgather"


def _bytes_of(payload: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def _nbytes(template) -> int:
    return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
               for dt, shape in template)


def _unbytes(raw: torch.Tensor, template, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Tensors of ``template`` ((dtype, shape) pairs) from bytes ``raw`` of shape (*lead, nbytes)."""
    out, off = [], 0
    for dt, shape in template:
        nb = torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        part = raw[..., off:off + nb].clone(memory_format=torch.contiguous_format)
        out.append(part.view(dt).reshape(*lead, *shape))
        off += nb
    return out


def two_phase_reduce(comp, x: torch.Tensor, key: str, comm, segments) -> torch.Tensor:
    """The average over ``comm`` of every rank's flat ``x`` by compressed reduce-scatter and
    compressed all-gather, bytes per rank ≈ 2(K−1)/K × payload (Tang et al. 2021, arXiv
    2102.02888, 1-bit Adam's compressed all-reduce with worker and server error feedback,
    generalised to any compressor; for top-k the owner's re-sparsification of the summed chunk
    is gTop-k's (Shi et al. 2019, arXiv 1901.04359) with chunk-balanced selection as in Ok-Topk
    (Li & Hoefler 2022, arXiv 2201.07598); for sign-mv the owner takes the vote of Bernstein et
    al. 2019, arXiv 1810.05291).

    Update, on each of K ranks (rank r), x of n elements cut into chunks j = 0..K−1 by
    :func:`~lowcomm.comm.collectives.chunk_bounds` (sizes ⌈n/K⌉ or ⌊n/K⌋):
      1. compress every chunk on its own, ``C(x_j)`` (``comp.compress_chunks``: worker error
         feedback, if the compressor has it, on the whole of x first; top-k keeps
         ``max(1, ⌊ratio·|x_j|⌋)`` per chunk, so every block has a fixed size);
      2. all-to-all (``Comm.alltoallv``): rank r receives ``C(x_r)`` of every rank;
      3. the owner decodes and averages its chunk, ``a_r = (1/K) Σ_k D(C_k(x_r))`` (sign-mv:
         ``a_r = sign(Σ_k sign_k)``, ties 0), and re-compresses it: ``C(a_r)``, or, where the
         method has worker error feedback (top-k, EF-sign, ``error_feedback = true``),
         ``C(a_r + e_r)`` with the server error ``e_r ← a_r + e_r − D(C(a_r + e_r))`` kept per
         bucket key (1-bit Adam's error feedback at both ends; QSGD, unbiased, needs none; the
         vote is sent exactly: 1 bit on odd K, a base-3 digit (8/5 bits) where even K allows
         ties);
      4. all-gather (``Comm.allgatherv``) the re-compressed chunks; every rank decodes all K and
         returns their concatenation, the same tensor on every rank.
    Bytes sent per rank: ``Σ_{j≠r} P(|x_j|) + (K−1)·S(|x_r|)``, exactly (the ledger's
    ``alltoall.v`` and ``allgather.v`` rows). With K = 1 nothing is sent: the result is
    ``D(C(D(C(x))))`` (for sign and int8 equal to ``D(C(x))``).

    Args:
        comp: a compressor with ``two_phase`` set (see :class:`~lowcomm.compress.base.Compressor`).
        x: this rank's flat tensor; key: the bucket's key (state is kept under it);
        comm: the communicator; segments: the parameters inside x (for worker error feedback).

    Example::

        avg = two_phase_reduce(Int8(), flat, "bucket0", comm, segments)
    """
    x = x.detach().reshape(-1)
    n, K, r = x.numel(), comm.size, comm.rank
    b = chunk_bounds(n, K)
    chunks = comp.compress_chunks(x, key, segments, b)             # [(payload, ctx)] per chunk
    templates = [[(t.dtype, tuple(t.shape)) for t in p] for p, _ in chunks]
    mine, ctx = chunks[r]
    if K == 1:
        stacks = [t.unsqueeze(0) for t in mine]
    else:
        recv = comm.alltoallv([_bytes_of(p, x.device) for p, _ in chunks], [_nbytes(templates[r])] * K)
        stacks = _unbytes(torch.cat(recv).view(K, -1), templates[r], (K,)) if mine else []
    if b[r + 1] > b[r]:
        reduced, _ = comp.server_reduce(stacks, ctx, K, key)
    else:
        reduced = []
    server = [comp.server_template(p, c, K) for p, c in chunks]
    if K == 1:
        blocks = [_bytes_of(reduced, x.device)]
    else:
        blocks = comm.allgatherv(_bytes_of(reduced, x.device), [_nbytes(t) for t in server])
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    for j in range(K):
        if b[j + 1] > b[j]:
            payload = _unbytes(blocks[j].to(x.device), server[j])
            out[b[j]:b[j + 1]] = comp.server_decompress(payload, chunks[j][1], K).to(x.dtype)
    return out
