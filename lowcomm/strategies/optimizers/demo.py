"""DeMo: decoupled momentum; only the fast components of the local momenta are exchanged."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...compress.compressor import Compressor
from ...compress.demo import ChunkedDCT, ChunkTopK, QuantizedChunkTopK
from ...compress.error_feedback import ErrorFeedback
from ...compress.twophase import COLLECTIVES
from ...errors import ConfigError
from ...settings import Settings
from .family import ExchangingOptimizer
from ..layout import agreed_dup
from ..method import Context, Method
from ..buffers import Buffers
from ..chunks import chunk_buckets, decoded_memories


@dataclass
class DeMoSettings(Settings):
    """``[strategy]`` keys of ``demo`` (the spec ``demo:topk=32,chunk=64``)."""
    topk: int = 32                 # k: DCT coefficients sent per chunk
    chunk: int = 64                # s: the chunk side (a matrix: s×s blocks)
    decay: float = 0.999           # β: the local momentum's decay
    sign: bool = True              # step with sign(u) (the paper's); false: with u itself
    exchange: str = "two-phase"    # "two-phase" (bytes flat in K) | "allgather" (the paper's) | "auto"
    value_bits: int = 0            # 0: values in the momentum's dtype; 1: their signs (DisTrO)
    # how the ranks' coefficients are averaged: "all" = over the K ranks (a coefficient a rank did
    # not send counts as 0); "senders" = each over the ranks that sent it, as the paper's reference
    # code (scatter_reduce mean); "senders" needs exchange = "allgather"
    average: str = "all"

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "topk", 1)
        self.at_least(prefix, "chunk", 1)
        self.within(prefix, "decay", 0, 1, high_open=True)
        self.one_of(prefix, "exchange", COLLECTIVES)
        if self.value_bits not in (0, 1):
            raise ConfigError.at(prefix, "value_bits", f"must be 0 (full values) or 1 (signs), "
                                 f"got {self.value_bits}")
        self.one_of(prefix, "average", ChunkTopK.AVERAGES)
        if self.average == "senders" and self.exchange != "allgather":
            raise ConfigError.at(prefix, "exchange", "average = \"senders\" (the reference's mean "
                                 "over the ranks that sent a coefficient) needs every rank's pairs: "
                                 f"use exchange = \"allgather\", got {self.exchange!r}")
        if self.value_bits and self.exchange != "allgather":
            raise ConfigError.at(prefix, "exchange", "1-bit values are decoded as ±1 without a "
                                 "scale, which the two-phase owners could not re-select; use "
                                 f"exchange = \"allgather\" with value_bits = 1, got {self.exchange!r}")


@dataclass
class DisTrOSettings(DeMoSettings):
    """``[strategy]`` keys of ``distro``: DeMo at the configuration of Psyche's DisTrO runs
    (Nous Research): chunks of 64 (64×64 tiles of a matrix), the top 4 coefficients of each,
    their values sent as 1 bit (the sign), every rank's all-gathered. Any key can be overridden."""
    topk: int = 4
    chunk: int = 64
    value_bits: int = 1
    exchange: str = "allgather"


def build(s: DeMoSettings, model, optimizer, comm: Comm, ctx: Context) -> "DeMo":
    return DeMo(model, optimizer, comm, settings=s)


def check_run(s: DeMoSettings, cfg, prefix: str) -> None:
    if cfg.compressor.name != "none":
        raise ConfigError("compressor.name", "demo compresses its momentum itself; leave "
                          f"compressor.name = \"none\", got {cfg.compressor.name!r}")


#: ``lowcomm compare``'s settings: the paper's update is sign(u) through plain SGD, so lr is the
#: sign step's size (another method's Adam lr diverges)
SIGN_STEP = ("optimizer.name=sgd", "lr=0.001")
METHOD = Method("demo", DeMoSettings, build, "DeMo: local momentum, its top-k DCT coefficients "
                "per chunk exchanged and removed from it, a sign step", check=check_run,
                python="DeMo", example="demo:topk=4,chunk=8", compare=SIGN_STEP)
DISTRO_METHOD = Method("distro", DisTrOSettings, build, "DisTrO (preset of DeMo): chunk 64, top-4 "
                       "coefficients per chunk, 1-bit values, all-gathered", check=check_run,
                       python="DisTrOSettings", compare=SIGN_STEP)


