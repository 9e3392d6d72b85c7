"""Running fleets for the tests: several at once (their task sleeps, so they share the cores),
each with a deadline, with faults injected when a run reaches a step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT

TASK = ROOT / "tests" / "fleet_task.py"
#: 3 datacenters x 1 rank, DiLoCo across, H = 10: rounds of about 10 x step_ms
BASE = ["task=" + str(TASK), "batch_size=64", "task.dim=8", "eval_batches=8", "log_every=5", "lr=0.01",
        "eval_every=0", "comm.outage_s=1", "fleet.backoff_s=0.2"]


def sets(*extra: str) -> list[str]:
    return [a for o in (*BASE, *extra) for a in ("--set", o)]


class Run:
    """A ``lowcomm`` command started in the background; :meth:`wait` returns (exit, output)."""

    def __init__(self, out: Path, args: list[str], env: dict | None = None):
        self.out = out
        self.log = open(str(out) + ".log", "w")
        self.p = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})}, start_new_session=True)

    def wait(self, deadline: float) -> tuple[int, str]:
        try:
            self.p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        self.log.close()
        return self.p.returncode, Path(str(self.out) + ".log").read_text()

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


def fleet(out: Path, *extra: str, dcs: int = 3, np: int = 3, place: str = "auto") -> Run:
    return Run(out, [sys.executable, "-m", "lowcomm.cli", "train", "--dcs", str(dcs), "--np",
                     str(np), "--place", place, "--out", str(out), *sets(*extra)])


def fleet_from_python(out: Path, *extra: str, dcs: int = 3, np: int = 3) -> Run:
    """The same fleet started by ``lowcomm.train_fleet`` from a Python script."""
    code = (f"import lowcomm; lowcomm.train_fleet(overrides={[*BASE, *extra]!r}, dcs={dcs}, "
            f"np={np}, out={str(out)!r}, place='local')")
    return Run(out, [sys.executable, "-c", code])


def single_job(out: Path, *extra: str, np: int = 3) -> Run:
    """Today's run: one mpirun over every rank."""
    return Run(out, [str(ROOT / "launchers" / "local.sh"), "-n", str(np), "lowcomm", "train",
                     "--quiet", "--out", str(out), *sets(*extra)])


def reached(metrics: Path, step: int) -> bool:
    try:
        return any(json.loads(x).get("step", 0) >= step for x in metrics.read_text().splitlines())
    except (OSError, ValueError):
        return False


def when(cond, action, deadline: float) -> threading.Thread:
    """Run ``action()`` once ``cond()`` holds (polled), unless ``deadline`` passes first."""
    def watch():
        while time.monotonic() < deadline:
            if cond():
                action()
                return
            time.sleep(0.1)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def kill_rank0(folder: Path) -> None:
    """SIGKILL rank 0 of the job in ``folder`` (its pid is in the run folder's lock)."""
    pid = int((folder / ".lowcomm.lock").read_text().split()[1])
    (folder.parent / "killed_at").write_text(str(time.time()))
    os.kill(pid, signal.SIGKILL)


def children(pid: int, name: str) -> list[int]:
    """The child processes of ``pid`` whose command line holds ``name``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and name in (d / "cmdline").read_text():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def metrics(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]


def outsider(folder: Path, dcs: int) -> dict:
    """What a process without the fleet's secret does to the coordinator's port (read from the
    fleet's log): it reads a member's message (sealed: no JSON), and writes, into the key each
    member's next message will take (``compare_set`` on an absent key: a member's own message
    is never overwritten), a forged ``failed`` message for datacenter 0, a replay of its
    previous sealed message for datacenter 1 and random bytes for the others; forged bytes into
    datacenter 0's next mailbox key and into a heartbeat. Returns the keys it wrote and what it
    read."""
    import datetime

    from torch.distributed import TCPStore

    from lowcomm.run.fleet.store import key
    start = next(json.loads(x) for x in (folder / "membership.jsonl").read_text().splitlines()
                 if '"start"' in x)
    store = TCPStore("127.0.0.1", start["port"], is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=10))

    def next_key(kind: str, dc: int) -> tuple[str, bytes | None]:
        k, last = 0, None
        while store.check([key(kind, dc=dc, inc=0, k=k, n=k)]):
            last = store.get(key(kind, dc=dc, inc=0, k=k, n=k))
            k += 1
        return key(kind, dc=dc, inc=0, k=k, n=k), last

    wrote, read = [], None
    for dc in range(dcs):
        name, last = next_key("inbox", dc)
        read = read or last
        forged = (json.dumps({"type": "failed", "dc": dc, "inc": 0}).encode() if dc == 0 else
                  last if dc == 1 and last else os.urandom(64))
        if store.compare_set(name, "", forged) == forged:
            wrote.append(name)
    name, _ = next_key("mailbox", 0)
    if store.compare_set(name, "", b'{"type": "fence", "why": "forged"}') == b'{"type": "fence", "why": "forged"}':
        wrote.append(name)
    store.set(key("heartbeat", dc=1, inc=0), b"999999")
    return {"wrote": wrote, "read": read}


def finished(done: tuple) -> Run:
    """The run of a ``(run, exit status, output)`` triple (a module fixture's), asserting it
    exited 0 (else the output's tail is the message)."""
    run, rc, out = done
    assert rc == 0, out[-3000:]
    return run


def assert_same_model(s: dict, ref: dict) -> None:
    """A fleet's summary ``s`` against ``ref``'s (one MPI job of the same policy): the same
    parameters bit for bit, and the datacenters agreeing."""
    assert s["state_sha256"] == ref["state_sha256"] and s["dcs_agree"], (s, ref["state_sha256"])


def assert_healed_once(s: dict, plain: dict, rtol: float) -> None:
    """A fleet of 2 datacenters (summary ``s``) whose datacenter 1 failed once and was healed
    back: both finished on one model, within ``rtol`` of the held-out loss of the unfaulted
    fleet ``plain``."""
    f = s["fleet"]
    assert s["finished_dcs"] == [0, 1] and s["dcs_agree"], s["finished_dcs"]
    assert [x["dc"] for x in f["failures"]] == [1] and f["heals"] and f["heals"][0]["dc"] == 1, f
    assert abs(s["eval_loss"] - plain["eval_loss"]) <= rtol * plain["eval_loss"], \
        (s["eval_loss"], plain["eval_loss"])
