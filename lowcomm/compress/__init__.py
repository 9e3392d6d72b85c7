"""Gradient compressors: what goes on the wire instead of a dense fp32 bucket.

``COMPRESSORS`` maps the config name to a factory taking the ``[compressor]`` config table.
"""
from __future__ import annotations

from .base import Compressor, Segment

COMPRESSORS = {"none": lambda cfg: Compressor()}


def build_compressor(cfg) -> Compressor | None:
    """The compressor named by a :class:`~lowcomm.config.CompressorConfig` (None for "none")."""
    if cfg.name == "none":
        return None
    return COMPRESSORS[cfg.name](cfg)


__all__ = ["COMPRESSORS", "Compressor", "Segment", "build_compressor"]
