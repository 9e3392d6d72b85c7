"""A fleet of datacenters that keeps going: one MPI job per datacenter, a coordinator between
them, and this supervisor, which relaunches a datacenter that fails so that it heals back in
live.

``lowcomm train --dcs D --np N ...`` (outside mpirun) runs :class:`Fleet`:

1. it starts the coordinator (:mod:`lowcomm.run.fleet.coordinator`: the ``TCPStore`` and the
   membership), where the caller says (on the emulated WAN: in datacenter 0's namespace);
2. it launches one job of N/D ranks per datacenter (``launch(dc, n)`` is the launch prefix:
   mpirun on that datacenter's hostfile, or in its emulated-WAN namespace), each ``lowcomm
   train`` in its own run folder ``OUT/dc<i>`` with the fleet's identity in its environment
   (:data:`lowcomm.run.fleet.plan.ENV`): inside a datacenter everything is as in one job
   (:mod:`lowcomm.run.fleet.member`), the outer level goes across through the coordinator's
   rounds (:mod:`lowcomm.run.fleet.channel`);
3. when a datacenter's job ends with a failure — any rank killed, its link down past the
   allowance (the coordinator fences it and this supervisor tears the job down) — it tells the
   coordinator at once (the others finish their round without it) and relaunches the job after
   ``fleet.backoff_s`` in ``OUT/dc<i>.<k>`` (incarnation k): the new job waits to be admitted at
   the next round boundary and takes the live state from a peer. A datacenter that failed more
   than ``fleet.max_failures`` times is left out and the run goes on without it;
4. if the coordinator itself dies (or gives up: no quorum), every job is ended and the fleet
   falls back to the checkpoint restart of one job: the newest step that ``min_dcs``
   datacenters hold a checkpoint of, those resumed from it, the others admitted live (up to
   ``max_restarts`` times);
5. at the end it writes ``OUT/summary.json`` and ``OUT/metrics.jsonl``
   (:mod:`lowcomm.run.fleet.report`): the membership of every round, every failure with its
   cause and detection time, every heal with its bytes and seconds, and what each datacenter
   ran.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ...errors import LowcommError
from .. import outcome
from ..checkpoint import checkpoint_steps
from ..folder import close_run, new_run_id, read_marker, run_id_of
from ..signals import StopSignals
from ..supervise import _dies_with, cause
from .folder import fleet_of, lock_key, mark
from .plan import FleetPlan
from .trust import fleet_secret, session_env

log = logging.getLogger("lowcomm.fleet")


#: how long a datacenter's job may take to exit after its member said it finished (its summary
#: and checkpoints written: only the processes' ends are left); then the fleet ends it
EXIT_GRACE_S = 60.0


class Placement(NamedTuple):
    """Where a fleet's jobs run (:mod:`lowcomm.tools.fleet_launch`): ``launch(dc, n)`` the command
    that starts datacenter ``dc``'s job of ``n`` ranks, ``coordinator`` the prefix of the
    coordinator's command, ``host`` the address the leaders reach it at, ``env(dc)`` the
    variables datacenter ``dc``'s job gets; ``remote``: jobs run on other machines (then the
    user gives the fleet's secret, :func:`~lowcomm.run.fleet.trust.fleet_secret`)."""
    launch: Callable[[int, int], list[str]]
    coordinator: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: Callable[[int], dict] = lambda dc: {}
    remote: bool = False


class FleetRunError(LowcommError):
    """The fleet could not finish the run; the message says why."""


@dataclass
class Incarnation:
    """One launch of a datacenter's job."""
    dc: int
    inc: int
    folder: Path
    proc: subprocess.Popen
    joining: bool
    started: float
    exit: int | None = None
    cause: str | None = None
    fenced: str | None = None        # why the coordinator counted it out (its job torn down)
    said_finished: float | None = None   # when its member said it finished (monotonic)
    lingered: bool = False           # finished, but its job did not exit: ended by the fleet
    started_t: float = field(default_factory=time.time)   # wall-clock of the launch
    resumed_from: int | None = None  # the checkpoint's step it resumed from (in its folder)

    @property
    def done(self) -> bool:
        """It finished its run (its summary written), its job ended by itself or by the fleet."""
        return self.exit == 0 or self.lingered

    def record(self) -> dict:
        return {"dc": self.dc, "inc": self.inc, "folder": str(self.folder), "joining": self.joining,
                "exit": self.exit, "cause": self.cause, "started_t": self.started_t,
                "resumed_from": self.resumed_from}


