"""The built-in byte LM (:mod:`lowcomm.tasks.bytelm`) for fleets of split models: each training
batch takes ``task.step_ms`` of wall-clock (short sleeps: no CPU) so that a run outlasts a
datacenter's relaunch, and datacenter ``crash_dc`` fails at step ``crash_step`` of its first
launch only. With ``marks`` (a folder), a relaunched incarnation leaves a file there once it has
built its model, and the other datacenters wait at step ``hold_step`` until it has (at most
``HOLD_S``): however long the relaunch takes on a busy machine, the run is not over before it
is back. The sleeps and the hold change no number: batches are the byte LM's."""
import os
import time
from pathlib import Path

from lowcomm.tasks import bytelm

DEFAULTS = {"step_ms": 40.0, "crash_dc": -1, "crash_step": 8, "marks": "", "hold_step": -1}
HOLD_S = 300.0
criterion, loss, eval_batches = bytelm.criterion, bytelm.loss, bytelm.eval_batches


def _opt(cfg, name):
    return cfg.task.options.get(name, DEFAULTS[name])


def _first_launch() -> bool:
    return os.environ.get("LOWCOMM_FLEET_INC", "0") == "0"


def model(cfg):
    if _opt(cfg, "marks") and not _first_launch():
        marks = Path(_opt(cfg, "marks"))
        marks.mkdir(parents=True, exist_ok=True)
        (marks / f"built{os.environ['LOWCOMM_FLEET_INC']}").write_text("")
    return bytelm.model(cfg)


def batch(step, rank, world, cfg):
    here = os.environ.get("LOWCOMM_FLEET_DC")
    if here == str(_opt(cfg, "crash_dc")) and _first_launch() and step >= int(_opt(cfg, "crash_step")):
        raise RuntimeError(f"this datacenter fails at step {step} (task.crash_dc)")
    if here != str(_opt(cfg, "crash_dc")) and step == int(_opt(cfg, "hold_step")):
        until = time.monotonic() + HOLD_S
        while not list(Path(_opt(cfg, "marks")).glob("built*")) and time.monotonic() < until:
            time.sleep(0.1)
    for _ in range(max(1, round(float(_opt(cfg, "step_ms")) / 20))):
        time.sleep(0.02)
    return bytelm.batch(step, rank, world, cfg)
