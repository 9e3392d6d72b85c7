"""Compressed all-reduce whose bytes per rank stay flat in the rank count K (two-phase), and the
α–β rule that picks it or the all-gather exchange.

A codec whose payloads cannot be summed on the wire (int8, QSGD, top-k, sign, sign-mv, EF-sign)
is exchanged by all-gather (:class:`~lowcomm.compress.exchange.Gathered`): each rank sends its
whole payload P to K−1 ranks, so its bytes grow like (K−1)·P. :class:`TwoPhase` is the scheme of
1-bit Adam's compressed all-reduce (Tang et al. 2021, arXiv 2102.02888, Section 4.2; the same
shape as the reduce-scatter + all-gather of a ring all-reduce) for any such codec: each rank
sends about 2(K−1)/K·P. Summable codecs (fp16, bf16, random-k) and PowerSGD keep their
all-reduces.

``compressor.collective`` = ``"auto"`` | ``"allgather"`` | ``"two-phase"`` chooses; ``auto``
(:class:`~lowcomm.compress.exchange.Auto`) takes the smaller predicted time
``α·rounds + bytes/β`` of one call (:func:`predicted_seconds`), with

* all-gather: ``K−1`` rounds, ``(K−1)·P(n)`` bytes sent;
* two-phase: ``2(K−1)`` rounds, ``(K−1)·(P(c) + S(c))`` bytes sent, ``c = ⌈n/K⌉``;

P(m) the payload bytes of m elements, S(m) the owner's re-encoded chunk (= P(m) except
sign-mv's voted chunk on even K), α and β the link model of the communicator's level
(:func:`link_of`: its topology's link for ``comm.level``, the outermost level's for a world
communicator, else :data:`DEFAULT_LINK`, a 20 µs / 10 Gbit/s LAN). A tie goes to all-gather. So
two-phase wins once ``P·(1 − 2/K) ≳ α·β``: on a LAN for buckets above a few tens of kB, on a
25 ms / 100 Mbit/s WAN above ~300 kB. The choice depends only on n, dtype, K and the link, so
every rank makes the same one.

Every caller of ``Compressor.reduce`` gets it: the :class:`~lowcomm.strategies.sync.reducer.Reducer`
(SyncDP's buckets, and the syncdp levels of per-level policies), the outer loops' compressed
pseudo-gradients (DiLoCo, streaming DiLoCo: :mod:`lowcomm.strategies.outer.loop`, on the
communicator of their level, so ``auto`` sees that level's link), and 1-bit Adam's momentum
(:mod:`lowcomm.strategies.optimizers.onebit_adam`).

Not used by CHOCO gossip (:mod:`lowcomm.strategies.gossip.gossip`): there each rank sends its own
compressed difference to a few neighbours, a point-to-point exchange whose bytes per rank are
already independent of K, and no rank reduces anyone's chunk.
"""
from __future__ import annotations

import math

import torch

from .base import Exchange, Segment, pieces, uncovered_

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
    link = comm.link
    if link is None:
        return DEFAULT_LINK
    return link.alpha_s, link.bytes_per_s


