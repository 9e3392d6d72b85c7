"""A real, offline workload: byte-level language modelling on the Python standard library.

The corpus is the ``.py`` source of the running interpreter's standard library (tens of MB on
every machine, no download), or any text file or directory given as ``data.path``. Files are
read in sorted order; a file goes to the held-out split when the CRC-32 of its relative path
falls in the lowest ``eval_fraction`` of the range, so the split never depends on the reading
order or on ``max_bytes``.

Batches are a pure function of ``(seed, split, step, rank)``: rank r draws windows from the
r-th of K contiguous shards of the training bytes. That makes runs reproducible, lets a resumed
run continue exactly, and lets a test rebuild the global batch of K ranks in one process.
"""
from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))


@dataclass
class Corpus:
    """Training and evaluation bytes as uint8 tensors."""
    train: torch.Tensor
    eval: torch.Tensor
    source: str
    files: int

    @classmethod
    def load(cls, path: str = "", max_bytes: int = 8_000_000, eval_fraction: float = 0.05) -> "Corpus":
        root = Path(path) if path else stdlib_root()
        if not root.exists():
            raise FileNotFoundError(f"data.path {str(root)!r} does not exist")
        if root.is_file():
            raw = np.frombuffer(root.read_bytes()[:max_bytes], dtype=np.uint8)
            cut = int(len(raw) * (1 - eval_fraction))
            return cls(torch.from_numpy(raw[:cut].copy()), torch.from_numpy(raw[cut:].copy()), str(root), 1)
        train, held, total, files = [], [], 0, 0
        threshold = int(eval_fraction * 2**32)
        for f in _files(root):
            if total >= max_bytes:
                break
            blob = f.read_bytes()[:max_bytes - total]
            total += len(blob)
            files += 1
            (held if zlib.crc32(str(f.relative_to(root)).encode()) < threshold else train).append(blob)
        if not train or not held:
            raise ValueError(f"{root}: need text for both splits, found {files} files "
                             f"({sum(map(len, train))} train / {sum(map(len, held))} eval bytes)")
        as_tensor = lambda parts: torch.from_numpy(np.frombuffer(b"".join(parts), dtype=np.uint8).copy())  # noqa: E731
        return cls(as_tensor(train), as_tensor(held), str(root), files)

    def batch(self, step: int, rank: int, world: int, batch_size: int, seq_len: int,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, each ``(batch_size, seq_len)`` int64, for ``rank``."""
        shard = len(self.train) // world
        lo = rank * shard
        if shard <= seq_len + 1:
            raise ValueError(f"{shard} training bytes per rank is too few for seq_len={seq_len}")
        g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) & (2**63 - 1))
        starts = lo + torch.randint(0, shard - seq_len - 1, (batch_size,), generator=g)
        return self._windows(self.train, starts, seq_len)

    def eval_batches(self, count: int, batch_size: int, seq_len: int):
        """``count`` fixed evaluation batches, the same on every rank and in every run."""
        g = torch.Generator().manual_seed(12345)
        span = len(self.eval) - seq_len - 1
        for _ in range(count):
            yield self._windows(self.eval, torch.randint(0, span, (batch_size,), generator=g), seq_len)

    @staticmethod
    def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        w = data[idx].long()
        return w[:, :-1], w[:, 1:]
