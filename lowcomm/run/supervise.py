"""Runs that need no person: relaunch a failed training job from its newest intact checkpoint.

:func:`supervise` runs ``LAUNCH lowcomm train ARGS --out OUT`` (``LAUNCH`` is an mpirun
prefix); when the job fails — a rank killed, a watchdog abort, a lost link — it waits a short
backoff and relaunches with ``--resume OUT`` (from the checkpoint folder it is given:
``checkpoint.dir`` or ``OUT/checkpoints``), up to ``max_restarts`` times. Without a checkpoint
yet, the relaunch starts again from step 0 in the folder of its own earlier attempt: every
attempt carries the supervisor's run id (``--run-id``), and a run may replace only a folder
marked with its own id (:mod:`lowcomm.run.folder`); the supervisor never adds ``--overwrite``.

The job's ranks say how it ended (:mod:`lowcomm.run.outcome`, through ``--report-dir``);
mpirun's exit status alone is never taken for a reason. Not restarted:

* a stop the user asked for: SIGINT/SIGTERM/SIGHUP to the job (to mpirun or a rank; the ranks
  report it), or to the supervisor (it forwards SIGINT/SIGTERM, and SIGTERM for SIGHUP, waits
  for the job's final checkpoint and ends; during a backoff it ends at once);
* a failure that a relaunch would meet again: a bad config or task, a checkpoint that cannot
  continue the run, a run folder it may not use (another run's, locked by a live run,
  unwritable). The supervisor ends at once with that error.

The job dies with its supervisor: it is started in its own process group with Linux's
parent-death signal set to SIGTERM, so a supervisor killed even by SIGKILL stops its job (which
writes its final checkpoint) instead of leaving it training unsupervised.

On success ``restarts``, each failure's exit status, cause and rank count, and the rank count
of every attempt (``ranks_per_attempt``) are added to the run's summary.json.

Shrinking (``min_ranks``): when a *relaunch* on n ranks fails too (a rank that cannot come
back: its node is gone, its launch keeps failing), the next attempt runs on n − 1 ranks, down to
``min_ranks``, resuming the n-rank checkpoint on fewer ranks by each method's merge rule
(:meth:`lowcomm.strategies.capabilities.Capabilities.reshard`). The first failure on a rank count is always
retried on the same count (most failures are transient).

Since a task's batches are a pure function of the step and checkpoints hold every RNG, the
final parameters of a restarted run equal an uninterrupted run's, bit for bit, as long as the
rank count did not change.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RunFolderError
from . import outcome
from .signals import FORWARDED as STOP_FORWARDED
from .checkpoint import checkpoint_steps
from .folder import json_text, new_run_id, write_text

log = logging.getLogger("lowcomm.run.supervise")


def cause(stderr_text: str, returncode: int) -> str:
    """One line on why a job failed, from its stderr: lowcomm's own one-line errors first
    (``lowcomm failed: ...``, a usage error's ``Error: ...``, the watchdog's ``waited ...``),
    else mpirun's note of a killed process, else the exit status (and the last line that is not
    a rule of dashes); followed by what Open MPI warned of on the way (its first
    help message other than the abort itself: e.g. a TCP connection to a peer that failed,
    which is why a rank waited until the watchdog fired)."""
    lines = [ln.strip() for ln in stderr_text.splitlines()
             if ln.strip() and not (len(ln.strip()) >= 20 and set(ln.strip()) == {"-"})]
    usage = [ln for ln in stderr_text.splitlines() if ln.startswith("Error: ")]   # click's
    ours = [ln for ln in lines if "lowcomm failed" in ln] or usage
    why = ours[0].strip()[:400] if ours else None
    for key in ("watchdog", "CommError", "exited on signal", "killed"):
        hit = [ln for ln in lines if key in ln]
        if why is None and hit:
            why = hit[0][:400]
    if why is None:
        if returncode < 0:
            why = f"killed by {signal.Signals(-returncode).name}"
        else:
            why = f"exit status {returncode}" + (f": {lines[-1][:300]}" if lines else "")
    said = mpi_warning(stderr_text)
    return f"{why} (Open MPI said: {said})" if said else why


#: Open MPI help messages that report the end of a job rather than a cause of it
_MPI_CONSEQUENCES = ("MPI_ABORT was invoked", "exited on signal", "has exited due to",
                     "Primary job", "terminated", "killed")


def mpi_warning(stderr_text: str) -> str | None:
    """The first of Open MPI's help messages (the text between its rules of dashes) that is
    not about the job ending, on one line: its first paragraph and its ``Key: value`` lines."""
    blocks, cur = [], None
    for ln in (raw.strip() for raw in stderr_text.splitlines()):
        if len(ln) >= 20 and set(ln) == {"-"}:      # a rule opens a message or closes one
            if cur is not None:
                blocks.append(cur)
            cur = [] if cur is None else None
        elif cur is not None:
            cur.append(ln)
    for b in blocks:
        if not any(k in " ".join(b) for k in _MPI_CONSEQUENCES):
            head = b[:b.index("")] if "" in b else b[:1]
            keyed = [" ".join(ln.split()) for ln in b[len(head):]
                     if ":" in ln and ln.split(":", 1)[0].replace(" ", "").isalpha()]
            return " ".join(" ".join(head + keyed).split())[:400] or None
    return None


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` (a checkpoint folder) holds a checkpoint to resume from."""
    return bool(checkpoint_steps(Path(folder)))