class Fleet:
    """Run ``args`` (``lowcomm train`` options without ``--out``) as the fleet ``plan`` says
    (:class:`~lowcomm.run.fleet.plan.FleetPlan`: ``fleet.dcs`` datacenters sharing the
    topology's ranks evenly; module docstring). ``launch(dc, n)``: the launch prefix of
    datacenter ``dc``'s job; ``coordinator``: a prefix for the coordinator's process (where
    it runs), ``host``: the address the leaders reach it at; ``env(dc)``: variables for
    datacenter ``dc``'s job (e.g. ``GLOO_SOCKET_IFNAME``); ``timeout_s``: end everything after
    that long. ``resume``: continue the stopped fleet in ``out`` (its marker names its folders
    and launch arguments) from the newest step ``min_dcs`` datacenters hold a checkpoint of."""

    def __init__(self, plan: FleetPlan, args: list[str], out: Path, where: Placement,
                 max_restarts: int = 1, timeout_s: float | None = None, resume: bool = False):
        self.plan, self.cfg, cfg = plan, plan.cfg, plan.cfg
        self.args, self.out, self.np = list(args), Path(out), plan.topology.size
        self.dcs = cfg.fleet.dcs
        self.min_dcs = cfg.fleet.min_dcs or self.dcs // 2 + 1
        self.launch, self.coord_prefix, self.host = where.launch, list(where.coordinator), where.host
        self.env = where.env
        self.secret = fleet_secret(cfg.fleet.secret_file, where.host, where.remote)
        self.session: dict[str, str] = {}             # the coordinator's: secret and salt
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self.jobs: dict[int, Incarnation] = {}
        self.history: list[Incarnation] = []
        self.failures = {dc: 0 for dc in range(self.dcs)}
        self.retired: dict[int, str] = {}
        self.due: dict[int, float] = {}              # relaunches: dc -> when
        self.fallbacks: list[dict] = []
        self.events: queue.Queue = queue.Queue()
        self.coord = None
        self.gave_up: str | None = None              # why the coordinator gave up, if it did
        self.over = False
        self.next_inc = {dc: 0 for dc in range(self.dcs)}
        self.resuming = resume
        self.entry = {"dcs": self.dcs, "np": self.np, "args": self.args, "folders": []}
        self.run_id = new_run_id()
        self.earlier: list[dict] = []                # a resumed fleet's incarnations before it
        if resume:
            self.entry = dict(fleet_of(self.out), args=self.args)
            self.run_id = read_marker(self.out)["run"]
            self.earlier = list(self.entry["folders"])
            for x in self.earlier:
                self.next_inc[x["dc"]] = max(self.next_inc[x["dc"]], x["inc"] + 1)
        self.stopping = 0                            # the signal that stops the fleet
        self.halted = False                          # the coordinator was told

    # the coordinator ----------------------------------------------------------------------------
    def _start_coordinator(self) -> None:
        lim = self.plan.limits()
        self.session = session_env(self.secret)       # a fresh salt: no value of before
        cmd = [*self.coord_prefix, sys.executable, "-m", "lowcomm.run.fleet.coordinator",
               "--host", self.host, "--dcs", str(self.dcs), "--min-dcs", str(self.min_dcs),
               "--limit-s", f"{lim.limit_s:.6g}", "--heartbeat-s", f"{lim.heartbeat_s:.6g}",
               "--quorum", str(self.cfg.fleet.quorum), "--grace", f"{self.cfg.fleet.grace:.6g}",
               "--log", str(self.out / "membership.jsonl")]
        server = self.plan.server()
        if server is not None:                       # asynchronous DiLoCo's outer state
            cmd += ["--server", json.dumps(server), "--state", str(self.out / "server.pt")]
        err = open(self.out / "coordinator.log", "a")
        self.coord = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, text=True, start_new_session=True,
                                      preexec_fn=_dies_with(os.getpid()),
                                      env={**os.environ, **self.session,
                                           "TORCH_CPP_LOG_LEVEL": "ERROR"})
        err.close()
        line = self.coord.stdout.readline().split()
        if len(line) != 2 or line[0] != "ready":
            raise FleetRunError("the fleet's coordinator did not start: "
                                + (self.out / "coordinator.log").read_text()[-1500:])
        self.port = int(line[1])
        coord = self.coord
        threading.Thread(target=self._events_of, args=(coord,), daemon=True).start()

    def _events_of(self, coord) -> None:
        for line in coord.stdout:
            if line.strip():
                self.events.put((coord, json.loads(line)))

    def _tell(self, **cmd) -> None:
        try:
            self.coord.stdin.write(json.dumps(cmd) + "\n")
            self.coord.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass                              # it is gone: the main loop falls back

    # the datacenters' jobs ----------------------------------------------------------------------
    def _folder(self, dc: int, inc: int) -> Path:
        return self.out / (f"dc{dc}" if inc == 0 else f"dc{dc}.{inc}")

    def _start_job(self, dc: int, joining: bool, resume: Path | None = None,
                   step: int | None = None) -> None:
        inc = self.next_inc[dc]
        self.next_inc[dc] = inc + 1
        folder = resume or self._folder(dc, inc)
        folder.mkdir(parents=True, exist_ok=True)
        self.entry["folders"].append({"dc": dc, "inc": inc, "folder": folder.name,
                                      "resumed_from": step})
        mark(self.out, self.run_id, self.entry)
        n = self.np // self.dcs
        args = self.args if resume is None else ["--resume", str(folder)]   # its saved config
        cmd = [*self.launch(dc, n), sys.executable, "-m", "lowcomm.cli", "train", *args,
               "--quiet", "--out", str(folder), "--run-id", new_run_id() if resume is None
               else _run_id(folder), "--report-dir", str(folder / ".reports")]
        env = {**os.environ, **self.env(dc), **self.session, "TORCH_CPP_LOG_LEVEL": "ERROR",
               "LOWCOMM_FLEET": f"{self.host}:{self.port}", "LOWCOMM_FLEET_DC": str(dc),
               "LOWCOMM_FLEET_INC": str(inc), "LOWCOMM_FLEET_JOIN": "1" if joining else "0",
               "LOWCOMM_FLEET_RANKS": f"{dc * n},{self.np}"}
        shutil.rmtree(folder / ".reports", ignore_errors=True)
        (folder / ".reports").mkdir()
        with open(folder / "stdout.log", "a") as so, open(folder / "stderr.log", "a") as se:
            se.write(f"--- incarnation {inc}: {' '.join(cmd)}\n")
            se.flush()
            p = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, start_new_session=True,
                                 preexec_fn=_dies_with(os.getpid()))
        job = Incarnation(dc, inc, folder, p, joining, time.monotonic(), resumed_from=step)
        self.jobs[dc] = job
        self.history.append(job)
        self._tell(cmd="launch", dc=dc, inc=inc)
        log.info("datacenter %d: incarnation %d started%s (%s)", dc, inc,
                 " to rejoin" if joining else "", folder)

    def _kill(self, job: Incarnation) -> None:
        if job.proc.poll() is None:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ended(self, job: Incarnation, now: float) -> None:
        """``job``'s process ended: finished, not admitted before the end, or failed."""
        job.exit = job.proc.returncode
        del self.jobs[job.dc]
        if job.exit == 0:
            job.cause = "finished"
            return
        if job.lingered:              # its cause said when it was ended
            return
        said = outcome.read(job.folder / ".reports")
        if self.stopping and said["stop"]:
            job.cause = f"stopped by {said['stop']}"
            return
        job.cause = job.fenced or said["error"] or cause(_tail(job.folder / "stderr.log"), job.exit)
        if self.over and job.joining:
            job.cause = "the run ended before it was admitted"
            return
        self._tell(cmd="down", dc=job.dc, inc=job.inc, cause=job.cause)
        self.failures[job.dc] += 1
        if self.failures[job.dc] > self.cfg.fleet.max_failures:
            why = f"failed {self.failures[job.dc]} times (fleet.max_failures = " \
                  f"{self.cfg.fleet.max_failures}); last: {job.cause}"
            self.retired[job.dc] = why
            self._tell(cmd="retire", dc=job.dc, why=why)
            log.warning("datacenter %d is left out: %s", job.dc, why)
        elif not self.over:
            self.due[job.dc] = now + self.cfg.fleet.backoff_s
            log.warning("datacenter %d failed (%s); relaunching it in %g s to rejoin", job.dc,
                        job.cause, self.cfg.fleet.backoff_s)

    # the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the fleet to its end; the summary (also written to ``OUT/summary.json``). A
        SIGINT/SIGTERM/SIGHUP stops every datacenter after the same round, each writing its
        checkpoint (a second one kills the jobs at once); ``--resume`` continues from there."""
        from .report import write_report
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            start = self._resume_point() if self.resuming else None
            with StopSignals(self._on_signal):
                try:
                    self._start_coordinator()
                    if start is not None:
                        self._launch_all(*start)
                    else:
                        for dc in range(self.dcs):
                            self._start_job(dc, joining=False)
                    while self.jobs or self.due:
                        self._step(time.monotonic(), t0)
                        time.sleep(0.1)
                finally:
                    for job in list(self.jobs.values()):
                        self._kill(job)
                    self._stop_coordinator()
            return write_report(self, time.monotonic() - t0)
        finally:
            close_run(lock_key(self.out))

    def _resume_point(self) -> tuple[int, dict[int, Path]]:
        step, have = self._common_checkpoint()
        if not step:
            raise FleetRunError(f"--resume {self.out}: no step that {self.min_dcs} datacenters "
                                "(fleet.min_dcs) hold a checkpoint of; nothing to resume from")
        log.info("resuming the fleet from the checkpoints of step %d (datacenters %s)", step,
                 sorted(have))
        return step, have

    def _launch_all(self, step: int, have: dict[int, Path]) -> None:
        """Launch every datacenter not left out: those in ``have`` resumed from their checkpoint
        of ``step``, the others to be admitted live (from step 0 when ``step`` is 0)."""
        for dc in range(self.dcs):
            if dc in self.retired:
                continue
            if step and dc in have:
                self._start_job(dc, joining=False, resume=have[dc], step=step)
            else:
                self._start_job(dc, joining=bool(step))

    # stopping on request ------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self.stopping:
            raise FleetRunError(f"stopped at once by a second {signal.Signals(signum).name}: the "
                                "datacenters' jobs were killed without a final checkpoint; "
                                f"continue from their last checkpoints with --resume {self.out}")
        self.stopping = signum
        log.warning("%s: every datacenter stops after the next round and writes a checkpoint "
                    "(send it again to stop at once)", signal.Signals(signum).name)

    def _halt(self) -> None:
        """Stop the fleet (:meth:`run`): the coordinator marks the next decision so that every
        member stops at its boundary; nothing is relaunched any more."""
        self.halted = True
        self.over = True
        self.due.clear()
        self._tell(cmd="halt", signum=int(self.stopping))

    def stopped_at(self) -> int | None:
        """The step a stopped fleet can resume from (None: not stopped, or no such step)."""
        if not self.stopping:
            return None
        step, _ = self._common_checkpoint(move=False)
        return step or None

    def _step(self, now: float, t0: float) -> None:
        if self.timeout_s is not None and now - t0 > self.timeout_s:
            raise FleetRunError(f"the fleet did not finish within {self.timeout_s:g} s")
        self._read_events()
        if self.stopping and not self.halted:
            self._halt()
        if self.coord.poll() is not None:
            self._read_events()               # its last words: why it gave up
            self._fall_back(f"the coordinator gave up: {self.gave_up}" if self.gave_up else
                            f"the coordinator ended (exit {self.coord.returncode})")
            return
        for job in list(self.jobs.values()):
            if job.proc.poll() is not None:
                self._ended(job, now)
        self._end_lingering(now)
        for dc, when in list(self.due.items()):
            if now >= when:
                del self.due[dc]
                self._start_job(dc, joining=True)

    def _end_lingering(self, now: float) -> None:
        """End the job of a datacenter that said it finished :data:`EXIT_GRACE_S` ago and has
        not exited (a rank stuck in its teardown), so that the fleet never waits on it forever;
        its record says so, and it is not a failure (its results are written)."""
        for job in list(self.jobs.values()):
            if job.said_finished is not None and now - job.said_finished > EXIT_GRACE_S \
                    and not job.lingered:
                job.lingered = True
                job.cause = f"finished, but its job had not exited {EXIT_GRACE_S:g} s later: " \
                            "ended by the fleet"
                log.warning("datacenter %d (incarnation %d): %s", job.dc, job.inc, job.cause)
                self._kill(job)

    def _read_events(self) -> None:
        while True:
            try:
                coord, ev = self.events.get_nowait()
            except queue.Empty:
                return
            if coord is not self.coord:
                continue                      # a coordinator of before a fallback
            if ev["event"] == "failure" and ev.get("kill"):
                job = self.jobs.get(ev["dc"])
                if job is not None and job.inc == ev["inc"]:
                    job.fenced = f"left out by the coordinator: {ev['cause']}"
                    self._kill(job)
            elif ev["event"] == "bye" and ev.get("reason") == "finished":
                job = self.jobs.get(ev["dc"])
                if job is not None and job.inc == ev["inc"]:
                    job.said_finished = time.monotonic()
            elif ev["event"] == "gave_up":
                self.gave_up = ev["why"]
            elif ev["event"] == "over":
                self.over = True
                for dc in list(self.due):     # nothing left to rejoin
                    del self.due[dc]

    def _stop_coordinator(self) -> None:
        if self.coord is not None and self.coord.poll() is None:
            self._tell(cmd="stop")
            try:
                self.coord.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.coord.pid, signal.SIGKILL)
                self.coord.wait()

    # the fall-back: today's checkpoint restart --------------------------------------------------
    def _fall_back(self, why: str) -> None:
        """The coordinator is gone: end every job, start a new coordinator, resume the
        datacenters from their newest common checkpoint (module docstring, 4)."""
        if self.stopping:
            raise FleetRunError(f"{why} while the fleet was stopping; continue from the "
                                f"datacenters' last checkpoints with --resume {self.out}")
        if len(self.fallbacks) >= self.max_restarts:
            raise FleetRunError(f"{why}; {len(self.fallbacks)} restart(s) from checkpoints used, "
                                "giving up")
        if self.dcs - len(self.retired) < self.min_dcs:
            raise FleetRunError(f"{why}; only {self.dcs - len(self.retired)} datacenter(s) are "
                                f"left and a round needs {self.min_dcs} (fleet.min_dcs)")
        self.gave_up = None
        for job in list(self.jobs.values()):
            job.fenced = f"ended by the fleet: {why}"
            self._kill(job)
            job.proc.wait()
            job.exit, job.cause = job.proc.returncode, job.fenced
            del self.jobs[job.dc]
        self.due.clear()
        step, have = self._common_checkpoint()
        self.fallbacks.append({"why": why, "resumed_from_step": step, "from": sorted(have)})
        log.warning("%s: restarting the fleet from %s", why,
                    f"the checkpoints of step {step}" if step else "step 0")
        self._start_coordinator()
        self._launch_all(step, have)

    def _common_checkpoint(self, move: bool = True) -> tuple[int, dict[int, Path]]:
        """The newest step that ``min_dcs`` datacenters hold a checkpoint of, and the folder
        of each that holds it (newer checkpoints there are moved aside where ``move``:
        ``abandoned-step-*``); ``(0, {})`` when there is none."""
        held: dict[int, dict[int, Path]] = {}
        where = [(x["dc"], self.out / x["folder"]) for x in self.earlier]
        for dc, folder in [*where, *((job.dc, job.folder) for job in self.history)]:
            for s in checkpoint_steps(folder / "checkpoints"):
                held.setdefault(s, {})[dc] = folder
        good = [s for s, by in held.items() if len(by) >= self.min_dcs]
        if not good:
            return 0, {}
        step = max(good)
        for dc, folder in held[step].items() if move else ():
            for s in checkpoint_steps(folder / "checkpoints"):
                if s > step:
                    src = folder / "checkpoints" / f"step-{s:08d}"
                    src.rename(src.with_name(f"abandoned-step-{s:08d}"))
        return step, held[step]


def _run_id(folder: Path) -> str:
    return run_id_of(folder) or new_run_id()


def _tail(path: Path, nbytes: int = 20000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


__all__ = ["Fleet", "FleetRunError", "Incarnation", "Placement"]
