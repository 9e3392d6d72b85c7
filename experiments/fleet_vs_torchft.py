"""Fleet healing against torchft: a replica group SIGKILLed mid-run, same workload, same machine.

Question: when one of 3 replica groups (datacenters) is SIGKILLed in the middle of a DiLoCo
run and relaunched at once, how many inner steps do the survivors lose, how many seconds pass
from the kill (and from the relaunch) to the group training again, and how far is the final
eval loss from the same run without the fault — for lowcomm's fleet and for torchft?

    PYTHONPATH=. python experiments/fleet_vs_torchft.py --out runs/fleet-vs-torchft --repeats 3

(torchft: ``pip install -e .[torchft]``.) Both sides train 3 groups × 1 rank, DiLoCo across the
groups with the same H, steps, seed, model (the ``bytelm`` task's TinyGPT), inner optimizer
(lowcomm's AdamW and lr) and outer optimizer (SGD, Nesterov, lowcomm's DiLoCo defaults), group
r at step t training on ``task.batch(t, r, 3, cfg)``; one torch thread per process.

* lowcomm: ``lowcomm train --dcs 3 --np 3 --place local`` (``fleet.backoff_s = 0``: relaunched
  at once). The kill: rank 0 of datacenter 1 (its pid from the run folder's lock) once its
  metrics reach ``--kill-at``. Read from ``summary.json``: ``fleet.steps_lost`` of the
  survivors; the heal's wall-clock ``t`` (the joiner goes back to training), minus the kill's
  and minus the relaunch's (``fleet.datacenters["1"][1].started_t``), and of that the process's
  start (to the new job's ``hello`` in ``membership.jsonl``); the eval loss.
* torchft: ``torchft_lighthouse`` (``--min_replicas 2``, heartbeat timeout and join timeout
  ``--hb-ms``/``--join-ms``, quorum tick 50 ms) and 3 processes of
  ``experiments/torchft_replica.py`` (Manager + ProcessGroupGloo + ``torchft.local_sgd.DiLoCo``);
  this script relaunches a group that dies at once (as torchelastic would). The same kill, at
  the same step, of group 1. From each group's JSONL: a survivor's steps lost are the inner
  steps of its rounds whose commit failed (no committed outer step took their work); the group
  trains again at the start of the relaunched process's first step after the round in which it
  healed (loaded a peer's state) was committed; the steps it took before that (discarded by
  the heal) are counted apart, and the process's start is the relaunch to its ``ready`` line
  (the Manager up); the eval loss is group 0's.

Each of the four runs (two systems, with and without the kill) is repeated ``--repeats`` times;
the script writes ``OUT/results.json`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPLICA = ROOT / "experiments" / "torchft_replica.py"
GROUPS = 3
#: the lighthouse's ``--min_replicas``: a round commits with at least this many groups
MIN_REPLICAS = 2
#: seconds a group still running when all but it have ended is given to end by itself
STRANDED_GRACE_S = 10.0


class TorchftMissing(RuntimeError):
    """torchft (and its lighthouse) is not installed."""


def jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line a kill cut short is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def env() -> dict:
    """The environment of every process started here: this tree importable, one thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def watch(cond, action, stop: threading.Event) -> threading.Thread:
    """Run ``action()`` once ``cond()`` holds (polled every 20 ms), unless ``stop`` is set."""
    def loop():
        while not stop.is_set():
            if cond():
                action()
                return
            time.sleep(0.02)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