@dataclass(frozen=True)
class Attempts:
    """How a supervised job's attempts run: each for at most ``timeout_s`` seconds (None: no
    limit), relaunched up to ``max_restarts`` times, ``backoff_s``·2^k seconds before the k-th,
    from the newest checkpoint in ``checkpoints`` (None: ``out/checkpoints``); with a launch
    function of the rank count, on ``np`` ranks first, down to ``min_ranks`` when relaunches
    fail (see the module's notes)."""
    max_restarts: int = 0
    backoff_s: float = 2.0
    timeout_s: float | None = None
    np: int | None = None
    min_ranks: int | None = None
    checkpoints: str | Path | None = None


def supervise(launch, args: list[str], out: str | Path, attempts: Attempts = Attempts(), *,
              env: dict | None = None, poll=None, first: list[str] = ()) -> dict:
    """Run ``launch + args`` (``args`` is ``lowcomm train ...`` without ``--out``/``--resume``),
    its attempts as ``attempts`` says (relaunched from the newest checkpoint on failure); returns
    ``{"returncode", "restarts", "failures", "ranks_per_attempt", "stopped", "repeats"}``
    (``stopped``: the signal's name when a stop was asked for, also of a job that finished
    meanwhile; ``repeats``: the last failure would repeat). ``launch`` is a command prefix, or
    a function of the rank count giving one (with ``attempts.np``). ``first``: the first
    attempt's own options (the user's ``--resume OUT`` or ``--overwrite``). Each attempt's
    stdout/stderr is appended in ``out``; ``poll()`` is called about twice a second while a job
    runs."""
    return _Supervisor(launch, args, out, attempts, env, poll, first).run()


