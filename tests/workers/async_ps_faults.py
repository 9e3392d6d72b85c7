"""``lowcomm ...`` (the real CLI) with test-only faults for async-ps, set by environment:

* ``LOWCOMM_SLOW=rank:ms``: that rank sleeps ``ms`` milliseconds in every training forward pass
  (a deterministic straggler; it slows any method the same way, SyncDP included);
* ``LOWCOMM_KILL=rank:step``: that rank (a worker) SIGKILLs itself in the forward pass of its
  ``step``-th training step;
* ``LOWCOMM_KILL_SERVER=rank:updates``: that rank (a parameter server) SIGKILLs itself when it
  is about to apply its ``updates``-th update;
* ``LOWCOMM_FULL_METRICS=1``: once the run's folder is open, its ``metrics.jsonl`` is a link to
  ``/dev/full`` (every write fails with ENOSPC: the disk filled).
"""
import os
import signal
import time

from lowcomm.tasks import Task
from lowcomm.cli.main import launcher_rank, main

rank = launcher_rank()
slow = os.environ.get("LOWCOMM_SLOW", "-1:0").split(":")
kill = os.environ.get("LOWCOMM_KILL", "-1:0").split(":")
slow_ms = float(slow[1]) if int(slow[0]) == rank else 0.0
kill_step = int(kill[1]) if int(kill[0]) == rank else 0
real_loss, calls = Task.loss, [0]


def loss(self, model, batch):
    if model.training:
        calls[0] += 1
        if calls[0] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if slow_ms:
            time.sleep(slow_ms / 1000)
    return real_loss(self, model, batch)


Task.loss = loss        # every task's loss, as the loop calls it

if os.environ.get("LOWCOMM_KILL_SERVER"):
    kill_rank, updates = map(int, os.environ["LOWCOMM_KILL_SERVER"].split(":"))
    if kill_rank == rank:
        from lowcomm.strategies.ps.server import ParameterServer
        real_step = ParameterServer._step

        def _step(self, grad, lr_scale):
            if self.version + 1 == updates:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(self, grad, lr_scale)

        ParameterServer._step = _step

if os.environ.get("LOWCOMM_FULL_METRICS"):
    from pathlib import Path

    import lowcomm.run.loop as loop_module
    real_open_run = loop_module.open_run

    def open_run(cfg, comm, out, *args, **kwargs):
        ctl, folder, ckpt = real_open_run(cfg, comm, out, *args, **kwargs)
        if comm.rank == 0:
            (Path(folder) / "metrics.jsonl").symlink_to("/dev/full")
        return ctl, folder, ckpt

    loop_module.open_run = open_run

main()
