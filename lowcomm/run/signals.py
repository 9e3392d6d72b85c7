"""Stopping a run on request: SIGINT/SIGTERM/SIGHUP set a flag that the loop acts on at a step
boundary, and :class:`Interrupted` is how a stopped run ends (exit status 128 + signal)."""
from __future__ import annotations

import logging
import signal
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
