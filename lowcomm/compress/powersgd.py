"""PowerSGD: rank-r gradient compression by one step of power iteration, warm-started."""
from __future__ import annotations

import math

import torch

from ..comm.comm import Comm
from .base import Codec, Exchange, Seeded, Segment, check_finite, whole


#: up to this rank, P Qᵀ is built as r rank-1 updates (r passes at memory speed; a GEMM with an
#: inner dimension of 1 or 2 runs far below it); above it, one GEMM
OUTER_MAX_RANK = 4
OUTER_MIN_NUMEL = 1 << 16


def low_rank_(out: torch.Tensor, P: torch.Tensor, Qt: torch.Tensor, subtract: bool = False) -> torch.Tensor:
    """``out ← P Qᵀ`` (``subtract``: ``out ← out − P Qᵀ``) for P (n, r) and Qᵀ (r, m), in place."""
    r = P.shape[1]
    if r > OUTER_MAX_RANK or out.numel() < OUTER_MIN_NUMEL:     # small: one GEMM call is cheaper
        return out.addmm_(P, Qt, alpha=-1) if subtract else torch.matmul(P, Qt, out=out)
    if not subtract:
        torch.mul(P[:, :1], Qt[0], out=out)
    for j in range(0 if subtract else 1, r):
        out.addcmul_(P[:, j:j + 1], Qt[j], value=-1 if subtract else 1)
    return out


def orthogonalize(P: torch.Tensor) -> torch.Tensor:
    """The Q of P's reduced QR (step 4 of :class:`PowerSGD`), computed in float32 for a 16-bit P
    (torch has no QR for bfloat16 or float16) and returned in P's dtype."""
    if P.dtype in (torch.float32, torch.float64):
        return torch.linalg.qr(P).Q
    return torch.linalg.qr(P.float()).Q.to(P.dtype)


class PowerIteration(Exchange):
    """PowerSGD's exchange (steps 0 and 2–6 of :class:`PowerSGD`): the dense all-reduce of the
    first ``start_iter`` steps, then the all-reduce of the P's (with the dense tensors) and of
    the Q's, each followed by the computation that needs it. The codec keeps its own error
    memory (the compressor's encoder is the codec itself)."""

    name = "power-iteration"

    def reduce(self, comp, flat: torch.Tensor, key: str, comm: Comm, segments: list[Segment]) -> torch.Tensor:
        ps = comp.codec
        x = flat.detach().reshape(-1)
        check_finite(x, key, segments, comm.rank, ps.name)
        segments = segments or whole(key, x)
        mats, dense = ps.plan(segments)          # a rank too large fails at once, not later
        if ps._step(key) < ps.start_iter:
            return comm.allreduce_(x.clone(), "avg")
        r = ps.r
        Ms = [ps._matrix(x, s, n, m) for s, n, m in mats]
        # P travels as Pᵀ (r, n) and Q as Qᵀ (r, m): (M Q)ᵀ = Qᵀ Mᵀ and Qᵀ = P̂ᵀ M are the fast
        # products for a thin Q or P (M is read row by row), and the averages are the same
        p_sizes = [n * r for _, n, _ in mats] + [s.stop - s.start for s in dense]
        pbuf = torch.empty(sum(p_sizes), dtype=x.dtype, device=x.device)
        parts = list(pbuf.split(p_sizes))
        for (s, n, m), M, part in zip(mats, Ms, parts):
            torch.matmul(ps._q(s.name, m, x.device, x.dtype).T, M.T, out=part.view(r, n))
        for s, part in zip(dense, parts[len(mats):]):
            part.copy_(x[s.start:s.stop])
        comm.allreduce_(pbuf, "avg")
        out = torch.empty_like(x)
        for s, part in zip(dense, parts[len(mats):]):
            out[s.start:s.stop] = part
        if not mats:
            return out
        Ps = [orthogonalize(part.view(r, n).T) for (_, n, _), part in zip(mats, parts)]
        q_sizes = [m * r for _, _, m in mats]
        qbuf = torch.empty(sum(q_sizes), dtype=x.dtype, device=x.device)
        qparts = list(qbuf.split(q_sizes))
        for (_, n, m), M, P, part in zip(mats, Ms, Ps, qparts):
            torch.matmul(P.T, M, out=part.view(r, m))
        comm.allreduce_(qbuf, "avg")
        for (s, n, m), M, P, part in zip(mats, Ms, Ps, qparts):
            Qt = part.view(r, m)
            approx = out[s.start:s.stop].view(n, m)
            low_rank_(approx, P, Qt)
            ps._remember(s, M, Qt, approx=approx)
        return out