def predicted_seconds(codec, n: int, dtype: torch.dtype, K: int,
                      link: tuple[float, float] = DEFAULT_LINK) -> dict[str, float]:
    """α–β seconds of one call of each variant for a bucket of ``n`` elements (module
    docstring); ``codec`` a codec or a compressor (its ``codec``)."""
    codec = codec.codec
    alpha, beta = link
    if K <= 1:
        return {"allgather": 0.0, "two-phase": 0.0}
    c = -(-n // K)
    return {"allgather": (K - 1) * alpha + (K - 1) * codec.payload_nbytes(n, dtype) / beta,
            "two-phase": 2 * (K - 1) * alpha
            + (K - 1) * (codec.payload_nbytes(c, dtype) + codec.owner(K).payload_nbytes(c, dtype)) / beta}


def _bytes_of(payload: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def _nbytes(layout) -> int:
    return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for dt, shape in layout)


def _unbytes(raw: torch.Tensor, layout, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Tensors of ``layout`` ((dtype, shape) pairs) from bytes ``raw`` of shape (*lead, nbytes)."""
    out, off = [], 0
    for dt, shape in layout:
        nb = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        part = raw[..., off:off + nb].clone(memory_format=torch.contiguous_format)
        out.append(part.view(dt).reshape(*lead, *shape))
        off += nb
    return out


class TwoPhase(Exchange):
    """The average over ``comm`` of every rank's flat ``x`` by compressed reduce-scatter and
    compressed all-gather, bytes per rank ≈ 2(K−1)/K × payload (Tang et al. 2021, arXiv
    2102.02888, 1-bit Adam's compressed all-reduce with worker and server error feedback,
    generalised to any codec; for top-k the owner's re-sparsification of the summed chunk is
    gTop-k's (Shi et al. 2019, arXiv 1901.04359) with chunk-balanced selection as in Ok-Topk
    (Li & Hoefler 2022, arXiv 2201.07598); for sign-mv the owner takes the vote of Bernstein et
    al. 2019, arXiv 1810.05291).

    Update, on each of K ranks (rank r), x of n elements cut into chunks j = 0..K−1 by
    the codec's ``bounds`` (:func:`~lowcomm.comm.collectives.chunk_bounds`: sizes ⌈n/K⌉ or
    ⌊n/K⌋; DeMo's chunked top-k cuts between its rows):

      1. encode every chunk, ``C(x_j)`` (``encoder.compress_chunks``: worker error feedback, if
         the compressor has it, on the whole of x first; top-k keeps ``max(1, ⌊ratio·|x_j|⌋)``
         per chunk, so every block has a fixed size);
      2. all-to-all (``Comm.alltoallv``): rank r receives ``C(x_r)`` of every rank;
      3. the owner decodes and combines its chunk, ``a_r = (1/K) Σ_k D(C_k(x_r))`` (the codec's
         ``decompress_mean``; sign-mv: ``a_r = sign(Σ_k sign_k)``, ties 0), and re-encodes it
         with ``codec.owner(K)``: ``C(a_r)``, or, where the compressor has error feedback
         (top-k, EF-sign, ``error_feedback = true``), ``C(a_r + e_r)`` with the server error
         ``e_r ← a_r + e_r − D(C(a_r + e_r))`` kept per bucket key, zero where no parameter
         lies (1-bit Adam's error feedback at both ends; QSGD, unbiased, needs none; the vote
         is sent exactly: 1 bit on odd K, a base-3 digit (8/5 bits) where even K allows ties);
      4. all-gather (``Comm.allgatherv``) the re-encoded chunks; every rank decodes all K and
         returns their concatenation, the same tensor on every rank.

    Bytes sent per rank: ``Σ_{j≠r} P(|x_j|) + (K−1)·S(|x_r|)``, exactly (the ledger's
    ``alltoall.v`` and ``allgather.v`` rows). With K = 1 nothing is sent: the result is
    ``D(C(D(C(x))))`` (for sign and int8 equal to ``D(C(x))``).

    State: the owners' server errors (``server_error``, by bucket key), in ``state_dict()``.

    Example::

        avg = Compressor(BlockQuant(8), TwoPhase()).reduce(flat, "bucket0", comm, segments)
    """

    name = "two-phase"

    def __init__(self) -> None:
        self.server_error: dict[str, torch.Tensor] = {}

    def reduce(self, comp, x: torch.Tensor, key: str, comm, segments: list[Segment]) -> torch.Tensor:
        x = x.detach().reshape(-1)
        n, K, r = x.numel(), comm.size, comm.rank
        b = comp.codec.bounds(n, K)
        chunks = comp.encoder.compress_chunks(x, key, segments, b, r)   # [(payload, ctx)] per chunk
        mine, ctx = chunks[r]
        if K == 1:
            stacks = [t.unsqueeze(0) for t in mine]
        else:
            layout = [(t.dtype, tuple(t.shape)) for t in mine]
            recv = comm.alltoallv([_bytes_of(p, x.device) for p, _ in chunks], [_nbytes(layout)] * K)
            stacks = _unbytes(torch.cat(recv).view(K, -1), layout, (K,)) if mine else []
        owner = comp.codec.owner(K)
        segments = segments or [Segment(key, torch.Size([n]), 0, n)]
        reduced = []
        if b[r + 1] > b[r]:
            reduced = self._owner(comp, stacks, ctx, K, key, pieces(segments, b[r], b[r + 1]), r)
        layouts = [owner.payload_layout(hi - lo, x.dtype, len(pieces(segments, lo, hi))) if hi > lo else []
                   for lo, hi in zip(b, b[1:])]
        if K == 1:
            blocks = [_bytes_of(reduced, x.device)]
        else:
            blocks = comm.allgatherv(_bytes_of(reduced, x.device), [_nbytes(t) for t in layouts])
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        for j in range(K):
            if b[j + 1] > b[j]:
                payload = _unbytes(blocks[j].to(x.device), layouts[j])
                out[b[j]:b[j + 1]] = owner.decompress(payload, chunks[j][1]).to(x.dtype)
        return out

    def _owner(self, comp, stacks: list[torch.Tensor], ctx, K: int, key: str,
               own: list[Segment], rank: int) -> list[torch.Tensor]:
        """Step 3: the owner's chunk. ``stacks[i][k]`` is payload tensor i of rank k; returns the
        re-encoded aggregate, keeping the server error where the compressor feeds errors back
        (not for unbiased codecs)."""
        codec = comp.codec
        owner = codec.owner(K)
        avg = codec.decompress_mean(stacks, ctx, K)
        feedback = comp.error_feedback and not codec.unbiased
        if feedback:
            e = self.server_error.get(key)
            if e is not None and e.shape == avg.shape and e.dtype == avg.dtype:
                avg = avg + e
        payload, ctx2 = owner.encode(avg, key, own, rank)
        if feedback:
            self.server_error[key] = uncovered_(avg - owner.decompress(payload, ctx2).to(avg.dtype), own)
        return payload

    def state_dict(self) -> dict:
        return {"server_error": {k: e.clone() for k, e in self.server_error.items()}} \
            if self.server_error else {}

    def load_state_dict(self, state: dict) -> None:
        self.server_error = {k: e.clone() for k, e in state.get("server_error", {}).items()}
