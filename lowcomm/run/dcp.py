"""A split model's checkpoint through torch's own distributed checkpoint format
(:mod:`torch.distributed.checkpoint`, DCP), ``checkpoint.format = "dcp"``.

Every rank writes its pieces of the model's tensors (DTensors where the method splits them)
into one DCP folder, ``step-00000400/dcp/``, beside lowcomm's per-rank files (which then hold
everything but the model: the method's and the loop's state, the RNGs, the ledger); DCP's
planner writes a replicated tensor once and records each piece's place in the whole tensor
(``.metadata``). Loading reads each rank's pieces back in place, at the same split; the files
are torch's, so torch's tools (``dcp.load`` into a plain model with ``no_dist=True``,
``torch.distributed.checkpoint.format_utils``) read the whole model from them too. The method
gives the state (:meth:`~lowcomm.strategies.capabilities.Capabilities.distributed_model_state`);
one that keeps none refuses the setting.
"""
from __future__ import annotations

from pathlib import Path

from ..comm.comm import Comm
from ..errors import ConfigError

#: checkpoint.format's values: lowcomm's per-rank torch.save files, or DCP for the model
FORMATS = ("torch", "dcp")
FOLDER = "dcp"


def _check_group(comm: Comm) -> None:
    """DCP runs over torch.distributed's default group: it must be the checkpoint's ranks."""
    import torch.distributed as dist
    size = dist.get_world_size() if dist.is_initialized() else 0
    if size != comm.size:
        raise ConfigError("checkpoint.format", f"\"dcp\" saves through torch.distributed's "
                          f"default group, which spans {size} ranks here, not the run's "
                          f"{comm.size}: use it where the method splitting the model spans the "
                          "whole job (tp alone), or checkpoint.format = \"torch\"")


def save_model(state: dict, folder: Path, comm: Comm) -> list[str]:
    """Write ``state`` (the method's distributed model state) under ``folder``/dcp on every
    rank together; returns the files written, relative to ``folder``."""
    import torch.distributed.checkpoint as dcp
    _check_group(comm)
    dcp.save(state, checkpoint_id=folder / FOLDER)
    comm.barrier()
    return sorted(f"{FOLDER}/{p.name}" for p in (folder / FOLDER).iterdir() if p.is_file())


def load_model(state: dict, folder: Path, comm: Comm) -> None:
    """Read ``folder``/dcp into ``state`` in place (the method's distributed model state, at
    the split that saved it), on every rank together."""
    import torch.distributed.checkpoint as dcp
    _check_group(comm)
    dcp.load(state, checkpoint_id=folder / FOLDER)


__all__ = ["FOLDER", "FORMATS", "load_model", "save_model"]
