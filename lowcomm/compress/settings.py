"""The ``[compressor]`` table: one set of keys shared by every compressor (each reads its own)."""
from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings


@dataclass
class CompressorSettings(Settings):
    """Which compressor and its knobs; :func:`lowcomm.compress.build_compressor` builds it."""
    name: str = "none"             # a name of lowcomm.compress.COMPRESSORS; "none" = dense
    error_feedback: bool | None = None   # None: the method's own default (on for top-k)
    ratio: float = 0.01            # top-k / random-k: share of elements kept
    levels: int = 16               # QSGD quantisation levels s
    approx_rank: int = 2           # PowerSGD rank r
    start_iter: int = 10           # PowerSGD: dense all-reduce before this step
    min_compression_rate: float = 1.0   # PowerSGD: compress a matrix iff n·m > rate·r(n+m)
    bucket_size: int = 512         # QSGD: elements sharing one norm (the paper's bucket size d)
    block: int = 2048              # int8 / int4: elements sharing one scale (ZeRO++'s blocks)
    seed: int = 0                  # qsgd / randomk / powersgd generators (saved in checkpoints)
    collective: str = "two-phase"  # all-gathered methods: "two-phase" (flat in K) | "allgather" | "auto" (α–β)

    def validate(self, prefix: str = "compressor.") -> None:
        """Keys and combinations (whether approx_rank fits the model's matrices: at the first
        step). Errors name ``prefix + key``."""
        self.within(prefix, "ratio", 0, 1, low_open=True)
        self.within(prefix, "levels", 1, 127)      # levels are sent as int8
        self.at_least(prefix, "bucket_size", 1)
        self.at_least(prefix, "block", 1)
        self.at_least(prefix, "min_compression_rate", 0)
        self.at_least(prefix, "approx_rank", 1)
        self.at_least(prefix, "start_iter", 0)
        from . import check
        check(self, prefix)
