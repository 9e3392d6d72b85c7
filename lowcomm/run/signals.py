"""Stopping a run on request: SIGINT/SIGTERM/SIGHUP set a flag that the loop acts on at a step
boundary, and :class:`Interrupted` is how a stopped run ends (exit status 128 + signal).

Open MPI 4's mpirun, given a stop signal, sends its ranks SIGCONT, then SIGTERM
``odls_base_sigkill_timeout`` seconds later (default 1), then SIGKILL as long again after that
(measured here, 4.1.4): the ranks have that one grace to finish their step, agree on the stop
and write the final checkpoint. A launcher that passes stop signals to the ranks themselves
(launchers/local.sh, ``lowcomm train --np``'s supervisor, a fleet's datacenters) sets
``LOWCOMM_STOP_FORWARDED=1``; under a bare mpirun :class:`GraceCheck` warns once when the
run's steps are too slow for mpirun's grace."""
from __future__ import annotations

import logging
import math
import os
import signal
import time
import threading
from pathlib import Path

from ..errors import LowcommError
from . import outcome

log = logging.getLogger("lowcomm.train")


class Interrupted(LowcommError):
    """The run was stopped by a signal after writing a final checkpoint."""

    def __init__(self, signum: int, step: int, where: Path | None):
        self.signum, self.step, self.exit_code = signum, step, 128 + signum
        saved = f"checkpoint written to {where}" if where else "no checkpoint folder configured"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {saved}")


class StopSignals:
    """SIGINT/SIGTERM/SIGHUP call ``handler(signum, frame)`` inside the ``with`` (main thread
    only). SIGHUP (a closed terminal) is left alone where it is ignored (``nohup``)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, handler):
        self.handler = handler
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self.handler)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


class StopFlag(StopSignals):
    """SIGINT/SIGTERM/SIGHUP set a flag (main thread only); the loop acts on it at a step
    boundary."""

    def __init__(self):
        super().__init__(self._handle)
        self.signum = 0

    def _handle(self, signum, frame):
        if self.signum:             # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum
        outcome.stop_signal(signum)
        log.warning("%s: stopping after this step and writing a checkpoint (send it again to "
                    "stop at once)", signal.Signals(signum).name)


#: set (to 1) by a launcher that passes stop signals to the ranks themselves, not to mpirun
FORWARDED = "LOWCOMM_STOP_FORWARDED"
#: Open MPI 4's (ORTE's) seconds between the SIGTERM mpirun passes on and its SIGKILL
SIGKILL_TIMEOUT = "OMPI_MCA_odls_base_sigkill_timeout"


def mpirun_grace(env=os.environ) -> float | None:
    """Seconds a stop signal given to Open MPI 4's mpirun leaves the ranks before its SIGKILL
    (``--mca odls_base_sigkill_timeout``, passed to the ranks in the environment; default 1);
    None where a stop does not go through it (not launched by ORTE's mpirun, launched by a
    launcher that sets :data:`FORWARDED`, or a fleet's datacenter, which its coordinator stops)."""
    if env.get(FORWARDED) == "1" or "OMPI_MCA_orte_hnp_uri" not in env or "LOWCOMM_FLEET" in env:
        return None
    try:
        return float(env.get(SIGKILL_TIMEOUT, "1"))
    except ValueError:
        return None


class GraceCheck:
    """Warns once when a stop by a signal to mpirun would not end before mpirun's SIGKILL: the
    stop takes up to ``lag + 1`` steps (the stop vote) plus the checkpoint, at the step time
    measured over the steps after the first ``warmup``. Names the fix."""

    def __init__(self, lag: int, warn: bool, grace: float | None = None, warmup: int = 2,
                 measure: int = 3):
        self.grace = mpirun_grace() if grace is None else grace
        self.lag, self.warmup, self.measure = lag, warmup, measure
        self.active = warn and self.grace is not None
        self.seen, self.t0 = 0, None
        self.warning: str | None = None

    def step_done(self) -> None:
        """Call after every step."""
        if not self.active:
            return
        self.seen += 1
        if self.seen == self.warmup:
            self.t0 = time.monotonic()
        elif self.seen == self.warmup + self.measure:
            self.active = False
            step_s = (time.monotonic() - self.t0) / self.measure
            needed = (self.lag + 1) * step_s
            if needed >= self.grace:
                suggest = 10 * math.ceil((2 * needed + 10) / 10)
                self.warning = (
                    f"a stop (Ctrl-C/SIGTERM to mpirun) takes up to {self.lag + 1} steps of "
                    f"{step_s:.2f} s plus the checkpoint, but Open MPI's mpirun SIGKILLs the "
                    f"ranks {self.grace:g} s after passing the signal on "
                    f"(odls_base_sigkill_timeout): the final checkpoint would be lost. Launch with "
                    f"launchers/local.sh or 'lowcomm train --np N' (they pass the signal to the "
                    f"ranks), signal the ranks rather than mpirun, or add "
                    f"'--mca odls_base_sigkill_timeout {suggest}' to mpirun (the ranks then hear "
                    f"the signal {suggest} s late, and a crashed job takes twice that to end)")
                log.warning("%s", self.warning)
