"""What every integration shares: one process per rank under ``mpirun``, lowcomm's method doing
the communication, and each rank's own state in a checkpoint.

Under ``mpirun`` every rank runs the user's script; a framework that reads the launcher's
environment (accelerate reads Open MPI's ``OMPI_COMM_WORLD_SIZE``) would decide the job is
distributed and start ``torch.distributed`` itself ("MASTER_ADDR expected, but not set").
:func:`init` starts MPI and moves those variables out of sight (kept in :data:`LAUNCHER_ENV`), so
the framework runs as one process per rank; with CUDA each rank takes its node-local GPU.
Imports no framework."""
from __future__ import annotations

import os

import torch

from ..comm.comm import Comm, init as init_comm
from ..errors import LowcommError

#: the launcher's variables that make accelerate and torch.distributed see a multi-process job
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "PMI_RANK", "MV2_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE")
#: what :func:`init` moved out of ``os.environ``
LAUNCHER_ENV: dict[str, str] = {}


def init(comm: Comm | None = None) -> Comm:
    """Start MPI (or take ``comm``) and keep the framework to one process per rank; call it
    before the framework reads the environment (``TrainingArguments``, ``Accelerator``).
    Idempotent. Returns the world communicator."""
    comm = comm or init_comm()
    _refuse_distributed_state()
    for name in LAUNCHER_VARS:
        if name in os.environ:
            LAUNCHER_ENV[name] = os.environ.pop(name)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local = comm.split_shared().rank
        torch.cuda.set_device(local % torch.cuda.device_count())
    return comm


def _refuse_distributed_state() -> None:
    try:
        from accelerate.state import PartialState
    except ImportError:                   # no accelerate: nothing can have started
        return
    if PartialState._shared_state and PartialState().num_processes > 1:
        raise LowcommError("accelerate set up a multi-process job before lowcomm's init() ran: "
                           "call lowcomm.integrations.accelerate.init() (or build lowcomm's "
                           "Accelerator) before anything builds an accelerate state "
                           "(TrainingArguments, accelerate.Accelerator): lowcomm's method does "
                           "the communication")


def own_state_file(folder: str, comm: Comm) -> str:
    """The file in a checkpoint ``folder`` where this rank keeps its own model and method state
    (they differ between ranks under DiLoCo, gossip, error feedback)."""
    return os.path.join(folder, f"lowcomm-rank{comm.rank}-of-{comm.size}.pt")


def refuse_passing(method, where: str) -> None:
    """A method that passes over some steps on a slower member (``takes_step()``, dynamic local
    updates) needs a loop that asks it first; ``where``'s loop computes every step."""
    from ..strategies.base import Strategy
    if type(method).takes_step is not Strategy.takes_step:
        raise LowcommError(f"{where} does not run lowcomm's {method.name}: it passes over some "
                           "steps on a slower member (takes_step()), and this loop computes every "
                           "step; use lowcomm.train or your own loop, or diloco")


def clips_itself(method) -> bool:
    """Whether the method clips by a norm of its own (its ``clip_grad_norm_``: ZeRO's ranges, a
    pipeline's stages), where torch's over the model's parameters would see part of it."""
    return method.clips_itself()


def gathers_model(method) -> bool:
    """Whether each rank holds part of the model, which the method's own
    ``full_model_state_dict`` gathers (fsdp, a pipeline)."""
    from ..strategies.base import Strategy
    return type(method).full_model_state_dict is not Strategy.full_model_state_dict


def refuse_unsupported(method, where: str) -> None:
    """Methods an integration cannot drive yet, refused with what to use instead: the parameter
    server (its server ranks serve instead of training), the sharding methods (their model
    state and gradient norm are per shard) and those that pass over steps (:func:`refuse_passing`)."""
    from ..strategies.base import Role
    refuse_passing(method, where)
    if method.role is not Role.PLAIN:
        raise LowcommError(f"{where} does not run lowcomm's {method.name} (its server ranks serve "
                           "instead of training): use lowcomm.integrations.transformers.Trainer "
                           "or lowcomm's own loop (lowcomm.train)")
    if clips_itself(method) or gathers_model(method):
        raise LowcommError(f"{where} does not run lowcomm's {method.name} (it shards the model or "
                           "its gradients): use lowcomm.integrations.transformers.Trainer or "
                           "lowcomm's own loop (lowcomm.train)")
