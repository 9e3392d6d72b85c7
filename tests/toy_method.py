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


class ToyAverage(lowcomm.Strategy):
    """Average the parameters every ``period`` steps (Local SGD, Stich 2019, arXiv 1805.09767)."""
    name = "toy-average"

    def __init__(self, model, optimizer, comm=None, period=4):
        super().__init__(model, optimizer, comm)
        self.period, self.t = period, 0

    def _step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.t += 1
        if self.t % self.period == 0:
            self._finish()
        return loss

    @torch.no_grad()
    def _finish(self):
        for p in self.model.parameters():
            self.comm.allreduce_(p.data, op="avg")


METHOD = lowcomm.register(lowcomm.Method(
    "toy-average", ToyAverageSettings, summary="a toy: average the parameters every H steps",
    build=lambda s, model, optimizer, comm, ctx: ToyAverage(model, optimizer, comm, s.period),
    python="ToyAverage", optimizer="adam", example="toy-average:period=2",
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
