"""A task for the fleet's tests: noisy linear regression (a fixed teacher), whose steps take
``task.step_ms`` of wall-clock (a sleep: no CPU) so that a run lasts long enough for a
datacenter to die, be relaunched and heal back, while the machine's cores stay free.
Options: ``step_ms`` (40), ``dim`` (16). Batches are a pure function of the step and rank."""
import time

import torch

DEFAULTS = {"step_ms": 40.0, "dim": 16}


def _opt(cfg, name):
    return cfg.task.options.get(name, DEFAULTS[name])


def _teacher(dim: int) -> torch.Tensor:
    return torch.linspace(-1, 1, dim, dtype=torch.float32).unsqueeze(1)


def model(cfg):
    dim = int(_opt(cfg, "dim"))
    m = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    m.step_ms = float(_opt(cfg, "step_ms"))        # loss() sleeps this long per training step
    return m


def _draw(seed: int, n: int, dim: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ _teacher(dim) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def batch(step, rank, world, cfg):
    return _draw(1_000_003 * step + rank, cfg.batch_size, int(_opt(cfg, "dim")))


def loss(model, batch):
    x, y = batch
    if model.training:
        time.sleep(model.step_ms / 1000)
    return torch.nn.functional.mse_loss(model(x), y)


def eval_batches(cfg):
    return [_draw(-1 - i, 64, int(_opt(cfg, "dim"))) for i in range(cfg.eval_batches)]
