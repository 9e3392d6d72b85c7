"""A new method in one file: periodic model averaging (Local SGD, Stich 2019, arXiv 1805.09767).
Every rank steps on its own data; every ``period`` steps the ranks average their parameters."""
from dataclasses import dataclass

import torch

import lowcomm


@dataclass
class AverageEverySettings(lowcomm.Settings):
    period: int = 4                      # H: local steps between averagings

    def validate(self, prefix=""):
        self.at_least(prefix, "period", 1)


class AverageEvery(lowcomm.Strategy):
    name, Settings = "average-every", AverageEverySettings

    def __init__(self, model, optimizer, comm=None, **options):   # settings=, or period=8
        super().__init__(model, optimizer, comm, **options)     # resolves self.settings
        self.period, self.t = self.settings.period, 0
        lowcomm.comm.collectives.broadcast_(self.comm, list(model.state_dict().values()))

    def _step(self, closure=None):        # Strategy.step() calls it: the optimizer contract stays
        loss = self.optimizer.step(closure)
        self.t += 1
        if self.t % self.period == 0:
            self._finish()
        return loss

    @torch.no_grad()
    def _finish(self):                    # θ ← (1/K) Σ_k θ_k, so every rank ends with one model
        for p in self.model.parameters():
            self.comm.allreduce_(p.data, op="avg")
        lowcomm.average_buffers(self.comm, self.model)     # BatchNorm statistics too


METHOD = lowcomm.register(lowcomm.Method(
    "average-every", AverageEverySettings, summary="average the parameters every H steps",
    build=lambda s, model, optimizer, comm, ctx: AverageEvery(model, optimizer, comm, settings=s),
    example="average-every:period=3", compare=("strategy.period=10",)))