class DeMo(ExchangingOptimizer):
    """DeMo, decoupled momentum optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870,
    Algorithm 1; the reference implementation's ``DeMo`` optimizer).

    Update, on each of K ranks, per step t, for every parameter x with local gradient g, the
    group's learning rate η, decay β, chunk side s and k coefficients per chunk:

      1. local momentum ``m ← β m + η g`` (never averaged: decoupled);
      2. fast components: ``c = DCT(m)`` over chunks (a matrix: s×s blocks, 2-D DCT-II;
         otherwise chunks of s; :class:`~lowcomm.compress.demo.ChunkedDCT`), and ``q`` = the k
         largest magnitudes of c per chunk (:class:`~lowcomm.compress.demo.ChunkTopK`);
      3. ``m ← m − IDCT(q)``: what is sent leaves the momentum;
      4. the ranks' q are averaged (``exchange = "allgather"``: every rank's (value, index)
         pairs all-gathered, as the paper; ``"two-phase"``: each owner of a range of chunks sums
         the K ranks' pairs and keeps the k largest of each chunk, with a server error that
         carries what it drops to its next step, then an all-gather of the owners' pairs: exact
         at ``k = s²``, bytes flat in K). ``average = "all"`` (the default):
         ``Q = (1/K) Σ_k q_k``, a coefficient a rank did not send counting as 0;
         ``"senders"`` (the paper's reference code, ``scatter_reduce(reduce="mean",
         include_self=False)``; all-gather only): ``Q_i = Σ_{k: i ∈ I_k} q_{k,i} / n_i``, each
         coefficient over the ``n_i`` ranks that sent it;
      5. ``u = IDCT(Q)``; the wrapped optimizer steps with gradient ``sign(u)`` (``sign``, the
         paper's update) or ``u``.

    With ``torch.optim.SGD`` (no momentum) step 5 is the paper's ``x ← x − η sign(u)``, and
    SGD's ``weight_decay`` λ then equals its decoupled decay ``x ← x(1 − ηλ)``; a Nesterov SGD
    adds Nesterov momentum on top of the synchronised sign. Steps 1–3 are error feedback whose
    memory decays by β (the momentum is the residual), kept in DCT space (the DCT is
    orthonormal, so ``DCT(βm + ηg) = β DCT(m) + η DCT(g)``): :class:`~lowcomm.compress.
    error_feedback.ErrorFeedback` around the chunked top-k, its residual scaled by β before each
    step. Every rank applies the same u, so the model stays replicated; buffers are rank 0's
    after every step (DDP's rule). The default averages over all K (the mean of the ranks' q,
    which two-phase can re-select); ``average="senders"`` is the reference's rule: the two differ
    where the ranks pick different coefficients (a coefficient one of K ranks sent weighs K
    times more under "senders").
    Bytes per rank and step, P = Σ_chunks k·(value bytes + index bytes) (int16 indices while
    s² ≤ 32767): ``(K−1)·P`` with the all-gather, ``≈ 2(K−1)/K·P`` two-phase.

    Args:
        model, optimizer: the user's model and the torch optimizer that applies step 5
            (``torch.optim.SGD(lr=η)`` for the paper's update).
        comm: communicator (default: world).
        topk: k ≥ 1, coefficients kept per chunk (at most the chunk's size).
        chunk: s ≥ 1, the chunk side.
        decay: β in [0, 1).
        sign: step with ``sign(u)`` (True) or ``u``.
        exchange: "two-phase", "allgather" or "auto" (the faster by the α–β model).
        average: "all" (over the K ranks) or "senders" (each coefficient over the ranks that
            sent it, the reference's; needs ``exchange="allgather"``): step 4.
        value_bits: 0 (values in the momentum's dtype) or 1: the values' signs, one bit each,
            decoded as ±1 (:class:`~lowcomm.compress.demo.QuantizedChunkTopK`; the whole selected
            coefficients leave the momentum), as Psyche's DisTrO sends them; needs
            ``exchange="allgather"``. The ``distro`` preset (:class:`DisTrOSettings`: chunk 64,
            top-4, 1-bit values, all-gather): ``lowcomm.build("distro", model, sgd)`` or
            ``DeMo(model, sgd, settings=DisTrOSettings())``; bytes per rank and step
            ``(K−1)·Σ_chunks (k·2 + ⌈k/8⌉)`` (int16 indices, packed signs, per bucket).

    Example::

        opt = DeMo(model, torch.optim.SGD(model.parameters(), lr=1e-3), topk=32, chunk=64)
        opt = lowcomm.build("demo:topk=32,chunk=64", model, torch.optim.SGD(model.parameters(), lr=1e-3))
        opt.zero_grad(); loss.backward(); opt.step()
    """

    name = "demo"
    Settings = DeMoSettings

    def _setup(self, s: DeMoSettings) -> None:
        self.topk, self.chunk, self.decay, self.sign = s.topk, s.chunk, s.decay, s.sign
        self.exchange = exchange = s.exchange
        names = {p: n for n, p in self.model.named_parameters()}
        items = []
        for gi, g in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(g["params"]):
                if p.requires_grad:
                    t = ChunkedDCT(p.shape, self.chunk)
                    items.append((t.row, p.numel(), names.get(p, f"param{i}"), p, gi, t))
        self.value_bits = s.value_bits

        def compressor(row: int) -> Compressor:
            codec = QuantizedChunkTopK(row, self.topk, s.value_bits, packed_indices=False,
                                       average=s.average) \
                if s.value_bits else ChunkTopK(row, self.topk, s.average)
            return Compressor(ErrorFeedback(codec), exchange)
        self.buckets = chunk_buckets(items, "demo", compressor)
        broadcast_(self.comm, list(self.model.state_dict().values()), root=0)
        self._comm = agreed_dup(self.comm, "demo.layout",            # fixed shapes from here on
                                repr([(b.key, b.numel) for b in self.buckets]), len(self.buckets))
        self.buffers = Buffers(self.model)
        self.t = 0

    @torch.no_grad()
    def _step(self, closure=None):
        loss = closure() if closure is not None else None
        lrs = [g["lr"] for g in self.optimizer.param_groups]    # (its group dicts, as loaded)
        for b in self.buckets:
            x = torch.cat([t.encode(p.grad if p.grad is not None else torch.zeros_like(p))
                           .reshape(-1).mul(lrs[gi]) for _, p, gi, t, _, _ in b.members])
            b.decay_(self.decay)                             # step 1: m ← βm (then + ηg)
            avg = b.comp.reduce(x, b.key, self._comm, b.segments)      # steps 2–4
            for _, p, _, t, lo, hi in b.members:                       # step 5
                u = t.decode(avg[lo:hi])
                u = u.sign() if self.sign else u
                if p.grad is None:
                    p.grad = u.to(p.dtype)
                else:
                    p.grad.copy_(u)
        self.optimizer.step()
        self.t += 1
        self.buffers.broadcast(self.comm)
        return loss

    @property
    def momentum(self) -> dict[str, torch.Tensor]:
        """Each parameter's local momentum m (parameter-shaped; zero before the first step)."""
        return decoded_memories(self.buckets, lambda m: m[3], lambda m: torch.zeros_like(m[1]))

    def payload_bytes(self) -> int:
        """P: bytes of one rank's (value, index) pairs per step, Σ_chunks k·(value + index)."""
        return sum(b.comp.codec.payload_nbytes(b.numel, b.members[0][1].dtype) for b in self.buckets)

    # state ------------------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "t": self.t,
                "compressors": {b.key: b.comp.state_dict() for b in self.buckets}}

    def _load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.t = int(state["t"])
        for b in self.buckets:
            b.comp.load_state_dict(state["compressors"][b.key])

    def reshard(self, old: list[dict]) -> dict:
        """Model and optimizer are replicas: rank 0's (checked equal). Each new rank's momentum
        is the average of the old ranks' momenta (so the ranks' mean momentum, what the next
        exchanges carry, is kept). The two-phase owners' server errors are cut by rank count:
        the old owners' pieces, in rank order, make the whole bucket, which the new owners cut
        again."""
        from ..reshard import replicated
        merged = replicated(old, self.name)
        K, r = self.comm.size, self.comm.rank
        comps = {}
        for b in self.buckets:
            olds = [s["strategy"]["compressors"][b.key] for s in old]
            state = b.mean_memory_state(olds)
            pieces = [o.get("exchange", {}).get("server_error", {}).get(b.key) for o in olds]
            if any(x is not None for x in pieces):
                whole = torch.cat([x if x is not None else torch.zeros(0) for x in pieces])
                lo, hi = b.comp.codec.bounds(whole.numel(), K)[r:r + 2]
                if hi > lo:
                    state["exchange"] = {"server_error": {b.key: whole[lo:hi].clone()}}
            comps[b.key] = state
        merged["strategy"] = dict(merged["strategy"], compressors=comps)
        return merged

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if not final:
            return {}
        return {"topk": self.topk, "chunk": self.chunk, "decay": self.decay, "sign": self.sign,
                "exchange": self.exchange, "value_bits": self.value_bits,
                "average": self.settings.average, "payload_bytes_per_step": self.payload_bytes()}

    def _finish(self) -> None:
        self.buffers.broadcast(self.comm)