class _Supervisor:
    """One :func:`supervise` call: its attempts, their failures, and the stop signals it
    forwards to the job."""

    def __init__(self, launch, args, out, attempts: Attempts, env, poll, first):
        a = attempts
        self.out = Path(out)
        self.ck = Path(a.checkpoints) if a.checkpoints else self.out / "checkpoints"
        self.launch_for, self.min_ranks = self._launcher(launch, a.np, a.min_ranks)
        self.args, self.max_restarts, self.backoff_s, self.env = args, a.max_restarts, a.backoff_s, env
        self.timeout_s, self.poll, self.first = a.timeout_s, poll, first
        self.n = a.np
        self.ranks: list = []
        self.logs = self.out
        self.reports = self.logs / ".lowcomm-reports"
        try:
            self.reports.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunFolderError(f"cannot write the job's logs into {self.logs}: {e.strerror or e}") from e
        self.run_id = new_run_id()
        self.failures: list[dict] = []
        self.stop = {"signum": 0, "sent": 0.0}
        self.child = None
        self.attempt = 0
        self.t0 = 0.0

    @staticmethod
    def _launcher(launch, np, min_ranks):
        """(the command prefix as a function of the rank count, the smallest rank count)."""
        if callable(launch):
            if np is None:
                raise ValueError("supervise: a launch function needs np, the first rank count")
            min_ranks = np if min_ranks is None else min_ranks
            if not 1 <= min_ranks <= np:
                raise ValueError(f"min_ranks must be in [1, np={np}], got {min_ranks}")
            return launch, min_ranks
        if min_ranks is not None:
            raise ValueError("supervise: min_ranks needs a launch function of the rank count")
        return (lambda n, prefix=list(launch): prefix), min_ranks

    # signals ----------------------------------------------------------------------------------
    def forward(self, signum, frame) -> None:
        """Pass a stop signal on to the job's ranks themselves: mpirun, given it, kills its
        ranks a second later (SIGTERM, then SIGKILL), before a step of more than a quarter
        second reaches the stop's checkpoint; it ends by itself once the ranks have stopped.
        Until the ranks are up, the job's process group gets it."""
        self.stop.update(signum=signum, sent=time.monotonic())
        if self.child is not None and self.child.poll() is None:
            sig = signal.SIGTERM if signum == signal.SIGHUP else signum
            ranks = mpi_ranks(self.child.pid)
            for pid in ranks:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if not ranks:
                os.killpg(self.child.pid, sig)

    def forward_again(self) -> None:
        """mpirun drops a signal that comes while it starts the ranks: until a rank reports the
        stop, pass it on again every few seconds (a rank that got it has reported it, so none
        gets it twice, which would mean "stop at once")."""
        if self.stop["signum"] and time.monotonic() - self.stop["sent"] > RESEND_S and \
                not outcome.read(self.reports)["signalled"]:
            self.forward(self.stop["signum"], None)

    def _handle_signals(self) -> dict:
        """Install :meth:`forward` (in the main thread only); the handlers it replaced."""
        if not _main_thread():
            return {}
        return {s: signal.signal(s, self.forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN}

    # attempts ---------------------------------------------------------------------------------
    def result(self, rc: int, **extra) -> dict:
        return {"returncode": rc, "restarts": self.attempt, "failures": self.failures,
                "ranks_per_attempt": self.ranks, "stopped": None, "repeats": False, **extra}

    def command(self) -> list[str]:
        """This attempt's command line."""
        extra = ["--out", str(self.out), "--run-id", self.run_id, "--report-dir", str(self.reports)]
        if self.attempt == 0:
            extra += list(self.first)
        elif has_checkpoint(self.ck):
            extra += ["--resume", str(self.out)]
        # else: from step 0 again, in the folder its own earlier attempt marked (--run-id)
        return [*self.launch_for(self.n), *self.args, *extra]

    def launch(self, cmd: list[str]) -> tuple[subprocess.Popen, int, bool]:
        """Run one attempt to its end: (the process, where its stderr begins in stderr.log,
        whether it ran out of time and was killed)."""
        self.ranks.append(self.n)
        for p in self.reports.glob("rank*"):
            p.unlink()
        try:
            so, se = open(self.logs / "stdout.log", "a"), open(self.logs / "stderr.log", "a")
        except OSError as e:
            raise RunFolderError(f"cannot write the job's logs into {self.logs}: "
                                 f"{e.strerror or e}") from e
        with so, se:
            se.write(f"--- attempt {self.attempt + 1}: {' '.join(cmd)}\n")
            se.flush()
            start = se.tell()
            p = subprocess.Popen(cmd, stdout=so, stderr=se, start_new_session=True,
                                 env={**(os.environ if self.env is None else self.env),
                                      STOP_FORWARDED: "1"},     # :meth:`forward` passes stops on
                                 preexec_fn=_dies_with(os.getpid()))
            self.child = p
            while p.poll() is None:
                time.sleep(0.5)
                self.forward_again()
                if self.poll is not None:
                    self.poll()
                if self.timeout_s is not None and time.monotonic() - self.t0 > self.timeout_s:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    return p, start, True
        return p, start, False

    def failed(self, rc: int, start: int) -> dict | None:
        """After a failed attempt: the result to return (a stop, a failure that would repeat,
        the restarts used up), or None once the backoff before the next attempt is over."""
        said = outcome.read(self.reports)
        with open(self.logs / "stderr.log") as se:
            se.seek(start)
            why = said["error"] or cause(se.read(), rc)
        stopped = signal.Signals(self.stop["signum"]).name if self.stop["signum"] else said["stop"]
        if stopped:
            why = f"stopped by {stopped}" + (f" ({why})" if said["error"] else "")
        self.failures.append({"attempt": self.attempt + 1, "exit": rc, "cause": why, "ranks": self.n})
        if stopped:
            log.warning("stopped on request (%s); not restarting", stopped)
            return self.result(128 + signal.Signals[stopped], stopped=stopped)
        if said["repeats"]:
            log.error("job failed (%s); not restarting: a relaunch would fail the same way", why)
            return self.result(rc, repeats=True)
        if self.attempt >= self.max_restarts:
            log.error("job failed (%s); %d restart(s) used, giving up", why, self.attempt)
            return self.result(rc)
        return self._back_off(why)

    def _back_off(self, why: str) -> dict | None:
        """Wait before the next attempt (on one rank fewer when a relaunch failed as well: a
        rank cannot come back); the result to return when a stop comes meanwhile."""
        if self.n is not None and self.attempt > 0 and self.ranks[-2] == self.n and self.n > self.min_ranks:
            self.n -= 1
        wait = self.backoff_s * 2 ** self.attempt
        log.warning("job failed (%s); restarting %s%s in %.0f s (%d of %d)", why,
                    "from the newest checkpoint" if has_checkpoint(self.ck) else "from step 0",
                    f" on {self.n} ranks" if self.n is not None else "", wait, self.attempt + 1,
                    self.max_restarts)
        if _sleep_unless_stopped(wait, self.stop):
            name = signal.Signals(self.stop["signum"]).name
            log.warning("stopped on request (%s) before the next attempt", name)
            return self.result(128 + self.stop["signum"], stopped=name)
        return None

    def _attempts(self) -> dict | None:
        """Attempts until one succeeds (None) or the supervisor gives up (its result)."""
        while True:
            p, start, timed_out = self.launch(self.command())
            if timed_out:
                self.failures.append({"attempt": self.attempt + 1, "exit": p.returncode,
                                      "cause": f"timed out after {self.timeout_s:g} s", "ranks": self.n})
                return self.result(p.returncode)
            if p.returncode == 0:
                return None
            ended = self.failed(p.returncode, start)
            if ended is not None:
                return ended
            self.attempt += 1

    def run(self) -> dict:
        old = self._handle_signals()
        self.t0 = time.monotonic()
        try:
            ended = self._attempts()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            shutil.rmtree(self.reports, ignore_errors=True)
        if ended is not None:
            return ended
        summary = self.out / "summary.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            s.update(restarts=self.attempt, failures=self.failures, ranks_per_attempt=self.ranks)
            write_text(summary, json_text(s))
        return self.result(0, stopped=signal.Signals(self.stop["signum"]).name if self.stop["signum"] else None)


#: seconds after which a stop signal that no rank reported is passed on to the job again
RESEND_S = 2.0


def _sleep_unless_stopped(seconds: float, stop: dict) -> bool:
    """Sleep ``seconds``; True (at once) when a stop signal came before or meanwhile."""
    end = time.monotonic() + seconds
    while not stop["signum"] and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    return bool(stop["signum"])


#: the variables that mark an MPI rank's process (Open MPI, MPICH/Hydra, PMIx)
RANK_VARIABLES = (b"OMPI_COMM_WORLD_RANK=", b"PMI_RANK=", b"PMIX_RANK=")


def mpi_ranks(pid: int) -> list[int]:
    """The MPI ranks among the descendants of ``pid`` (the processes whose environment names
    their rank; not mpirun nor a launcher script), from ``/proc``; [] where there is none."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    below, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - below
        below |= frontier
    ranks = []
    for c in sorted(below):
        try:
            env = (Path("/proc") / str(c) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(RANK_VARIABLES) for v in env):
            ranks.append(c)
    return ranks


#: prctl(2)'s PR_SET_PDEATHSIG (Linux)
_PR_SET_PDEATHSIG = 1


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _dies_with(parent: int):
    """``preexec_fn`` of the job: SIGTERM it when ``parent`` (the supervisor) dies, however it
    dies (Linux's parent-death signal; mpirun passes a SIGTERM on to the ranks, which stop)."""
    def set_up() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:             # it died before the signal was set
            os.kill(os.getpid(), signal.SIGTERM)
    return set_up


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
