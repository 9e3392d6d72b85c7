"""Checkpoints that survive a killed job: atomic, checksummed, one file per rank.

Layout under the checkpoint folder::

    step-00000400/manifest.json      step, world size, the run's id, resolved config, sha256 and
                                     size of each file
    step-00000400/rank-00000.pt      everything rank 0 needs to continue exactly
    step-00000400/rank-00001.pt      ...

Writing is atomic: every rank writes into ``.step-00000400.tmp/`` (write, flush, fsync), rank 0
writes the manifest last, fsyncs it, renames the folder into place and fsyncs the parent. A
folder named ``step-*`` is therefore complete or absent, never half-written; a crash leaves at
most a ``.tmp`` folder, which the next save (and the next run's start) removes; a write that
fails (a full disk) removes it at once and names the file. Only the newest ``keep`` of the run's
own checkpoints are kept; a checkpoint of another run (its manifest names another run id) is
never overwritten, pruned or resumed from.

Reading verifies each rank's file against the manifest's sha256 on that rank and agrees across
ranks (a run resumed on another number of ranks reads and verifies every old rank's file on every
new rank, and merges them: :func:`lowcomm.run.snapshot.restore`); a corrupt or truncated checkpoint is named in a warning and the previous good one is
used. All ranks must see the same folder (one machine, or a shared file system).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..comm.comm import Comm
from ..errors import LowcommError

log = logging.getLogger("lowcomm.run.checkpoint")

# Config keys a resumed run may change: everything else must match the checkpoint.
MUTABLE_KEYS = ("steps", "log_every", "eval_batches", "checkpoint.", "comm.", "on_nonfinite")


class CheckpointError(LowcommError):
    """No usable checkpoint, or one that cannot continue this run."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def checkpoint_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints (``step-*`` folders) under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [int(p.name[5:]) for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, reverse=True)


