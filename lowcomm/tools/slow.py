"""A slow datacenter as a fault to inject: a duty-cycled SIGSTOP/SIGCONT of one datacenter's
ranks, from outside the run (as a shared cluster or an older hardware generation slows a member).

At ``speed`` s and cycle c, every cycle stops the datacenter's ranks for (1 − s)·c and lets them
run for s·c, so the datacenter's wall-clock per step grows by 1/s (at s = 0.5 and c = 200 ms:
100 ms stopped, 100 ms running). The ranks are found afresh every cycle, so a datacenter that is
killed and relaunched (a new incarnation, ``OUT/dc<i>.<k>``) stays slow. Every process stopped is
continued when the fault ends (its ``for``, the run's end, or a signal to the tool).

A datacenter's ranks: the Python processes whose command line says ``--out FOLDER`` for the newest
folder the fleet made for that datacenter (the fleet's marker lists them) — the launcher
(``mpirun``, ``ip netns exec``) is not stopped, only the processes that train.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..errors import LowcommError


class SlowError(LowcommError, ValueError):
    """A slow fault cannot be applied; the message names the argument."""


def check(speed: float, cycle_s: float) -> None:
    """Refuse a speed outside (0, 1) or a cycle the stops cannot resolve, naming the argument."""
    if not 0.0 < speed < 1.0:
        raise SlowError(f"--speed {speed:g}: a slowed datacenter runs a fraction of its speed, "
                        "strictly between 0 and 1 (1 is not slowed; 0 never steps)")
    if not 0.01 <= cycle_s <= 60.0:
        raise SlowError(f"--cycle {cycle_s:g} s: use 10 ms to 60 s (a stop shorter than a "
                        "scheduler tick is not a stop)")


def newest_folder(out: Path, dc: int) -> Path:
    """The newest folder the fleet in ``out`` made for datacenter ``dc``."""
    from ..run.fleet.folder import fleet_of
    entry = fleet_of(Path(out))
    if entry is None:
        raise SlowError(f"{out} holds no fleet (no fleet marker): give the folder of "
                        "'lowcomm train --dcs D --out OUT'")
    if not 0 <= dc < int(entry["dcs"]):
        raise SlowError(f"--dc {dc}: the fleet in {out} has datacenters 0..{int(entry['dcs']) - 1}")
    mine = [x for x in entry.get("folders", []) if x["dc"] == dc]
    if not mine:
        raise SlowError(f"datacenter {dc} of the fleet in {out} has not been launched yet")
    return Path(out) / max(mine, key=lambda x: x["inc"])["folder"]


def ranks_of(folder: Path) -> list[int]:
    """The pids of the Python processes that run the job of ``folder`` (module docstring)."""
    want = str(Path(folder))
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            exe = os.path.basename(os.readlink(d / "exe"))
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if exe.startswith("python") and any(args[i] == "--out" and args[i + 1].rstrip("/") == want
                                            for i in range(len(args) - 1)):
            out.append(int(d.name))
    return sorted(out)


class DutyCycle:
    """Stop the processes ``targets()`` names for (1 − ``speed``)·``cycle_s`` of every
    ``cycle_s`` (module docstring); :meth:`run` until ``until()`` or ``for_s`` elapse."""

    def __init__(self, targets, speed: float, cycle_s: float = 0.2):
        check(speed, cycle_s)
        self.targets, self.speed, self.cycle_s = targets, speed, cycle_s
        self.stopped: set[int] = set()
        self.cycles = 0
        self.stopped_s = 0.0

    def _signal(self, pids, sig) -> list[int]:
        done = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                done.append(pid)
            except ProcessLookupError:
                pass
        return done

    def run(self, for_s: float = float("inf"), until=lambda: False) -> dict:
        """Duty-cycle until ``for_s`` have passed or ``until()`` is true; every process stopped
        is continued before returning (also when interrupted). A summary of what was done."""
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < for_s and not until():
                pids = self.targets()
                t1 = time.monotonic()
                self.stopped |= set(self._signal(pids, signal.SIGSTOP))
                time.sleep((1 - self.speed) * self.cycle_s)
                self._signal(pids, signal.SIGCONT)
                self.stopped_s += time.monotonic() - t1
                self.cycles += 1
                time.sleep(self.speed * self.cycle_s)
        finally:
            self._signal(sorted(self.stopped), signal.SIGCONT)
        return {"cycles": self.cycles, "pids": sorted(self.stopped),
                "stopped_s": round(self.stopped_s, 3), "seconds": round(time.monotonic() - t0, 3),
                "speed": self.speed, "cycle_s": self.cycle_s}


def kill_targets(out: Path, dc: int, rank: int | None = None) -> list[int]:
    """The pids of datacenter ``dc``'s ranks (its newest incarnation) in the fleet in ``out``;
    with ``rank``, only that rank's (the run folder's lock names rank 0; the others are told
    apart by their environment's rank)."""
    folder = newest_folder(out, dc)
    pids = ranks_of(folder)
    if not pids:
        raise SlowError(f"no process of datacenter {dc} runs now (folder {folder})")
    if rank is None:
        return pids
    mine = [p for p in pids if _rank_of(p) == rank]
    if not mine:
        raise SlowError(f"--rank {rank}: datacenter {dc} runs ranks "
                        f"{sorted(r for r in map(_rank_of, pids) if r is not None)}")
    return mine


def _rank_of(pid: int) -> int | None:
    """A launched process's rank in its job, from the launcher's environment variables."""
    try:
        env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                   if b"=" in x)
    except OSError:
        return None
    for k in (b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK", b"PMI_RANK", b"SLURM_PROCID"):
        if k in env:
            return int(env[k])
    return None


def slow_datacenter(out: Path, dc: int, speed: float, cycle_s: float = 0.2,
                    for_s: float = float("inf"), at_s: float = 0.0) -> dict:
    """Slow datacenter ``dc`` of the fleet running in ``out`` to ``speed`` of its speed from
    ``at_s`` seconds on, for ``for_s`` seconds or until the fleet's run ends (its summary is
    written)."""
    check(speed, cycle_s)
    newest_folder(out, dc)                                   # refuse a bad folder or dc now
    time.sleep(at_s)
    summary = Path(out) / "summary.json"
    before = summary.stat().st_mtime if summary.exists() else None    # an earlier run's

    def ended() -> bool:
        return summary.exists() and summary.stat().st_mtime != before
    cycle = DutyCycle(lambda: ranks_of(newest_folder(out, dc)), speed, cycle_s)
    return dict(cycle.run(for_s, until=ended), dc=dc)


__all__ = ["DutyCycle", "SlowError", "check", "kill_targets", "newest_folder", "ranks_of",
           "slow_datacenter"]
