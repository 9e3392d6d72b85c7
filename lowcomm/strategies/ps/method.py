"""The ``async-ps`` method's settings and builder (the strategy: :mod:`.async_ps`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...comm.comm import Comm
from ...errors import ConfigError
from ...settings import Settings
from ..base import Context, Method


@dataclass
class AsyncPSSettings(Settings):
    """``[strategy]`` keys of ``async-ps`` (whether ``servers`` fits the rank count: at start)."""
    servers: int = 1               # S: ranks 0..S-1 serve parameter shards, the rest train
    max_staleness: int = -1        # τ: -1 fully asynchronous, 0 synchronous, > 0 SSP
    staleness_lr: bool = False     # lr / staleness (Zhang et al. 2016)
    dc_lambda: float = 0.0         # DC-ASGD's λ (Zheng et al. 2017); 0 = off
    worker_timeout_s: float = 30.0  # a worker silent this long (owed nothing) is lost
    server_timeout_s: float = 10.0  # a server silent this long (owing a reply) ends the job
    overlap: bool = True           # push full shards from inside the backward pass
    backward_passes_per_step: int = 1   # gradient accumulation: push after every N-th backward

    def validate(self, prefix: str = "") -> None:
        self.at_least(prefix, "servers", 1)
        if self.max_staleness < -1:
            raise ConfigError(prefix + "max_staleness", f"must be >= -1 (-1 = fully asynchronous), "
                              f"got {self.max_staleness}")
        self.at_least(prefix, "dc_lambda", 0)
        self.within(prefix, "worker_timeout_s", 0, float("inf"), low_open=True)
        self.within(prefix, "server_timeout_s", 0, float("inf"), low_open=True)
        self.at_least(prefix, "backward_passes_per_step", 1)


def check_run(s: AsyncPSSettings, cfg, prefix: str) -> None:
    """Combinations with the run's keys."""
    if prefix != "strategy.":
        raise ConfigError(prefix.rstrip("."), "async-ps cannot be a level of a per-level policy")
    if cfg.checkpoint.every and s.max_staleness != 0:
        raise ConfigError("checkpoint.every", "async-ps checkpoints every N steps only with "
                          "strategy.max_staleness = 0 (synchronous): asynchronous servers and "
                          "workers never pass a common step whose state could be saved (at any "
                          "max_staleness, SIGINT/SIGTERM stops the run with a final checkpoint)")
    if cfg.eval_every and s.servers != 1:
        raise ConfigError("eval_every", "async-ps evaluates during the run only with "
                          "strategy.servers = 1 (rank 0 then holds the whole model); use 0 to "
                          "evaluate at the end")


def build(s: AsyncPSSettings, model, optimizer, comm: Comm, ctx: Context):
    from ..async_ps import AsyncPS
    return AsyncPS(model, optimizer, comm, servers=s.servers, max_staleness=s.max_staleness,
                   staleness_lr=s.staleness_lr, dc_lambda=s.dc_lambda,
                   compressor=ctx.gradient_compressor(), worker_timeout_s=s.worker_timeout_s,
                   server_timeout_s=s.server_timeout_s, overlap=s.overlap,
                   nonfinite="skip" if ctx.nonfinite == "skip" else "raise",
                   backward_passes_per_step=s.backward_passes_per_step,
                   budget=ctx.steps * (comm.size - s.servers) if ctx.steps else None)


METHOD = Method("async-ps", AsyncPSSettings, build, "asynchronous parameter server: sharded, "
                "with a staleness bound", check=check_run)