# lowcomm ----------------------------------------------------------------------------------------
def lowcomm_run(out: Path, overrides: list[str], a, kill: bool) -> dict:
    """One ``lowcomm train --dcs 3`` fleet, rank 0 of datacenter 1 SIGKILLed at ``a.kill_at``
    when ``kill``; its row of the table."""
    sets = [*overrides, "strategy.name=diloco", f"strategy.period={a.period}", "fleet.backoff_s=0"]
    cmd = [sys.executable, "-m", "lowcomm.cli", "train", "--dcs", str(GROUPS), "--np", str(GROUPS),
           "--place", "local", "--out", str(out), *[x for s in sets for x in ("--set", s)]]
    killed: dict = {}

    def reached() -> bool:
        """Datacenter 1 has logged step ``--kill-at``."""
        lines = jsonl(out / "dc1" / "metrics.jsonl")
        return bool(lines) and lines[-1].get("step", 0) >= a.kill_at

    def shoot() -> None:
        """SIGKILL rank 0 of datacenter 1, noting when and at which step."""
        pid = int((out / "dc1" / ".lowcomm.lock").read_text().split()[1])
        killed.update(t=time.time(), step=jsonl(out / "dc1" / "metrics.jsonl")[-1]["step"])
        os.kill(pid, signal.SIGKILL)

    stop = threading.Event()
    if kill:
        watch(reached, shoot, stop)
    with open(str(out) + ".log", "w") as logf:
        rc = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=logf, stderr=subprocess.STDOUT,
                            timeout=a.timeout_s).returncode
    stop.set()
    if rc != 0:
        raise RuntimeError(f"lowcomm fleet exited {rc}; see {out}.log")
    return lowcomm_row(json.loads((out / "summary.json").read_text()), out, killed)


def lowcomm_row(s: dict, out: Path, killed: dict) -> dict:
    """The table's figures from a fleet's summary (and the kill's time and step)."""
    f = s["fleet"]
    row = {"system": "lowcomm", "faulted": bool(killed), "eval_loss": s["eval_loss"],
           "wall_s": s["wall_s"], "survivors_steps_lost": f["steps_lost"],
           "failures": len(f["failures"]),
           "rounds_short": sum(1 for r in f["membership"] if ".f" in r["tag"] and
                               len(r["members"]) < GROUPS)}
    heal = next((h for h in f["heals"] if h["dc"] == 1), None)
    if killed and heal is None:               # the run ended before it was admitted
        row.update(kill_step=killed["step"], kill_to_training_s=None, relaunch_to_training_s=None,
                   rejoiner_steps_discarded=None, heal_step=None)
    elif killed:
        again = f["datacenters"]["1"][1]
        before = [x for x in jsonl(Path(again["folder"]) / "metrics.jsonl")
                  if x.get("step", 0) <= heal["step"]]
        hello = next(e for e in jsonl(out / "membership.jsonl") if e["event"] == "hello"
                     and (e["dc"], e["inc"]) == (1, 1))
        row.update(kill_step=killed["step"], heal_step=heal["step"],
                   relaunch_to_ready_s=hello["t"] - again["started_t"],
                   kill_to_training_s=heal["t"] - killed["t"],
                   relaunch_to_training_s=heal["t"] - again["started_t"],
                   rejoiner_steps_discarded=len(before), heal_bytes=heal["bytes"])
    return row


# torchft ----------------------------------------------------------------------------------------
def lighthouse_binary() -> str:
    """The path of ``torchft_lighthouse``; :class:`TorchftMissing` says what to install."""
    try:
        importlib.import_module("torchft")
    except ImportError as e:
        raise TorchftMissing(f"torchft does not import ({e}); install it with "
                             "pip install -e .[torchft]") from e
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    if not Path(exe).exists():
        raise TorchftMissing("torchft_lighthouse (torchft's Rust lighthouse, in its wheel) is not "
                             "on PATH nor next to this Python")
    return exe