def config_mismatch(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two config dicts and that a resume may not change."""
    a, b = _flatten(saved), _flatten(current)
    return [f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not k.startswith(MUTABLE_KEYS)]


class Checkpointer:
    """Save and find checkpoints of one run under ``root``; collective over ``comm``.

    Args:
        root: checkpoint folder (created on save).
        comm: the ranks taking part (a control communicator; its traffic is not the method's).
        keep: how many of the newest checkpoints to keep (≥ 1).
        run: the id of the run (:mod:`lowcomm.run.folder`): written into each manifest; the
            checkpoints of another run are skipped on load and never pruned (None: any).

    Example::

        ck = Checkpointer("runs/x/checkpoints", ctl, keep=2)
        ck.save(step, {"model": model.state_dict(), ...}, config=cfg.to_dict())
        state = ck.load_latest(config=cfg.to_dict())      # None when there is none
    """

    def __init__(self, root: str | Path, comm: Comm, keep: int = 2, run: str | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.comm, self.keep, self.run = Path(root), comm, keep, run
        self.resize = False

    def _name(self, step: int) -> str:
        return f"step-{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, newest first."""
        return checkpoint_steps(self.root)

    def _owner(self, step: int) -> str | None:
        """The run id in the manifest of ``step`` (None: unreadable, or from before run ids)."""
        try:
            return json.loads((self.root / self._name(step) / "manifest.json").read_text()).get("run")
        except (OSError, ValueError, AttributeError):
            return None

    def _foreign(self, step: int) -> bool:
        owner = self._owner(step)
        return self.run is not None and owner is not None and owner != self.run

    def save(self, step: int, state: dict, config: dict, distributed: dict | None = None) -> Path:
        """Write this rank's ``state`` for ``step``; returns the checkpoint folder.
        ``distributed``: the model's state for torch.distributed.checkpoint
        (:mod:`lowcomm.run.dcp`), written into the folder's ``dcp/`` by every rank together."""
        rank, size = self.comm.rank, self.comm.size
        final = self.root / self._name(step)
        tmp = self.root / f".{self._name(step)}.tmp"
        if rank == 0:
            with self._writing(tmp, self.root):
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".step-*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
        self.comm.barrier()
        shared = self._save_distributed(tmp, distributed)
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        fname = f"rank-{rank:05d}.pt"
        with self._writing(tmp, tmp / fname):
            _write(tmp / fname, data)
        files = self.comm.allgather_object((fname, hashlib.sha256(data).hexdigest(), len(data)))
        if rank == 0:
            if final.exists() and self._foreign(step):
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(f"{final} is a checkpoint of another run ({self._owner(step)}); "
                                      "not overwritten: give each run its own checkpoint.dir")
            manifest = {"step": step, "world_size": size, "run": self.run, "config": config,
                        "format": "dcp" if distributed is not None else "torch",
                        "files": {f: {"sha256": h, "bytes": n} for f, h, n in files + shared}}
            with self._writing(tmp, tmp / "manifest.json"):
                _write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
                _fsync_dir(tmp)
                if final.exists():          # a previous attempt at the same step
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.root)
            for old in [s for s in self.steps() if not self._foreign(s)][self.keep:]:
                shutil.rmtree(self.root / self._name(old), ignore_errors=True)
        self.comm.barrier()
        return final

    def _save_distributed(self, tmp: Path, distributed: dict | None) -> list[tuple]:
        """The DCP files of ``distributed`` written under ``tmp`` (every rank together), as
        (name, sha256, bytes) on rank 0 (for the manifest); [] without it."""
        if distributed is None:
            return []
        from .dcp import save_model
        with self._writing(tmp, tmp / "dcp"):
            names = save_model(distributed, tmp, self.comm)
        if self.comm.rank != 0:
            return []
        return [(n, hashlib.sha256(data).hexdigest(), len(data))
                for n in names for data in [(tmp / n).read_bytes()]]

    @contextlib.contextmanager
    def _writing(self, tmp: Path, what: Path):
        """A write of ``what`` for the checkpoint in ``tmp``: an OSError (a full disk, a
        read-only folder) removes the partial checkpoint and is an error naming the file."""
        try:
            yield
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise LowcommError(f"cannot write checkpoint file {what}: {e.strerror or e}; removed "
                               f"the partial checkpoint {tmp}") from e

    def _check(self, step: int) -> tuple[str | None, dict | None, bytes | None]:
        """(problem, manifest, this rank's bytes) of one checkpoint; problem None when good."""
        folder = self.root / self._name(step)
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            return f"{folder}/manifest.json unreadable ({e})", None, None
        owner = manifest.get("run") if isinstance(manifest, dict) else None
        if self.run is not None and owner is not None and owner != self.run:
            return f"{folder} is a checkpoint of another run ({owner})", None, None
        for name in manifest.get("files", {}) if manifest.get("format") == "dcp" else ():
            if name.startswith("dcp/"):                 # the shared DCP files, on every rank
                problem, _ = self._verify(folder, manifest, name)
                if problem:
                    return problem, manifest, None
        if manifest.get("world_size") != self.comm.size:
            if manifest.get("format") == "dcp":
                return None, manifest, None   # refused by the caller, naming the format
            if not self.resize:
                return None, manifest, None   # a config problem, reported by the caller
            datas = []                        # another rank count: read every old rank's file
            for r in range(int(manifest["world_size"])):
                problem, data = self._verify(folder, manifest, f"rank-{r:05d}.pt")
                if problem:
                    return problem, manifest, None
                datas.append(data)
            return None, manifest, datas
        problem, data = self._verify(folder, manifest, f"rank-{self.comm.rank:05d}.pt")
        return problem, manifest, data

    def _verify(self, folder: Path, manifest: dict, fname: str) -> tuple[str | None, bytes | None]:
        """(problem or None, the bytes of ``fname``) checked against the manifest."""
        entry = manifest.get("files", {}).get(fname)
        try:
            data = (folder / fname).read_bytes()
        except OSError as e:
            return f"{folder / fname} unreadable ({e})", None
        if entry is None:
            return f"{folder}/manifest.json lists no {fname}", None
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry["bytes"] or digest != entry["sha256"]:
            return (f"{folder / fname} is corrupt or truncated ({len(data)} bytes, sha256 "
                    f"{digest[:12]}…; manifest says {entry['bytes']} bytes, {entry['sha256'][:12]}…)",
                    None)
        return None, data

    def load_latest(self, config: dict | None = None, resize: bool = False) -> dict | None:
        """The newest checkpoint that is intact on every rank, as this rank's state dict (with
        ``"step"``), or None if there is none. Corrupt ones, and those of another run, are
        skipped with a warning naming the file; a checkpoint of another config is a
        CheckpointError, and so is one of another world size unless ``resize``: then every rank
        reads and verifies every old rank's file and gets ``{"step", "world_size", "ranks":
        [old rank 0's state, ...]}`` to merge."""
        self.resize = resize
        steps = self.comm.bcast_object(self.steps() if self.comm.rank == 0 else None)
        for step in steps:
            problem, manifest, data = self._check(step)
            problems = [p for p in self.comm.allgather_object(problem) if p]
            if problems:
                if self.comm.rank == 0:
                    for p in problems:
                        log.warning("checkpoint step %d skipped: %s; trying the previous one", step, p)
                continue
            if manifest["world_size"] != self.comm.size and manifest.get("format") == "dcp":
                raise CheckpointError(f"checkpoint {self.root / self._name(step)} was written "
                                      f"through torch.distributed.checkpoint (checkpoint.format "
                                      f"= \"dcp\") by {manifest['world_size']} ranks; this run "
                                      f"has {self.comm.size}: resume it on as many ranks")
            if manifest["world_size"] != self.comm.size and not self.resize:
                raise CheckpointError(f"checkpoint {self.root / self._name(step)} was written by "
                                      f"{manifest['world_size']} ranks; this run has {self.comm.size} "
                                      f"(resume on the same number of ranks)")
            if config is not None:
                diff = config_mismatch(manifest["config"], config)
                if diff:
                    raise CheckpointError(f"checkpoint {self.root / self._name(step)} cannot continue "
                                          f"this run; config differs in: " + "; ".join(diff))
            if isinstance(data, list):       # another rank count: every old rank's state
                return {"step": step, "world_size": manifest["world_size"],
                        "ranks": [torch.load(io.BytesIO(d), weights_only=False) for d in data]}
            state = torch.load(io.BytesIO(data), weights_only=False)
            state["step"] = step
            if manifest.get("format") == "dcp":
                state["dcp"] = self.root / self._name(step)
            return state
        return None
