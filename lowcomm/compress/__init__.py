"""Gradient compressors: what goes on the wire instead of a dense fp32 bucket.

A :class:`Compressor` is a codec (:class:`~lowcomm.compress.base.Codec`: ``compress`` /
``decompress``, optionally a vectorised mean decoding) composed with an exchange
(:mod:`lowcomm.compress.exchange`: summed on the wire, all-gathered, two-phase), with
:class:`ErrorFeedback` as an optional wrapper of the codec's encoding.

``COMPRESSORS`` maps the config name to a factory taking the ``[compressor]`` config table
(:class:`~lowcomm.run.config.CompressorConfig`) and returning the codec, the bare compression
operator Q. :func:`build_compressor` returns the *gradient* compressor: Q, wrapped in
:class:`ErrorFeedback` where ``error_feedback`` (or the method's default: on for topk, randomk,
ef-sign) asks for it, composed with the exchange ``collective`` names. SyncDP and the outer
loops use :func:`build_compressor`; CHOCO gossip takes the bare Q, since its x̂ already is an
error memory (feeding the error back twice diverges).

============  =========================================  ====================================
name          method                                     bytes per rank, bucket of n elements
============  =========================================  ====================================
none          dense all-reduce                           all-reduce of 4n
fp16, bf16    16-bit cast, summed                        all-reduce of 2n
int8          blockwise int8, a scale per ``block``      all-gather of n + 4⌈n/block⌉
int4          blockwise int4, two to a byte              all-gather of ⌈n/2⌉ + 4⌈n/block⌉
qsgd          QSGD, ``levels`` s, norm per bucket_size   all-gather of n + 4⌈n/bucket_size⌉
topk          top-k values + int32 indices (EF)          all-gather of k(4 + 4), k=⌊ratio·n⌋
randomk       shared random indices, values only (EF)    all-reduce of 4k
sign          (‖x‖₁/n)·sign(x), bit-packed               all-gather of ⌈n/8⌉ + 4 + ⌈S/8⌉
sign-mv       majority vote of packed signs              all-gather of ⌈n/8⌉ + ⌈S/8⌉
ef-sign       sign with error feedback                   all-gather of ⌈n/8⌉ + 4 + ⌈S/8⌉
powersgd      rank-r power iteration, warm start, EF     all-reduces of 4(Σrn + dense), 4Σrm
============  =========================================  ====================================

S is the number of parameters in the bucket: the 1-bit methods send one bit per parameter, set
where it is all zero (decoded as 0: one bit per element cannot say zero, and an unused layer
would otherwise move by the scale every step). The all-gathers grow like K−1.
``compressor.collective`` ("auto" | "allgather" | "two-phase") lets every all-gathered method run the two-phase collective instead (all-to-all of compressed
chunks, each owner reduces and re-compresses its chunk, all-gather of those: about
2(K−1)/K × the payload, flat in K; :mod:`lowcomm.compress.twophase`), the default: bytes are
what lowcomm's users pay for, and they stay flat in K; "auto" picks the variant with the smaller
α–β time on the communicator's link (the all-gather where latency dominates: small buckets, few
ranks, long links).
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import Codec, Exchange, Segment
from .cast import Cast
from .compressor import Compressor
from .error_feedback import ErrorFeedback
from .exchange import Auto, Gathered, Summed
from .powersgd import PowerSGD
from .quantize import QSGD, BlockQuant
from .sign import ScaledSign, SignMajorityVote
from .sparsify import RandomK, TopK
from .twophase import COLLECTIVES, TwoPhase

#: methods whose error feedback is on unless ``error_feedback = false``
EF_DEFAULT = {"topk", "randomk", "ef-sign"}
#: methods that keep their own error memory (the wrapper is not applied to them)
EF_BUILT_IN = {"powersgd"}


#: ``lowcomm compare``'s settings of a compressor (its own good settings, as
#: :attr:`lowcomm.Method.compare` is a strategy's): overrides added to ``compressor.name=NAME``.
#: EF-sign under AdamW at the shared lr = 3e-3 rose from 3.56 to 4.49 and ended at 3.70 after
#: 300 steps; a ``--tune lr=1e-4,3e-4,1e-3,3e-3`` sweep chose 3e-4, where it falls to 2.96
#: (docs/results/tuned-comparison.md)
COMPARE: dict[str, tuple[str, ...]] = {"ef-sign": ("lr=0.0003",)}


def uses_error_feedback(cfg) -> bool:
    """Whether ``cfg`` (a CompressorConfig) asks for the ErrorFeedback wrapper."""
    if cfg.name in EF_BUILT_IN:
        return False
    return cfg.error_feedback if cfg.error_feedback is not None else cfg.name in EF_DEFAULT


def check(cfg, prefix: str = "compressor.") -> None:
    """Raise ConfigError (a ValueError) naming the key for a name or a combination of keys no
    method accepts (:class:`~lowcomm.compress.settings.CompressorSettings` and
    :func:`build_compressor` both use it)."""
    if cfg.name not in COMPRESSORS:
        raise ConfigError.at(prefix, "name", f"unknown compressor {cfg.name!r}; known: {', '.join(COMPRESSORS)}")
    collective = getattr(cfg, "collective", "two-phase")
    if collective not in COLLECTIVES:
        raise ConfigError.at(prefix, "collective", f"unknown value {collective!r}; known: "
                          f"{', '.join(COLLECTIVES)}")
    if cfg.name == "none" and cfg.error_feedback:
        raise ConfigError.at(prefix, "error_feedback", "needs a lossy compressor (compressor.name "
                          "is 'none')")
    if cfg.name == "ef-sign" and cfg.error_feedback is False:
        raise ConfigError.at(prefix, "error_feedback", "ef-sign is sign with error feedback; "
                          "error_feedback = false would make it 'sign'")


def _method(make):
    """A registry factory: check the config, build the codec."""
    def factory(cfg) -> Codec:
        check(cfg)
        return make(cfg)
    return factory


COMPRESSORS = {
    "none": lambda cfg: Codec(),
    "fp16": _method(lambda cfg: Cast(torch.float16)),
    "bf16": _method(lambda cfg: Cast(torch.bfloat16)),
    "int8": _method(lambda cfg: BlockQuant(8, cfg.block)),
    "int4": _method(lambda cfg: BlockQuant(4, cfg.block)),
    "qsgd": _method(lambda cfg: QSGD(cfg.levels, cfg.bucket_size, cfg.seed)),
    "topk": _method(lambda cfg: TopK(cfg.ratio)),
    "randomk": _method(lambda cfg: RandomK(cfg.ratio, cfg.seed)),
    "sign": _method(lambda cfg: ScaledSign("sign")),
    "sign-mv": _method(lambda cfg: SignMajorityVote()),
    "ef-sign": _method(lambda cfg: ScaledSign("ef-sign")),
    "powersgd": _method(lambda cfg: PowerSGD(cfg.approx_rank, cfg.start_iter,
                                             cfg.error_feedback is not False,
                                             cfg.min_compression_rate, cfg.seed)),
}


def build_compressor(cfg, error_feedback: bool | None = None) -> Compressor | None:
    """The gradient compressor named by a :class:`~lowcomm.run.config.CompressorConfig` (None for
    "none"): its codec, wrapped in :class:`ErrorFeedback` where ``error_feedback`` or the
    method's default asks (``error_feedback=False`` here: the bare operator, as gossip takes
    it), with the exchange of ``cfg.collective``. SyncDP and the outer loops use this."""
    check(cfg)
    if cfg.name == "none":
        return None
    codec = COMPRESSORS[cfg.name](cfg)
    fed_back = uses_error_feedback(cfg) if error_feedback is None else error_feedback
    return Compressor(ErrorFeedback(codec) if fed_back else codec,
                      getattr(cfg, "collective", "two-phase"))


__all__ = ["COMPARE", "COMPRESSORS", "Auto", "Cast", "Codec", "Compressor", "ErrorFeedback", "Exchange",
           "Gathered", "BlockQuant", "PowerSGD", "QSGD", "RandomK", "ScaledSign", "Segment",
           "SignMajorityVote", "Summed", "TopK", "TwoPhase", "build_compressor", "check",
           "uses_error_feedback"]