def free_port() -> int:
    """A TCP port free on loopback now (for the lighthouse)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, proc: subprocess.Popen, prefix: list[str],
              timeout: float = 20.0) -> None:
    """Return once ``host:port`` accepts connections from where ``prefix`` runs a command (this
    machine, or a namespace of the emulated WAN); raise if ``proc`` ends or ``timeout`` passes."""
    probe = [*prefix, sys.executable, "-c", "import socket, sys\n"
             "socket.create_connection((sys.argv[1], int(sys.argv[2])), 0.2).close()",
             host, str(port)]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited {proc.returncode}")
        if subprocess.run(probe, stderr=subprocess.DEVNULL).returncode == 0:
            return
        time.sleep(0.05)
    raise RuntimeError(f"torchft_lighthouse did not listen on {host}:{port} within {timeout:g} s")


class Places:
    """Where torchft's processes run, as a lowcomm fleet's datacenters and coordinator run
    (:func:`lowcomm.tools.fleet_launch.placement`): all on this machine over loopback
    (``"local"``), or group r in the emulated WAN's namespace of datacenter r at its address,
    gloo on its WAN device, the lighthouse in datacenter 0's (``"wan"``: ``lowcomm wan up
    --dcs 3`` first; a clear error without it)."""

    def __init__(self, place: str = "local"):
        from lowcomm.tools.fleet_launch import placement
        self.wan = place == "wan"
        _, self.coordinator, self.coordinator_host, self._env = placement(GROUPS, place)

    def prefix(self, r: int) -> list[str]:
        """``ip netns exec``, and the hostname set to the group's address: torchft addresses
        its checkpoint server and rendezvous store by ``socket.gethostname()``."""
        from lowcomm.tools.wan import address, namespace
        if not self.wan:
            return []
        return ["ip", "netns", "exec", namespace(r), "unshare", "--uts", "--", "/bin/sh", "-c",
                f'hostname {address(r)}; exec "$@"', "sh"]

    def host(self, r: int) -> str:
        from lowcomm.tools.wan import address
        return address(r) if self.wan else self.coordinator_host

    def env(self, r: int) -> dict:
        return {**env(), **self._env(r)}


class Torchft:
    """torchft's side of one run: the lighthouse, 3 replica groups, a dead one relaunched at
    once (:meth:`run`), the kill of group 1 at ``a.kill_at`` when ``kill``."""

    def __init__(self, out: Path, overrides: list[str], a, kill: bool, place: str = "local"):
        self.out, self.overrides, self.a, self.kill = out, overrides, a, kill
        self.places = Places(place)
        self.procs: dict[int, subprocess.Popen] = {}
        self.launches: list[dict] = []
        self.killed: dict = {}
        self.stranded: list[int] = []         # :meth:`supervise`
        self.stranded_at = 0.0
        self.port = free_port()

    def start_lighthouse(self) -> None:
        """torchft's lighthouse on a free port (of group 0's place), its log in
        ``OUT/lighthouse.log``."""
        a, host, prefix = self.a, self.places.coordinator_host, self.places.coordinator
        cmd = [*prefix, lighthouse_binary(), "--min_replicas", str(MIN_REPLICAS),
               "--bind", f"{host}:{self.port}",
               "--heartbeat_timeout_ms", str(a.hb_ms), "--join_timeout_ms", str(a.join_ms),
               "--quorum_tick_ms", "50"]
        self.lh_log = open(self.out / "lighthouse.log", "w")
        self.lighthouse = subprocess.Popen(cmd, stdout=self.lh_log, stderr=subprocess.STDOUT,
                                           env={**env(), "RUST_LOG": "info"}, start_new_session=True)
        wait_port(host, self.port, self.lighthouse, prefix)

    def launch(self, r: int) -> None:
        """Start (or restart) group ``r``: ``OUT/replica<r>.<incarnation>.jsonl``."""
        inc = sum(1 for x in self.launches if x["replica"] == r)
        log = self.out / f"replica{r}.{inc}.jsonl"
        pl = self.places
        cmd = [*pl.prefix(r), sys.executable, str(REPLICA), "--replica", str(r), "--groups",
               str(GROUPS), "--period", str(self.a.period), "--host", pl.host(r),
               "--lighthouse", f"http://{pl.coordinator_host}:{self.port}",
               "--log", str(log), *[x for s in self.overrides for x in ("--set", s)]]
        with open(self.out / f"replica{r}.{inc}.out", "w") as so:
            self.procs[r] = subprocess.Popen(cmd, cwd=ROOT, env=pl.env(r), stdout=so,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        self.launches.append({"replica": r, "inc": inc, "t": time.time(), "log": str(log)})

    def shoot(self) -> None:
        """SIGKILL group 1, noting when and at which step."""
        lines = [x for x in jsonl(self.out / "replica1.0.jsonl") if x["kind"] == "step"]
        self.killed.update(t=time.time(), step=lines[-1]["t"])
        os.kill(self.procs[1].pid, signal.SIGKILL)

    def reached(self) -> bool:
        """Group 1 has logged step ``--kill-at``."""
        lines = [x for x in jsonl(self.out / "replica1.0.jsonl") if x["kind"] == "step"]
        return bool(lines) and lines[-1]["t"] >= self.a.kill_at

    def run(self) -> dict:
        """The run, to the survivors' end; its row of the table."""
        self.out.mkdir(parents=True, exist_ok=True)
        t0, stop = time.time(), threading.Event()
        self.start_lighthouse()
        try:
            for r in range(GROUPS):
                self.launch(r)
            if self.kill:
                watch(self.reached, self.shoot, stop)
            self.supervise(t0)
        finally:
            stop.set()
            for p in [*self.procs.values(), self.lighthouse]:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            self.lh_log.close()
        end = self.stranded_at if self.stranded else time.time()   # the others' end
        return dict(torchft_row(self.launches, self.killed, end - t0), stranded=self.stranded)

    def supervise(self, t0: float) -> None:
        """Relaunch a group that died, until groups 0 and 2 (never killed) have finished — or
        until fewer groups than a quorum needs are left running after the others finished:
        those are *stranded* (each asks for the quorum of its next round, which nobody is left
        to join, and would fail at its quorum timeout), given :data:`STRANDED_GRACE_S` to end by
        themselves, then stopped and listed in :attr:`stranded` (the run's wall-clock ends when
        the others had ended)."""
        done: dict[int, int] = {}
        alone_since = None
        while not all(done.get(r) == 0 for r in (0, 2)):
            if time.time() - t0 > self.a.timeout_s:
                raise RuntimeError(f"torchft run did not finish within {self.a.timeout_s:g} s")
            running = [r for r in self.procs if r not in done]
            if sum(rc == 0 for rc in done.values()) >= MIN_REPLICAS and \
                    0 < len(running) < MIN_REPLICAS:
                alone_since = alone_since or time.time()
                if time.time() - alone_since > STRANDED_GRACE_S:
                    self.stranded, self.stranded_at = running, alone_since
                    return
            for r, p in list(self.procs.items()):
                rc = p.poll()
                if rc is None or r in done:
                    continue
                if rc == 0:
                    done[r] = 0
                elif r == 1 and self.killed and len(self.launches) == GROUPS:
                    self.launch(r)                # the killed group, relaunched at once
                else:
                    raise RuntimeError(f"torchft replica {r} exited {rc}; see {self.out}")
            time.sleep(0.02)


