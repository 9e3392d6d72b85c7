"""A real, offline workload: byte-level language modelling on the Python standard library.

The corpus is the ``.py`` source of the running interpreter's standard library (tens of MB on
every machine, no download), or any text file or directory given as ``data.path``: every
regular file under it matching ``data.glob`` (default: all), binary files (a NUL byte in the
first 8 KiB) skipped, FIFOs, sockets and devices never opened; the corpus says how many files
it read and skipped and why. Files are read in sorted order; a file goes to the held-out split when the CRC-32 of its relative path
falls in the lowest ``eval_fraction`` of the range, so the split never depends on the reading
order or on ``max_bytes``.

Batches are a pure function of ``(seed, split, step, rank)``: rank r draws windows from the
r-th of K contiguous shards of the training bytes. That makes runs reproducible, lets a resumed
run continue exactly, and lets a test rebuild the global batch of K ranks in one process.
"""
from __future__ import annotations

import logging
import stat
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
BINARY_PROBE = 8192     # a NUL byte in this many first bytes marks a file as binary
log = logging.getLogger("lowcomm.tasks.corpus")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path, pattern: str, skipped: dict[str, int]) -> list[Path]:
    """Regular files under ``root`` matching ``pattern`` (the stdlib: ``*.py`` outside tests and
    site-packages), in sorted order; anything else is counted in ``skipped`` by reason."""
    stdlib = root == stdlib_root()
    out = []
    for p in sorted(root.rglob(pattern or ("*.py" if stdlib else "*"))):
        if stdlib and SKIP_DIRS.intersection(p.relative_to(root).parts):
            continue
        try:
            mode = p.stat().st_mode          # follows links; never opens the file
        except OSError:
            skipped["unreadable"] = skipped.get("unreadable", 0) + 1
            continue
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            skipped["not a regular file"] = skipped.get("not a regular file", 0) + 1
            continue
        out.append(p)
    return out


def _read_text(p: Path, limit: int, skipped: dict[str, int]) -> bytes | None:
    try:
        with open(p, "rb") as f:
            blob = f.read(limit)
    except OSError:
        skipped["unreadable"] = skipped.get("unreadable", 0) + 1
        return None
    if b"\0" in blob[:BINARY_PROBE]:
        skipped["binary"] = skipped.get("binary", 0) + 1
        return None
    return blob


@dataclass
class Corpus:
    """Training and evaluation bytes as uint8 tensors."""
    train: torch.Tensor
    eval: torch.Tensor
    source: str
    files: int

    skipped: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str = "", max_bytes: int = 8_000_000, eval_fraction: float = 0.05,
             glob: str = "") -> "Corpus":
        root = Path(path) if path else stdlib_root()
        where = f"data.path {str(root)!r}"
        if not root.exists():
            raise FileNotFoundError(f"{where} does not exist")
        skipped: dict[str, int] = {}
        if root.is_file():
            if not stat.S_ISREG(root.stat().st_mode):
                raise ValueError(f"{where} is not a regular file")
            raw = np.frombuffer(root.read_bytes()[:max_bytes], dtype=np.uint8)   # any bytes: asked for
            cut = int(len(raw) * (1 - eval_fraction))
            return cls(torch.from_numpy(raw[:cut].copy()), torch.from_numpy(raw[cut:].copy()), str(root), 1)
        train, held, total, files = [], [], 0, 0
        threshold = int(eval_fraction * 2**32)
        for f in _files(root, glob, skipped):
            if total >= max_bytes:
                break
            blob = _read_text(f, max_bytes - total, skipped)
            if blob is None:
                continue
            total += len(blob)
            files += 1
            (held if zlib.crc32(str(f.relative_to(root)).encode()) < threshold else train).append(blob)
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "none"
        if not train or not held:
            if train or held:   # too few files for the split by name: split the text by position
                raw = np.frombuffer(b"".join(train + held), dtype=np.uint8)
                cut = int(len(raw) * (1 - eval_fraction))
                train, held = [raw[:cut].tobytes()], [raw[cut:].tobytes()]
                log.info("%s: no file fell in the held-out split of %d files; holding out the "
                         "last %g of the text instead", where, files, eval_fraction)
            else:
                raise ValueError(f"{where}: need text for both the training and the held-out split, "
                                 f"read {files} files ({sum(map(len, train))} train / "
                                 f"{sum(map(len, held))} eval bytes; skipped: {why}); add files or "
                                 f"change data.glob / data.eval_fraction")
        as_tensor = lambda parts: torch.from_numpy(np.frombuffer(b"".join(parts), dtype=np.uint8).copy())  # noqa: E731
        return cls(as_tensor(train), as_tensor(held), str(root), files, skipped)

    def describe(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return (f"{self.source}: {self.files} files read ({len(self.train)} train / "
                f"{len(self.eval)} eval bytes)" + (f"; skipped {why}" if why else ""))

    def check(self, seq_len: int, world: int) -> None:
        """Raise ValueError naming data.path if a rank's shard or the held-out text is shorter
        than one window of ``seq_len``."""
        if len(self.train) // world <= seq_len + 1 or len(self.eval) <= seq_len + 1:
            raise ValueError(f"data.path {self.source!r}: {len(self.train)} training bytes "
                             f"({len(self.train) // world} per rank on {world}) and "
                             f"{len(self.eval)} held-out bytes are too few for seq_len "
                             f"(data.seq_len={seq_len}); use more text or a shorter seq_len")

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
