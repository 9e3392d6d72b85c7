"""A method and a task from outside lowcomm, in one file nothing else names: importing it
registers ``toy-average`` through the public API (``lowcomm.register``), and as a task
(``--set task=tests/toy_method.py``) it is a tiny regression whose module registers the method
before the run's keys are checked. tests/test_registry.py checks that every list of methods
derived from the registry picks it up."""
from dataclasses import dataclass

import torch

import lowcomm


@dataclass
class ToyAverageSettings(lowcomm.Settings):
    period: int = 4                      # H: local steps between averagings

    def validate(self, prefix=""):
        self.at_least(prefix, "period", 1)


def build(s, model, optimizer, comm, ctx):
    """Local SGD under another name: the toy is its registration, not a new update."""
    return lowcomm.LocalSGD(model, optimizer, comm, period=s.period)


METHOD = lowcomm.register(lowcomm.Method(
    "toy-average", ToyAverageSettings, build, summary="a toy: average the parameters every H steps",
    python="toy_method.build", optimizer="adam", example="toy-average:period=2",
    compare=("strategy.period=5",), compare_name="toy"))


def model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def loss(m, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def batch(step, rank, world, cfg):
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True)
