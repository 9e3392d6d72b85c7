"""A task for the fleet's tests: noisy linear regression (a fixed teacher), whose steps take
``task.step_ms`` of wall-clock (short sleeps: no CPU, held up while the process is stopped) so that a run lasts long enough for a
datacenter to die, be relaunched and heal back, while the machine's cores stay free.
Options: ``step_ms`` (40), ``dim`` (16), and a datacenter that keeps failing: ``crash_dc``
fails at step ``crash_step`` of its first launch and while building the model in every
relaunch (-1: none). With ``marks`` (a folder) each of its failures leaves a file there, and
the other datacenters wait at step ``hold_step`` until ``hold_for`` failures are marked (at
most ``HOLD_S``): however long a relaunch takes on a busy machine, the run is not over before
the failing datacenter has failed that often. Batches are a pure function of the step and rank."""
import os
import time
from pathlib import Path

import torch

DEFAULTS = {"step_ms": 40.0, "dim": 16, "crash_dc": -1, "crash_step": 10, "marks": "",
            "hold_step": -1, "hold_for": 0}
#: the longest the other datacenters wait for the failures (then they go on, and the test says
#: what is missing)
HOLD_S = 300.0


def _crashing(cfg) -> bool:
    return str(_opt(cfg, "crash_dc")) == os.environ.get("LOWCOMM_FLEET_DC")


def _opt(cfg, name):
    return cfg.task.options.get(name, DEFAULTS[name])


def _fail(cfg, why: str) -> RuntimeError:
    """The failure of the crashing datacenter, marked in ``marks`` (one file an incarnation)."""
    if _opt(cfg, "marks"):
        marks = Path(_opt(cfg, "marks"))
        marks.mkdir(parents=True, exist_ok=True)
        (marks / f"inc{os.environ.get('LOWCOMM_FLEET_INC', '0')}").write_text(why)
    return RuntimeError(why)


def _hold(cfg) -> None:
    """Wait (a healthy datacenter, at ``hold_step``) until ``hold_for`` failures are marked."""
    marks, until = Path(_opt(cfg, "marks")), time.monotonic() + HOLD_S
    while len(list(marks.glob("inc*"))) < int(_opt(cfg, "hold_for")) and time.monotonic() < until:
        time.sleep(0.1)


def _teacher(dim: int) -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, dim, dtype=torch.float32).unsqueeze(1)


def model(cfg):
    if _crashing(cfg) and os.environ.get("LOWCOMM_FLEET_INC", "0") != "0":
        raise _fail(cfg, "this datacenter keeps failing (task.crash_dc)")
    dim = int(_opt(cfg, "dim"))
    m = torch.nn.Sequential(torch.nn.Linear(dim, 8), torch.nn.Linear(8, 1))
    m.step_ms = float(_opt(cfg, "step_ms"))        # loss() sleeps this long per training step
    return m


def _draw(seed: int, n: int, dim: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ _teacher(dim) + 0.3 * torch.randn(n, 1, generator=g)     # noisy labels: floor 0.09
    return x, y


def batch(step, rank, world, cfg):
    if _crashing(cfg) and step >= int(_opt(cfg, "crash_step")):
        raise _fail(cfg, f"this datacenter fails at step {step} (task.crash_dc)")
    if not _crashing(cfg) and step == int(_opt(cfg, "hold_step")) and _opt(cfg, "marks"):
        _hold(cfg)
    return _draw(1_000_003 * step + rank, cfg.batch_size, int(_opt(cfg, "dim")))


def _work(seconds: float, chunk: float = 0.02) -> None:
    """Sleep ``seconds`` in chunks of ``chunk``: like computation, it is held up while the
    process is stopped (``lowcomm fault slow``), where one long sleep would run out meanwhile."""
    for _ in range(max(1, round(seconds / chunk))):
        time.sleep(seconds / max(1, round(seconds / chunk)))


def loss(model, batch):
    x, y = batch
    if model.training:
        _work(model.step_ms / 1000)
    return torch.nn.functional.mse_loss(model(x), y)


def eval_batches(cfg):
    return [_draw(-1 - i, 64, int(_opt(cfg, "dim"))) for i in range(cfg.eval_batches)]
