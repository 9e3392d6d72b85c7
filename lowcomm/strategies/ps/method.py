"""The ``async-ps`` method's settings and builder (the strategy: :mod:`.async_ps`)."""
from __future__ import annotations

from ...comm.comm import Comm
from ...errors import ConfigError
from ..method import Context, Method
from .protocol import AsyncPSSettings


def check_run(s: AsyncPSSettings, cfg, prefix: str) -> None:
    """Combinations with the run's keys."""
    if prefix != "strategy.":
        raise ConfigError(prefix.rstrip(".") or "spec", "async-ps cannot be a level of a per-level policy")
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
    return AsyncPS(model, optimizer, comm, settings=s, compressor=ctx.gradient_compressor(),
                   nonfinite="skip" if ctx.nonfinite == "skip" else "raise",
                   budget=ctx.steps * (comm.size - s.servers) if ctx.steps else None)


METHOD = Method("async-ps", AsyncPSSettings, build, "asynchronous parameter server: sharded, "
                "with a staleness bound", check=check_run, python="AsyncPS",
                example="async-ps:servers=1")