def rounds(lines: list[dict]) -> list[tuple[list[dict], bool]]:
    """A group's steps cut into rounds, each with whether torchft committed it."""
    out, cur = [], []
    for x in lines:
        if x["kind"] != "step":
            continue
        cur.append(x)
        if x.get("sync"):
            out.append((cur, bool(x.get("committed"))))
            cur = []
    if cur:
        out.append((cur, False))              # a round the run ended (or was killed) inside
    return out


def torchft_row(launches: list[dict], killed: dict, wall: float) -> dict:
    """The table's figures from the groups' logs."""
    logs = {(x["replica"], x["inc"]): jsonl(Path(x["log"])) for x in launches}
    lost = {str(r): sum(len(steps) for steps, ok in rounds(logs[(r, 0)]) if not ok)
            for r in (0, 2)}
    end = next(x for r in range(GROUPS) for x in logs.get((r, 0), []) if x["kind"] == "end")
    row = {"system": "torchft", "faulted": bool(killed), "eval_loss": end["eval_loss"],
           "wall_s": wall, "survivors_steps_lost": lost, "failures": len(launches) - GROUPS,
           "rounds_short": sum(1 for x in logs[(0, 0)] if x.get("sync") and x.get("committed")
                               and x["participants"] < GROUPS)}
    if killed:
        row.update(kill_step=killed["step"], **rejoin(logs[(1, 1)], launches[-1]["t"], killed))
    return row


def rejoin(lines: list[dict], relaunched: float, killed: dict) -> dict:
    """When the relaunched group trained again: its first step after the committed round in
    which it loaded a peer's state; the steps it took before, which that heal discarded; when
    its Manager was up (``ready``)."""
    heal = next((x for x in lines if x["kind"] == "heal"), None)
    ready = next(x["time"] - relaunched for x in lines if x["kind"] == "ready")
    if heal is None:
        return {"kill_to_training_s": None, "relaunch_to_training_s": None,
                "rejoiner_steps_discarded": None, "heal_step": None, "relaunch_to_ready_s": ready}
    steps = [x for x in lines if x["kind"] == "step"]
    healed = next(i for i, x in enumerate(steps) if x.get("sync") and x["time"] >= heal["time"])
    committed = [i for i, x in enumerate(steps) if i >= healed and x.get("committed")]
    first = steps[committed[0] + 1] if committed and committed[0] + 1 < len(steps) else None
    return {"kill_to_training_s": first["start"] - killed["t"] if first else None,
            "relaunch_to_training_s": first["start"] - relaunched if first else None,
            "rejoiner_steps_discarded": healed + 1, "relaunch_to_ready_s": ready,
            "heal_step": first["t"] - 1 if first else None}


