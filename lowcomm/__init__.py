"""lowcomm: decentralized, low-communication distributed training over MPI.

Importing lowcomm makes no MPI call; :func:`init` does.

Example (run with ``launchers/local.sh -n 4 python train.py``)::

    import lowcomm, torch
    comm = lowcomm.init()
    opt = lowcomm.SyncDP(model, torch.optim.AdamW(model.parameters()), comm=comm)
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
"""
from .collectives import ALGORITHMS, allreduce_
from .comm import Comm, Request, init
from .errors import CommError, ConfigError, LowcommError
from .ledger import Ledger

__version__ = "0.1.0"

__all__ = ["ALGORITHMS", "Comm", "CommError", "ConfigError", "Ledger", "LowcommError", "Request",
           "SyncDP", "allreduce_", "init", "__version__"]


def __getattr__(name):  # SyncDP pulls in the strategies; load it on first use
    if name == "SyncDP":
        from .strategies.syncdp import SyncDP
        return SyncDP
    raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
