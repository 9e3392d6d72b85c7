"""Runs that need no person: relaunch a failed training job from its newest intact checkpoint.

:func:`supervise` runs ``LAUNCH lowcomm train ARGS --out OUT`` (``LAUNCH`` is an mpirun
prefix); when the job fails — a rank killed, a watchdog abort, a lost link — it waits a short
backoff and relaunches with ``--resume OUT`` (``--overwrite`` when no checkpoint was written
yet), up to ``max_restarts`` times. A stop the user asked for is not restarted: a job that ends
on SIGINT/SIGTERM (status 128 + signal, after its final checkpoint), or a supervisor that is
itself sent SIGINT/SIGTERM (it forwards the signal to the job and waits for it). On success
``restarts``, each failure's exit status, cause and rank count, and the rank count of every
attempt (``ranks_per_attempt``) are added to the run's summary.json.

Shrinking (``min_ranks``): when a *relaunch* on n ranks fails too (a rank that cannot come
back: its node is gone, its launch keeps failing), the next attempt runs on n − 1 ranks, down to
``min_ranks``, resuming the n-rank checkpoint on fewer ranks by each method's merge rule
(:meth:`lowcomm.strategies.base.Strategy.reshard`). The first failure on a rank count is always
retried on the same count (most failures are transient).

Since a task's batches are a pure function of the step and checkpoints hold every RNG, the
final parameters of a restarted run equal an uninterrupted run's, bit for bit, as long as the
rank count did not change.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger("lowcomm.run.supervise")

#: exit statuses of a stop the user asked for (the job checkpointed and stopped on purpose)
USER_STOPS = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}


def cause(stderr_text: str, returncode: int) -> str:
    """One line on why a job failed, from its stderr: lowcomm's own one-line errors first
    (``lowcomm failed: ...``, the watchdog's ``waited ...``), else mpirun's note of a killed
    process, else the exit status; followed by what Open MPI warned of on the way (its first
    help message other than the abort itself: e.g. a TCP connection to a peer that failed,
    which is why a rank waited until the watchdog fired)."""
    lines = [ln.strip() for ln in stderr_text.splitlines() if ln.strip()]
    why = None
    for key in ("lowcomm failed", "watchdog", "CommError", "exited on signal", "killed"):
        hit = [ln for ln in lines if key in ln]
        if hit:
            why = hit[0][:400]
            break
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


def has_checkpoint(out: Path) -> bool:
    ck = out / "checkpoints"
    return ck.is_dir() and any(p.is_dir() and p.name.startswith("step-") for p in ck.iterdir())


def supervise(launch, args: list[str], out: str | Path, max_restarts: int,
              backoff_s: float = 2.0, env: dict | None = None, log_dir: str | Path | None = None,
              timeout_s: float | None = None, poll=None, first: list[str] = (),
              np: int | None = None, min_ranks: int | None = None) -> dict:
    """Run ``launch + args`` (``args`` is ``lowcomm train ...`` without ``--out``/``--resume``),
    relaunching from the newest checkpoint in ``out`` on failure; returns ``{"returncode",
    "restarts", "failures", "ranks_per_attempt"}``. ``launch`` is a command prefix, or a
    function of the rank count giving one (with ``np``, the first attempt's rank count, and
    ``min_ranks``: shrink down to it when relaunches fail, see the module's notes).
    ``log_dir``: append each attempt's stdout/stderr there (default ``out``). ``poll()`` is
    called about twice a second while a job runs."""
    out = Path(out)
    if callable(launch):
        if np is None:
            raise ValueError("supervise: a launch function needs np, the first rank count")
        min_ranks = np if min_ranks is None else min_ranks
        if not 1 <= min_ranks <= np:
            raise ValueError(f"min_ranks must be in [1, np={np}], got {min_ranks}")
        launch_for = launch
    else:
        if min_ranks is not None:
            raise ValueError("supervise: min_ranks needs a launch function of the rank count")
        launch_for = (lambda n, prefix=list(launch): prefix)
    n = np
    ranks: list = []
    logs = Path(log_dir) if log_dir else out
    logs.mkdir(parents=True, exist_ok=True)
    failures: list[dict] = []
    stop = {"signum": 0}
    child: dict = {}

    def forward(signum, frame):
        stop["signum"] = signum
        if child.get("p") is not None and child["p"].poll() is None:
            os.killpg(child["p"].pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if _main_thread() else {}
    t0 = time.monotonic()
    try:
        attempt = 0
        while True:
            extra = ["--out", str(out)]
            if attempt == 0:
                extra += list(first)
            else:
                extra += ["--resume", str(out)] if has_checkpoint(out) else ["--overwrite"]
            cmd = [*launch_for(n), *args, *extra]
            ranks.append(n)
            with open(logs / "stdout.log", "a") as so, open(logs / "stderr.log", "a") as se:
                se.write(f"--- attempt {attempt + 1}: {' '.join(cmd)}\n")
                se.flush()
                start = se.tell()
                p = subprocess.Popen(cmd, stdout=so, stderr=se, start_new_session=True, env=env)
                child["p"] = p
                while p.poll() is None:
                    time.sleep(0.5)
                    if poll is not None:
                        poll()
                    if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        failures.append({"attempt": attempt + 1, "exit": p.returncode,
                                         "cause": f"timed out after {timeout_s:g} s", "ranks": n})
                        return {"returncode": p.returncode, "restarts": attempt, "failures": failures,
                                "ranks_per_attempt": ranks}
            rc = p.returncode
            if rc == 0:
                break
            with open(logs / "stderr.log") as se:
                se.seek(start)
                why = cause(se.read(), rc)
            failures.append({"attempt": attempt + 1, "exit": rc, "cause": why, "ranks": n})
            if stop["signum"] or rc in USER_STOPS:
                log.warning("stopped on request (exit %d); not restarting", rc)
                return {"returncode": rc, "restarts": attempt, "failures": failures,
                        "ranks_per_attempt": ranks}
            if attempt >= max_restarts:
                log.error("job failed (%s); %d restart(s) used, giving up", why, attempt)
                return {"returncode": rc, "restarts": attempt, "failures": failures,
                        "ranks_per_attempt": ranks}
            if n is not None and attempt > 0 and ranks[-2] == n and n > min_ranks:
                n -= 1             # a relaunch on n failed as well: a rank cannot come back
            wait = backoff_s * 2 ** attempt
            log.warning("job failed (%s); restarting %s%s in %.0f s (%d of %d)", why,
                        "from the newest checkpoint" if has_checkpoint(out) else "from step 0",
                        f" on {n} ranks" if n is not None else "", wait, attempt + 1, max_restarts)
            time.sleep(wait)
            attempt += 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    summary = out / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        s.update(restarts=attempt, failures=failures, ranks_per_attempt=ranks)
        summary.write_text(json.dumps(s, indent=2) + "\n")
    return {"returncode": 0, "restarts": attempt, "failures": failures, "ranks_per_attempt": ranks}


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
