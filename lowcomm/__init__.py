"""lowcomm: decentralized, low-communication distributed training over MPI.

Importing lowcomm makes no MPI call; :func:`init` (or the first strategy) does. Every method is
a top-level name; :func:`build` makes any of them from the spec strings that policies use, and
:func:`train` runs the one training loop on your task.

Example (run with ``launchers/local.sh -n 4 python train.py``)::

    import lowcomm, torch
    opt = lowcomm.DiLoCo(model, torch.optim.AdamW(model.parameters()), period=50)
    opt = lowcomm.build("syncdp:algorithm=ring", model, optimizer, compressor="int8")
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.finish()                       # the same model (and buffers) on every rank

    lowcomm.train("my_task.py", strategy="diloco:period=50", steps=500, out="runs/mine")
"""
from .comm.collectives import ALGORITHMS, allreduce_
from .comm.comm import Comm, Request, init
from .errors import CommError, ConfigError, LowcommError
from .comm.ledger import Ledger

__version__ = "0.2.0"

# name -> module it lives in; loaded on first use (strategies pull in torch machinery)
_LAZY = {
    "SyncDP": "strategies.sync.syncdp", "LocalSGD": "strategies.outer.localsgd",
    "DiLoCo": "strategies.outer.diloco", "StreamingDiLoCo": "strategies.outer.diloco",
    "Gossip": "strategies.gossip.gossip", "AsyncPS": "strategies.ps.async_ps",
    "OneBitAdam": "strategies.optimizers.onebit_adam",
    "ZeroOneAdam": "strategies.optimizers.zeroone_adam", "DeMo": "strategies.optimizers.demo",
    "DisTrOSettings": "strategies.optimizers.demo", "SparseLoCo": "strategies.outer.sparseloco",
    "MuLoCoEFSettings": "strategies.outer.diloco",
    "EagerDiLoCoSettings": "strategies.outer.diloco", "DelayedNesterov": "strategies.outer.diloco",
    "DyLUDiLoCo": "strategies.outer.dylu", "AsyncDiLoCo": "strategies.outer.async_diloco",
    "Sparta": "strategies.outer.sparta", "SpartaDiLoCo": "strategies.outer.sparta",
    "DesLoc": "strategies.outer.desloc", "NoLoCo": "strategies.gossip.noloco",
    "ZeRO1": "strategies.sharded.zero", "ZeRO2": "strategies.sharded.zero",
    "FSDP": "strategies.sharded.fsdp", "MuonAdamW": "run.optimizers",
    "PipelineParallel": "parallel.pipeline", "Chain": "parallel.chains",
    "TensorParallel": "parallel.tensor", "Plan": "parallel.plans", "MoE": "parallel.experts",
    "MoESettings": "parallel.experts", "expert_parallel": "parallel.experts",
    "ExpertParallel": "parallel.ep",
    "HorovodDP": "strategies.sync.horovod", "Strategy": "strategies.base",
    "Method": "strategies.method", "adopt": "strategies.ownership", "Context": "strategies.method",
    "Settings": "settings", "average_buffers": "strategies.buffers",
    "broadcast_buffers": "strategies.buffers", "Compressor": "compress", "Cast": "compress",
    "BlockQuant": "compress", "QSGD": "compress", "TopK": "compress", "RandomK": "compress",
    "ScaledSign": "compress", "SignMajorityVote": "compress", "PowerSGD": "compress",
    "ErrorFeedback": "compress", "CompressorSettings": "compress.settings",
    "build": "run.registry", "policy": "run.registry", "register": "run.registry",
    "STRATEGIES": "run.registry", "train": "run.api", "train_fleet": "tools.fleet_launch",
    "Task": "tasks", "load_task": "tasks", "dataset_batches": "tasks",
    "dataset_eval_batches": "tasks", "from_functions": "tasks", "RunOptions": "run.folder",
}

__all__ = ["ALGORITHMS", "Comm", "CommError", "ConfigError", "Ledger", "LowcommError", "Request",
           "allreduce_", "init", "__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