class PowerSGD(Seeded, Codec):
    """Rank-r PowerSGD with warm start and error feedback (Vogels, Karimireddy & Jaggi 2019,
    arXiv 1905.13727, Algorithms 1 and 2).

    Every parameter of two or more dimensions is a matrix ``M`` of n = shape[0] rows and
    m = the product of the other dimensions; vectors (and matrices that would not shrink,
    ``n·m ≤ min_compression_rate · r·(n+m)``) are sent dense. Per bucket and step on K ranks:

      0. for the first ``start_iter`` steps of a bucket: one dense all-reduce (mean), no memory;
      1. ``M ← G + E`` (E: this rank's error memory, zero at first);
      2. ``P ← M Q`` with Q the previous step's (warm start; at first N(0, 1) drawn alike on
         every rank from a generator seeded with ``seed``);
      3. all-reduce mean of [all P's, all dense tensors] (one message);
      4. ``P̂ ← orthogonalize(P)`` (reduced QR; in float32 for a 16-bit model);
      5. ``Q ← Mᵀ P̂``; all-reduce mean of all Q's (the second message);
      6. the average is ``P̂ Qᵀ`` (dense tensors: their mean); ``E ← M − P̂ Qᵀ`` (as the
         paper's code and torch's PowerSGD hook do), and Q is kept for the next step.

    Bytes per rank and bucket: all-reduces of ``4·(Σ r·n + dense elements)`` and
    ``4·Σ r·m`` bytes (float32), i.e. ``r·(n+m)`` elements per compressed matrix. Steps 2–6 are
    its own exchange (:class:`PowerIteration`: two all-reduces interleaved with the
    computation); ``compress``/``decompress`` run them on one rank alone (gossip).

    Args:
        approx_rank: r ≥ 1; larger than a matrix's smaller side is an error naming it.
        start_iter: dense steps per bucket before compression starts.
        error_feedback: keep the error memory E (the paper's default).
        min_compression_rate: compress a matrix only when ``n·m > rate · r(n+m)``
            (1: whenever it shrinks; 0: always, e.g. to check that full rank equals dense).
        seed: seed of the shared generator of the first Q (equal on every rank).

    Example::

        comp = Compressor(PowerSGD(approx_rank=4, start_iter=10))
        avg = comp.reduce(flat, "bucket0", comm, segments)
    """

    name, summable = "powersgd", False
    decodes_alone = False          # its factors are a power iteration over every rank's
    per_rank = False
    own_exchange = PowerIteration

    def __init__(self, approx_rank: int = 2, start_iter: int = 10, error_feedback: bool = True,
                 min_compression_rate: float = 1.0, seed: int = 0):
        if int(approx_rank) != approx_rank or approx_rank < 1:
            raise ValueError(f"approx_rank must be an integer >= 1, got {approx_rank}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        if min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate}")
        self.r, self.start_iter = int(approx_rank), int(start_iter)
        self.error_feedback, self.min_rate = bool(error_feedback), float(min_compression_rate)
        self._init_rng(seed)
        self.q: dict[str, torch.Tensor] = {}
        self.error: dict[str, torch.Tensor] = {}
        self.iters: dict[str, int] = {}

    # layout -----------------------------------------------------------------------------------
    def plan(self, segments: list[Segment]) -> tuple[list[tuple[Segment, int, int]], list[Segment]]:
        """Split segments into compressed matrices ``(segment, n, m)`` and dense segments."""
        mats, dense = [], []
        for s in segments:
            if len(s.shape) < 2:
                dense.append(s)
                continue
            n = int(s.shape[0])
            m = math.prod(int(d) for d in s.shape[1:])
            if min(n, m) <= 1:          # a vector in a matrix's shape
                dense.append(s)
            elif self.r > min(n, m):
                raise ValueError(f"PowerSGD approx_rank={self.r} is larger than parameter "
                                 f"{s.name!r} ({n}×{m} as a matrix); use approx_rank <= {min(n, m)}")
            elif n * m > self.min_rate * self.r * (n + m):
                mats.append((s, n, m))
            else:
                dense.append(s)
        return mats, dense

    def _q(self, name: str, m: int, device, dtype) -> torch.Tensor:
        q = self.q.get(name)
        if q is None or q.shape != (m, self.r):
            g = self.generator(torch.device("cpu"))     # CPU draws: identical on every device
            q = torch.randn(m, self.r, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
            self.q[name] = q
        return q

    def _matrix(self, x: torch.Tensor, s: Segment, n: int, m: int) -> torch.Tensor:
        """``M = G + E`` as an (n, m) matrix: a view of ``x`` where there is no error memory
        (read only), else the memory itself, with G added in place (it becomes the next E in
        :meth:`_remember`): no copy of the gradient."""
        M = x[s.start:s.stop].view(n, m)
        e = self.error.get(s.name) if self.error_feedback else None
        if e is None or e.numel() != n * m or e.dtype != x.dtype or e.device != x.device:
            return M
        return e.view(n, m).add_(M)

    def _remember(self, s: Segment, M: torch.Tensor, Qt: torch.Tensor, P: torch.Tensor | None = None,
                  approx: torch.Tensor | None = None) -> None:
        """Keep ``Q`` (given as Qᵀ, (r, m)) and ``E ← M − P Qᵀ`` (``approx`` when ``P Qᵀ`` is
        already built; in place where M is the memory: one fused pass)."""
        self.q[s.name] = Qt.T.contiguous()
        if not self.error_feedback:
            return
        e = self.error.get(s.name)
        in_place = e is not None and M.data_ptr() == e.data_ptr()
        E = M if in_place else M.clone()
        if approx is None:
            low_rank_(E, P, Qt, subtract=True)
        else:
            E.sub_(approx)
        if not in_place:
            self.error[s.name] = E.reshape(-1)

    def _step(self, key: str) -> int:
        it = self.iters.get(key, 0)
        self.iters[key] = it + 1
        return it

    # one rank on its own (compress -> decompress; e.g. gossip) --------------------------------
    def encode(self, x, key, segments, rank=None):
        """The same power-iteration step without averaging: payload ``[P̂'s (n, r) and dense, Qᵀ's (r, m)]``."""
        mats, dense = self.plan(segments)
        if self._step(key) < self.start_iter:
            return [x.clone()], None
        ps, qs = [], []
        for s, n, m in mats:
            M = self._matrix(x, s, n, m)
            P = orthogonalize(torch.matmul(self._q(s.name, m, x.device, x.dtype).T, M.T).T)
            Qt = torch.matmul(P.T, M)                          # Qᵀ = P̂ᵀ M, (r, m)
            self._remember(s, M, Qt, P)
            ps.append(P.reshape(-1))
            qs.append(Qt.reshape(-1))
        ps += [x[s.start:s.stop] for s in dense]
        layout = (x.numel(), [(s, n, m) for s, n, m in mats], dense)
        return [torch.cat(ps), torch.cat(qs) if qs else x.new_zeros(0)], layout

    def decompress(self, payload, ctx):
        if ctx is None:
            return payload[0]
        numel, mats, dense = ctx
        pbuf, qbuf = payload
        r = self.r
        out = torch.empty(numel, dtype=pbuf.dtype, device=pbuf.device)
        po = qo = 0
        for s, n, m in mats:
            P = pbuf[po:po + n * r].view(n, r)
            Qt = qbuf[qo:qo + m * r].view(r, m)
            low_rank_(out[s.start:s.stop].view(n, m), P, Qt)
            po, qo = po + n * r, qo + m * r
        for s in dense:
            out[s.start:s.stop] = pbuf[po:po + s.stop - s.start]
            po += s.stop - s.start
        return out

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"q": {k: v.clone() for k, v in self.q.items()},
                "error": {k: v.clone() for k, v in self.error.items()},
                "iters": dict(self.iters), **self.rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.q = {k: v.clone() for k, v in state["q"].items()}
        self.error = {k: v.clone() for k, v in state["error"].items()}
        self.iters = dict(state["iters"])
        self.load_rng_state(state)
