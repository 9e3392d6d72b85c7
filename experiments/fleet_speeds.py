"""Datacenters of different speeds: a synchronous fleet against dynamic local updates,
asynchronous DiLoCo, eager updates, a quorum with a grace window, and torchft's DiLoCo.

Question: a fleet of 3 datacenters × 1 rank trains DiLoCo (H = 10, 160 steps, the default
``bytelm`` workload) while datacenters are slowed from outside (``lowcomm fault slow``: a
duty-cycled SIGSTOP/SIGCONT, 100 ms stopped and 100 ms running at half speed). How long does the
fleet take, what share of the members' time trains (goodput), and what eval loss does it reach
after the fast members' 160 steps — synchronous DiLoCo (at its default outer momentum 0.9 and at
0.5) against ``diloco-dylu`` (a slowed member takes its speed's share of each period),
``diloco-async`` (each pseudo-gradient applied by the coordinator's server as it arrives; with
τ = 8 each arrival travels while the next 8 steps run),
``diloco-eager`` (τ = 3), DiLoCo with a quorum of 2 and a grace window of half a period, and
torchft's DiLoCo on the same workload (``torchft``: its replica groups of
``experiments/fleet_vs_torchft.py``, the slow group slowed by the same duty cycle)?

    PYTHONPATH=. python experiments/fleet_speeds.py --out runs/fleet-speeds --repeats 3

Rows (each run one after the other, each repetition all rows in turn, so that the machine's load
falls on every row alike): ``speeds`` 1,1,1 / 1,1,0.5 / 1,0.5,0.25 / 1,1,flaky (datacenter 2
nearly stopped once for :data:`FLAKY_S` seconds) for each of ``--methods``. Read from each
fleet's ``summary.json``: its wall-clock (``wall_s``: the supervisor's, start-up included, as a
user waits for it), ``fleet.time.goodput``, the eval loss, and each datacenter's steps computed
(torchft's: :func:`torchft`). The ratio column divides a row's wall-clock by the unslowed
synchronous fleet's of the same repetition. With ``--eval-every N`` datacenter 0 (torchft's
group 0) also evaluates every N steps, and the table gives each row's eval loss at equal
wall-clock: at T, the time into its job at which the quickest run of those speeds made its last
evaluation, and at the time synchronous DiLoCo's quickest run of them did (each run's last
evaluation by then, or its delivered model's where the fleet had ended; a dash where a run
had made none).
Writes ``OUT/results.json`` and prints a Markdown table (ranges over the repetitions) and
``uptime``'s load before and after; ``--table RESULTS`` prints an earlier run's table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import fleet_vs_torchft as ft  # noqa: E402 - torchft's side, and the JSONL reader

SPEEDS = ("1,1,1", "1,1,0.5", "1,0.5,0.25", "1,1,flaky")
#: the rows' methods: the name in the table, its settings
METHODS = {"diloco": ["strategy.name=diloco"],
           "diloco-dylu": ["strategy.name=diloco-dylu"],
           "diloco-async": ["strategy.name=diloco-async"],
           "diloco-async delay 8": ["strategy.name=diloco-async", "strategy.delay=8"],
           "diloco momentum 0.5": ["strategy.name=diloco", "strategy.outer_momentum=0.5"],
           "diloco-eager": ["strategy.name=diloco-eager", "strategy.delay=3"],
           "diloco quorum 2": ["strategy.name=diloco", "fleet.quorum=2", "fleet.grace=0.5"],
           # torchft's DiLoCo (Manager, lighthouse, quorum) on the same workload: below
           "torchft": []}
#: a flaky datacenter: nearly stopped (speed 0.1) for this many seconds once, from a third of
#: the run on (about 1.5 periods of H = 10 at the default workload's step time)
FLAKY_S = 1.5


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def lowcomm(*args: str) -> list[str]:
    return [sys.executable, "-m", "lowcomm.cli", *args]


def one(out: Path, method: str, speeds: str, steps: int, period: int, extra: list[str],
        place: str = "local", eval_every: int = 0) -> dict:
    """One fleet, its slow datacenters slowed from its start to its end (a flaky one: once,
    :data:`FLAKY_S` seconds from a third of its steps on); the figures (``evals``: datacenter
    0's evaluations every ``eval_every`` steps, as [its metrics line's ``wall_s``: seconds
    since its training loop started, step, eval loss])."""
    if out.exists():
        shutil.rmtree(out)
    if method == "torchft":
        return torchft(out, speeds, steps, period, extra, place, eval_every)
    sets = [*METHODS[method], f"strategy.period={period}", f"steps={steps}",
            f"eval_every={eval_every}", *extra]
    fleet = subprocess.Popen(lowcomm("train", "--dcs", "3", "--np", "3", "--place", place,
                                     "--quiet", "--out", str(out),
                                     *[a for s in sets for a in ("--set", s)]),
                             cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                             stderr=open(str(out) + ".log", "w"))
    slow = []
    for dc, v in enumerate(speeds.split(",")):
        if v == "flaky":
            while not _reached(out / f"dc{dc}" / "metrics.jsonl", steps // 3) and \
                    fleet.poll() is None:
                time.sleep(0.05)
            slow.append(subprocess.Popen(lowcomm("fault", "slow", str(out), "--dc", str(dc),
                                                 "--speed", "0.1", "--cycle", "300ms",
                                                 "--for", f"{FLAKY_S}s"),
                                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True))
        elif float(v) < 1:
            lock = out / f"dc{dc}" / ".lowcomm.lock"
            while not lock.exists() and fleet.poll() is None:
                time.sleep(0.05)
            slow.append(subprocess.Popen(lowcomm("fault", "slow", str(out), "--dc", str(dc),
                                                 "--speed", v), cwd=ROOT, env=env(),
                                         stdout=subprocess.PIPE, text=True))
    try:
        rc = fleet.wait()
    finally:                                  # interrupted: the fleet stopped with this script
        if fleet.poll() is None:
            fleet.terminate()
            fleet.wait(120)
    for p in slow:
        p.wait(60)
    if rc != 0:
        raise SystemExit(f"{out}: the fleet exited {rc}; see {out}.log")
    s = json.loads((out / "summary.json").read_text())
    t = s["fleet"]["time"]
    evals = [[x["wall_s"], x["step"], x["eval_loss"]]
             for x in ft.jsonl(out / "dc0" / "metrics.jsonl") if "eval_loss" in x]
    return {"method": method, "speeds": speeds, "wall_s": s["wall_s"], "eval_loss": s["eval_loss"],
            "goodput": t["goodput"], "idle_fraction": t["idle_fraction"],
            "steps": [t["by_dc"][str(d)]["steps"] for d in range(3)], "evals": evals}


def torchft(out: Path, speeds: str, steps: int, period: int, extra: list[str],
            place: str = "local", eval_every: int = 0) -> dict:
    """torchft's DiLoCo on the same workload (``experiments/fleet_vs_torchft.py``'s replica
    groups: its Manager, lighthouse with ``--min_replicas 2`` and a 1 s join timeout, Nesterov
    outer step at lowcomm's defaults), group r slowed from its start as ``lowcomm fault slow``
    slows a datacenter (the same duty cycle on the group's process). Its goodput, from the
    groups' step lines: a step that ends a round counts as busy for the median duration of the
    group's other steps (the rest is the round: quorum, all-reduce, waiting); over each group's
    span from its first step's start to its last step's end. A ``flaky`` group: nearly stopped
    once for :data:`FLAKY_S` seconds from a third of its steps on, as for a fleet. ``place``
    ``"wan"``: group r in datacenter r's namespace of the emulated WAN, as a fleet's."""
    import threading
    from argparse import Namespace
    from lowcomm.tools.slow import DutyCycle
    out.mkdir(parents=True)
    a = Namespace(period=period, hb_ms=1000, join_ms=1000, timeout_s=900.0, kill_at=0)
    t = ft.Torchft(out, [f"steps={steps}", f"eval_every={eval_every}", *extra], a, kill=False,
                   place=place)
    done, slowers = threading.Event(), []
    def third(r: int) -> bool:
        lines = [x for x in ft.jsonl(out / f"replica{r}.0.jsonl") if x["kind"] == "step"]
        return bool(lines) and lines[-1]["t"] >= steps // 3

    def flaky(r: int, cycle) -> None:
        while not third(r) and not done.is_set():
            time.sleep(0.05)
        cycle.run(for_s=FLAKY_S, until=done.is_set)
    for r, v in enumerate(speeds.split(",")):
        if v == "flaky" or float(v) < 1:
            cycle = DutyCycle(lambda r=r: [t.procs[r].pid] if r in t.procs else [],
                              0.1 if v == "flaky" else float(v), 0.3 if v == "flaky" else 0.2)
            run = (lambda r=r, c=cycle: flaky(r, c)) if v == "flaky" else \
                (lambda c=cycle: c.run(until=done.is_set))
            slowers.append(threading.Thread(target=run))
            slowers[-1].start()
    try:
        row = t.run()
    except RuntimeError as e:                 # a group that died: torchft's failure, a result
        return {"method": "torchft", "speeds": speeds, "failed": str(e).split(";")[0],
                "why": _last_error(out)}
    finally:
        done.set()
        for x in slowers:
            x.join()
    busy = span = 0.0
    computed = []
    logs = [ft.jsonl(out / f"replica{r}.0.jsonl") for r in range(3)]
    for log in logs:
        lines = [x for x in log if x["kind"] == "step"]
        took = [x["time"] - x["start"] for x in lines]
        plain = sorted(d for d, x in zip(took, lines) if not x.get("sync"))
        median = plain[len(plain) // 2]
        busy += sum(median if x.get("sync") else d for d, x in zip(took, lines))
        span += lines[-1]["time"] - lines[0]["start"]
        computed.append(len(lines))
    born = next(x["time"] for x in logs[0] if x["kind"] == "ready")   # as a fleet's job: its loop
    evals = [[x["time"] - born, x["t"], x["eval_loss"]] for x in logs[0] if x["kind"] == "eval"]
    return {"method": "torchft", "speeds": speeds, "wall_s": row["wall_s"],
            "eval_loss": row["eval_loss"], "goodput": busy / span, "idle_fraction": 1 - busy / span,
            "steps": computed, "rounds_short": row["rounds_short"], "evals": evals,
            "stranded": row["stranded"]}


def _last_error(out: Path) -> str:
    """The last line of the first group output that ends in a Python error."""
    for f in sorted(out.glob("replica*.out")):
        lines = f.read_text(errors="replace").strip().splitlines()
        if lines and "Error" in lines[-1]:
            return f"{f.name}: {lines[-1][:200]}"
    return ""


def _reached(metrics: Path, step: int) -> bool:
    return any(x.get("step", 0) >= step for x in ft.jsonl(metrics))


def span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return (fmt % lo) if fmt % lo == fmt % hi else f"{fmt % lo}–{fmt % hi}"


def ratio(rows: list[dict], base: dict) -> str:
    """The rows' wall-clock over the unslowed synchronous fleet's of the same repetition (a dash
    where that fleet was not run)."""
    if any(r["rep"] not in base for r in rows):
        return "–"
    return span([r["wall_s"] / base[r["rep"]] for r in rows], "%.2f") + "×"


def equal_wall(rows: list[dict]) -> dict[str, float]:
    """For each speeds, T: the time at which its quickest run (of every method and repetition;
    a failed one has no evaluations) made its last evaluation on datacenter 0: no run has ended
    before T, and each one's model at T is its last evaluation by then."""
    out = {}
    for r in rows:
        if r.get("evals"):
            last = r["evals"][-1][0]
            out[r["speeds"]] = min(out.get(r["speeds"], last), last)
    return out


def at(r: dict, t: float) -> float | None:
    """The run's eval loss at ``t`` seconds into datacenter 0's job: the delivered model's where
    the whole fleet had ended by then (its wall-clock, from before that job started, at most
    ``t``), else datacenter 0's last evaluation by then."""
    if r.get("eval_loss") is not None and r["wall_s"] <= t:
        return r["eval_loss"]
    seen = [e[2] for e in r.get("evals") or [] if e[0] <= t]
    return seen[-1] if seen else None


def equal(rows: list[dict], t: float | None) -> str:
    """The rows' eval loss at ``t`` (:func:`at`), with ``t``; a dash without evaluations."""
    seen = [at(r, t) for r in rows] if t is not None else []
    if not seen or None in seen:
        return "–"
    return f"{span(seen, '%.4f')} at {t:.1f} s"


def synchronous_end(rows: list[dict]) -> dict[str, float]:
    """For each speeds, the time at which synchronous DiLoCo's quickest run of it made its last
    evaluation on datacenter 0 (where the run has ``diloco`` rows with evaluations)."""
    return equal_wall([r for r in rows if r["method"] == "diloco"])


def stranded(rows: list[dict]) -> str:
    """torchft's groups left running after the others ended, too few for a quorum (stopped:
    :meth:`fleet_vs_torchft.Torchft.supervise`), as a note for the steps column."""
    hit = [r["stranded"] for r in rows if r.get("stranded")]
    groups = sorted({g for s in hit for g in s})
    return f" (group {', '.join(map(str, groups))} stranded in {len(hit)} of {len(rows)} runs)" \
        if hit else ""


def table(rows: list[dict]) -> str:
    base = {r["rep"]: r["wall_s"] for r in rows if r["method"] == "diloco" and r["speeds"] == "1,1,1"}
    when, ended = equal_wall(rows), synchronous_end(rows)
    lines = ["| method | speeds | wall-clock s | ÷ unslowed diloco | goodput | eval loss | "
             "eval loss at equal wall-clock | eval loss when diloco ended | "
             "steps computed (dc0, dc1, dc2) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for speeds in SPEEDS:
        for method in METHODS:
            mine = [r for r in rows if r["method"] == method and r["speeds"] == speeds]
            failed = [r for r in mine if "failed" in r]
            if failed:
                lines.append(f"| {method} | {speeds} | failed in {len(failed)} of {len(mine)} "
                             f"runs: {failed[0]['why'] or failed[0]['failed']} | | | | | | |")
            mine = [r for r in mine if "failed" not in r]
            if not mine:
                continue
            steps = sorted({tuple(r["steps"]) for r in mine})
            lines.append(f"| {method} | {speeds} | {span([r['wall_s'] for r in mine], '%.1f')} | "
                         f"{ratio(mine, base)} | "
                         f"{span([r['goodput'] for r in mine], '%.2f')} | "
                         f"{span([r['eval_loss'] for r in mine], '%.4f')} | "
                         f"{equal(mine, when.get(speeds))} | "
                         f"{equal(mine, ended.get(speeds))} | "
                         f"{'; '.join(str(list(s)) for s in steps)}{stranded(mine)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/fleet-speeds"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--period", type=int, default=10)
    ap.add_argument("--speeds", default=";".join(SPEEDS),
                    help="';'-separated, e.g. 1,1,1;1,1,0.5;1,1,flaky")
    ap.add_argument("--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS))
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--eval-every", type=int, default=0,
                    help="datacenter 0 (torchft's group 0) also evaluates every N steps: the "
                         "table's eval loss at equal wall-clock")
    ap.add_argument("--table", type=Path, metavar="RESULTS",
                    help="print the table of an earlier run's results.json and exit")
    ap.add_argument("--place", choices=("local", "wan"), default="local",
                    help="wan: the emulated WAN that is up (lowcomm wan up --dcs 3): datacenter r "
                         "(torchft's group r) in its namespace, the coordinator (the lighthouse) "
                         "in datacenter 0's")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(a.table.read_text())["rows"]))
        return 0
    # a SIGTERM (timeout, a scheduler) unwinds like Ctrl-C: torchft's lighthouse and groups stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    methods = a.methods.split(",")
    if set(methods) - set(METHODS):
        ap.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))}; known: {list(METHODS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()]
    rows = []
    for rep in range(a.repeats):
        for speeds in a.speeds.split(";"):
            for method in methods:
                r = one(a.out / f"{method.replace(' ', '_')}-{speeds.replace(',', '_')}-{rep}",
                        method, speeds,
                        a.steps, a.period, a.extra, a.place, a.eval_every)
                rows.append(dict(r, rep=rep))
                print(json.dumps(rows[-1]), flush=True)
    load.append(os.getloadavg())
    (a.out / "results.json").write_text(json.dumps({"rows": rows, "load": load}, indent=1))
    print(table(rows))
    print(f"load before {load[0]}, after {load[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
