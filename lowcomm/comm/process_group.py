"""torch.distributed's default process group over the ranks of a lowcomm :class:`~lowcomm.comm.comm.Comm`.

Engines that live in torch.distributed (FSDP2's ``fully_shard``, ``torch.distributed.checkpoint``,
DTensor) talk over a process group, not over MPI. :func:`default_group` makes one from the MPI
job lowcomm already runs, without torchrun's environment: rank and size are the Comm's, and the
rendezvous is a ``TCPStore`` whose master rank 0 of the Comm starts on a port the OS picks and
whose address (host, port) it broadcasts through the Comm (the same store torchelastic and the
fleet's coordinator use, :mod:`lowcomm.run.fleet.channel`). Gloo carries CPU tensors; on CUDA the
group is ``cuda:nccl,cpu:gloo`` (NCCL for the model's tensors, gloo for the CPU objects that
torch.distributed.checkpoint exchanges).

A process has one default group. The first call makes it over the Comm's ranks; a later call
over the same ranks (and backend) returns it on every rank; a call over other ranks replaces it
(on every rank of the call together) once nothing that holds it (``holder``, e.g. an FSDP
method not yet finished) is alive, and is an error naming both sets of ranks while something is (e.g. FSDP on a datacenter's ranks and on the whole
world at once in one process).
A default group made by someone else (torchrun, accelerate) is used when its rank and size are
the Comm's and its members are the Comm's world ranks (checked once, collectively).
"""
from __future__ import annotations

import datetime
import os
import socket
import weakref

import torch

from ..errors import CommError
from .comm import Comm, world_rank

_MADE: dict = {}       # the group this module made: {"members", "backend", "store"}
_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()     # what still uses it (see release)


def _host() -> str:
    """The address the other ranks reach rank 0's store at: ``$MASTER_ADDR`` where set, else
    this host's resolved name (loopback when it does not resolve: a one-machine job)."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _store(comm: Comm, members: tuple, timeout: datetime.timedelta):
    """The rendezvous: rank 0 starts a TCPStore on a free port and broadcasts its address."""
    from torch.distributed import PrefixStore, TCPStore
    master = None
    if comm.rank == 0:
        try:
            master = TCPStore("0.0.0.0", 0, comm.size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
            address = (_host(), master.port, None)
        except RuntimeError as e:
            address = (None, None, str(e).splitlines()[0][:200])
    else:
        address = None
    host, port, problem = comm.bcast_object(address)
    if problem:
        raise CommError("process_group", comm.rank, f"rank 0 could not start the TCPStore of "
                        f"the torch.distributed group: {problem}")
    store = master if master is not None else TCPStore(host, port, comm.size, is_master=False,
                                                       timeout=timeout, wait_for_workers=False)
    return PrefixStore("lowcomm/" + "-".join(map(str, members)), store), store


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for tensors on ``device``."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def default_group(comm: Comm, device: torch.device, timeout_s: float = 300.0, holder=None):
    """torch.distributed's default process group over ``comm``'s ranks (collective over
    ``comm``; module docstring): made on first use, reused after. ``holder`` (weakly kept)
    uses it until :func:`release` or its end. The ranks decide together: the group is reused
    only where every rank can reuse its own, else every rank makes a new one. Returns it."""
    import torch.distributed as dist
    backend = backend_for(device)
    members = tuple(comm.allgather_object(world_rank()))
    states = comm.allgather_object(_standing(comm, members, backend))
    bad = [(r, s) for r, s in enumerate(states) if s not in ("reuse", "new", "foreign")]
    if bad:
        raise CommError("process_group", comm.rank, f"rank {bad[0][0]}: {bad[0][1]}")
    if set(states) == {"foreign"}:
        _check_foreign(comm, members)
    elif set(states) != {"reuse"}:
        if "foreign" in states:
            foreign = [r for r, x in enumerate(states) if x == "foreign"]
            raise CommError("process_group", comm.rank, f"ranks {foreign} hold a "
                            "torch.distributed group lowcomm did not make, the others not")
        destroy_default_group()
        _make(comm, device, members, backend, timeout_s)
    if holder is not None:
        _HOLDERS.add(holder)
    return dist.group.WORLD


def _standing(comm: Comm, members: tuple, backend: str) -> str:
    """This rank's default group: "reuse" (lowcomm's over these ranks), "new" (none, or
    lowcomm's over other ranks that nothing holds), "foreign" (someone else's), or why it
    can be neither."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return "new"
    if not _MADE:
        return "foreign"
    if (_MADE["members"], _MADE["backend"]) == (members, backend):
        return "reuse"
    if not _HOLDERS:
        return "new"
    return (f"this process's torch.distributed group is lowcomm's over world ranks "
            f"{list(_MADE['members'])} ({_MADE['backend']}), still used by {len(_HOLDERS)} "
            f"unfinished object(s); one over world ranks {list(members)} ({backend}) was asked "
            "for: a process holds one default group (finish the first)")


def _make(comm: Comm, device: torch.device, members: tuple, backend: str, timeout_s: float):
    import torch.distributed as dist
    if device.type == "cuda":
        _one_gpu_each(comm, device)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed, store = _store(comm, members, timeout)
    try:
        dist.init_process_group(backend, store=prefixed, rank=comm.rank, world_size=comm.size,
                                timeout=timeout)
    except (RuntimeError, ValueError) as e:
        raise CommError("process_group", comm.rank, f"torch.distributed.init_process_group"
                        f"({backend!r}) over world ranks {list(members)}: "
                        f"{str(e).splitlines()[0][:300]}") from None
    _MADE.update(members=members, backend=backend, store=store)


def release(holder) -> None:
    """``holder`` no longer uses the default group (a later call may replace it)."""
    _HOLDERS.discard(holder)


def _one_gpu_each(comm: Comm, device: torch.device) -> None:
    """NCCL refuses two ranks of one group on one GPU: say so before it does, naming them."""
    where = comm.allgather_object((socket.gethostname(), torch.device(device).index
                                   if device.index is not None else torch.cuda.current_device()))
    mine = [r for r, w in enumerate(where) if w == where[comm.rank]]
    if len(mine) > 1:
        raise CommError("process_group", comm.rank, f"NCCL needs one GPU per rank: ranks "
                        f"{mine} all use cuda:{where[comm.rank][1]} on {where[comm.rank][0]}; "
                        "launch at most one rank per GPU for fsdp on CUDA")


def _check_foreign(comm: Comm, members: tuple) -> None:
    """Someone else's default group (torchrun, accelerate) serves when it spans exactly the
    Comm's ranks, in its order (collective over that group)."""
    import torch.distributed as dist
    if dist.get_world_size() != comm.size or dist.get_rank() != comm.rank:
        raise CommError("process_group", comm.rank, f"torch.distributed is initialised already "
                        f"(rank {dist.get_rank()} of {dist.get_world_size()}), not over this "
                        f"Comm's {comm.size} ranks (world ranks {list(members)})")
    seen = [None] * comm.size
    dist.all_gather_object(seen, world_rank())
    if tuple(seen) != members:
        raise CommError("process_group", comm.rank, f"torch.distributed's default group holds "
                        f"world ranks {seen}, this Comm {list(members)}")


def destroy_default_group() -> None:
    """Destroy the default group this module made (no-op otherwise), e.g. between runs in
    one process over different ranks."""
    import torch.distributed as dist
    if _MADE and dist.is_initialized():
        dist.destroy_process_group()
    _MADE.clear()
    _HOLDERS.clear()


__all__ = ["backend_for", "default_group", "destroy_default_group", "release"]