# the table --------------------------------------------------------------------------------------
def fmt(v, spec: str) -> str:
    """``v`` formatted, or a dash for None."""
    return "–" if v is None else format(v, spec)


def again(r: dict) -> str:
    """Relaunch to training again, with the process's start in brackets."""
    if r.get("relaunch_to_ready_s") is None:
        return "–"
    return f"{fmt(r.get('relaunch_to_training_s'), '.2f')} ({r['relaunch_to_ready_s']:.2f})"


def table(rows: list[dict]) -> str:
    """Markdown: one line per run; a faulted run's eval loss against the mean of the same
    system's unfaulted runs."""
    ref = {}
    for r in rows:
        if not r["faulted"]:
            ref.setdefault(r["system"], []).append(r["eval_loss"])
    head = ("| system | run | killed at step | survivors' inner steps lost | kill → training again s "
            "| relaunch → training again s (of which process start) | rejoiner's steps discarded "
            "| rounds without all 3 | eval loss | vs unfaulted | wall s |\n" + "|---" * 11 + "|\n")
    lines = []
    for r in rows:
        base = sum(ref[r["system"]]) / len(ref[r["system"]]) if ref.get(r["system"]) else None
        pct = None if base is None or not r["faulted"] else 100 * (r["eval_loss"] - base) / base
        lost = ", ".join(f"{v}" for v in r["survivors_steps_lost"].values())
        lines.append(
            f"| {r['system']} | {'group 1 killed' if r['faulted'] else 'unfaulted'} "
            f"| {fmt(r.get('kill_step'), 'd')} | {lost} | {fmt(r.get('kill_to_training_s'), '.2f')} "
            f"| {again(r)} "
            f"| {fmt(r.get('rejoiner_steps_discarded'), 'd')} | {r['rounds_short']} "
            f"| {r['eval_loss']:.4f} "
            f"| {fmt(pct, '+.2f')}{' %' if pct is not None else ''} | {r['wall_s']:.1f} |")
    return head + "\n".join(lines) + "\n"


def runs(a) -> list[dict]:
    """Every run, in the order lowcomm, torchft, unfaulted then faulted, ``a.repeats`` times."""
    overrides = [f"steps={a.steps}", "log_every=1", f"eval_batches={a.eval_batches}", *a.overrides]
    rows = []
    for rep in range(a.repeats):
        for system in a.systems.split(","):
            for kill in (False, True):
                out = a.out / f"rep{rep}" / f"{system}-{'kill' if kill else 'plain'}"
                shutil.rmtree(out, ignore_errors=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                print(f"run {rep}: {system}, {'group 1 killed' if kill else 'unfaulted'} ...",
                      file=sys.stderr, flush=True)
                row = (lowcomm_run(out, overrides, a, kill) if system == "lowcomm"
                       else Torchft(out, overrides, a, kill).run())
                rows.append(dict(row, repeat=rep, folder=str(out)))
                (a.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/fleet-vs-torchft"))
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--period", type=int, default=20, help="H, inner steps per round")
    p.add_argument("--kill-at", type=int, default=110, help="kill group 1 once it reaches this step")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--systems", default="lowcomm,torchft")
    p.add_argument("--hb-ms", type=int, default=1000, help="torchft lighthouse heartbeat timeout")
    p.add_argument("--join-ms", type=int, default=1000, help="torchft lighthouse join timeout")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on a run after this")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="a lowcomm config override for both systems, e.g. model.d_model=64")
    p.add_argument("--table", action="store_true", help="only print OUT/results.json's table")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads((a.out / "results.json").read_text())))
        return
    if "torchft" in a.systems:
        lighthouse_binary()                   # a clear error before anything runs
    a.out.mkdir(parents=True, exist_ok=True)
    rows = runs(a)
    print(table(rows))


if __name__ == "__main__":
    main()
