"""What a fleet's run leaves behind (:mod:`lowcomm.run.fleet`): ``OUT/summary.json`` and
``OUT/metrics.jsonl`` from the datacenters' own run folders and the coordinator's log
(``OUT/membership.jsonl``).

The summary holds the run's result (the model of the datacenters that finished: their
``state_sha256`` must agree, ``dcs_agree``), the bytes of every datacenter (the heal traffic is
in its ledger, op ``heal``), and under ``fleet``:

* ``membership``: every committed round — its number, tag
  (:class:`~lowcomm.comm.round_tag.RoundTag`: ``t40.f0``, fragment 0 at step 40; ``t40.admit``,
  an admission), step, members, the datacenters admitted in it and the attempts it took;
* ``failures``: every datacenter counted out — cause, how it was detected (its job ended, or
  the coordinator found it silent for ``silent_s``), the round and step;
* ``heals``: every datacenter admitted back — step, round, bytes of state, seconds from its
  hello to training again, and the seconds since its failure was detected and the
  synchronisation rounds the others committed meanwhile (``rounds_since_failure``);
* ``steps_lost``: per datacenter that never failed, the inner steps whose work no committed
  round took (a round committed without it while it was alive, times the period): 0 is the goal;
* ``left_out``, ``fallbacks`` (restarts from checkpoints after the coordinator was lost) and
  every incarnation of every datacenter's job (``started_t``: the wall-clock of its launch;
  ``resumed_from``: the checkpoint's step a resumed one started from);
* ``time``: each datacenter's steps, samples, tokens and busy and idle seconds, and the fleet's
  ``goodput`` (training seconds over the members' available seconds, :func:`goodput`);
* ``stopped`` (a fleet stopped by a signal): the signal, the step every datacenter wrote a
  checkpoint of and the command that continues the run.

``metrics.jsonl`` holds the datacenters' metrics lines (``dc``, ``inc`` added: each line once,
credited to the incarnation that ran its step) and one line per
round, failure and heal (``event``), ordered by step.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

from ...comm.round_tag import RoundTag, TagKind
from ..folder import json_text, write_text


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass                                 # a line a kill cut short
    return out


def numbered(events: list[dict]) -> list[dict]:
    """The log's events with rounds numbered across the coordinator's lifetimes (one that
    replaced a lost coordinator counts its rounds from 0 again)."""
    out, base, seen = [], 0, 0
    for e in events:
        if e["event"] == "start":
            base = seen
        elif "round" in e:
            e = dict(e, round=e["round"] + base)
            seen = max(seen, e["round"] + (e["event"] == "commit"))
        out.append(e)
    return out


def rounds(events: list[dict]) -> list[dict]:
    """The committed rounds, in order, with the decision each committed."""
    decided, out = {}, []
    for e in events:
        if e["event"] == "decision":
            decided[(e["round"], e["attempt"])] = e
        elif e["event"] == "commit":
            d = decided.get((e["round"], e["attempt"]), {})
            step = RoundTag.parse(e["tag"]).step
            out.append({"round": e["round"], "tag": e["tag"], "step": step,
                        "members": e["members"], "joiners": d.get("joiners", []),
                        "attempts": e["attempt"] + 1, "t": e["t"]})
    return out


def failures_and_heals(events: list[dict], committed: list[dict]) -> tuple[list, list]:
    """The failures and heals of the log, each with the step it happened at."""
    step_of = {r["round"]: r["step"] for r in committed}
    failures, heals, last_failure = [], [], {}
    for e in events:
        if e["event"] == "failure":
            f = {k: e[k] for k in ("dc", "inc", "cause", "was", "round", "silent_s", "t")}
            f["detected_by"] = "the coordinator (silent)" if e.get("kill") else "its job ended"
            f["step"] = step_of.get(e["round"], step_of.get(e["round"] - 1))
            failures.append(f)
            last_failure[e["dc"]] = f
        elif e["event"] == "heal":
            h = {k: e[k] for k in e if k != "event"}
            f = last_failure.get(e["dc"])
            if f is not None:
                h["since_failure_s"] = round(e["t"] - f["t"], 3)
                h["rounds_since_failure"] = len([r for r in committed if f["t"] < r["t"] and
                                                 RoundTag.parse(r["tag"]).kind is TagKind.SYNC
                                                 and r["step"] <= e["step"]])
            heals.append(h)
    return failures, heals


def steps_lost(fleet, committed: list[dict], failed: set[int]) -> dict:
    """Per datacenter that never failed: the inner steps no committed round took its work of."""
    period = fleet.plan.period
    out = {}
    for dc in range(fleet.dcs):
        if dc in failed:
            continue
        missed = [r for r in committed if dc not in r["members"] and
                  RoundTag.parse(r["tag"]).fragment is not None]    # a round of its work
        out[str(dc)] = len(missed) * period
    return out


def incarnations(fleet) -> list[tuple[dict, object, list[dict]]]:
    """Every incarnation — a resumed fleet's earlier ones (from its marker), then this run's —
    as ``(dc and inc, its job or None, its own metrics lines)``. A folder is read once: a
    job resumed from a checkpoint in the folder of an earlier one appends to its metrics, so
    each incarnation owns the lines after the step it started from, up to the next one's."""
    known = [({"dc": x["dc"], "inc": x["inc"]}, None, fleet.out / x["folder"],
              x.get("resumed_from")) for x in fleet.earlier]
    known += [({"dc": j.dc, "inc": j.inc}, j, j.folder, j.resumed_from) for j in fleet.history]
    folders: dict[Path, list] = {}
    for k in known:
        folders.setdefault(Path(k[2]), []).append(k)
    out = []
    for folder, group in folders.items():
        lines = [x for x in _metrics(folder) if "step" in x]
        for i, (who, job, _, start) in enumerate(group):
            lo = start if i and start is not None else float("-inf")
            hi = group[i + 1][3] if i + 1 < len(group) and group[i + 1][3] is not None \
                else float("inf")
            out.append((who, job, [x for x in lines if lo < x["step"] <= hi]))
    return out


def datacenters(fleet) -> dict:
    """Every incarnation of every datacenter's job, with the steps its metrics reached."""
    out: dict[str, list] = {}
    for _, job, lines in incarnations(fleet):
        if job is None:
            continue
        rec = job.record()
        rec["first_step"] = lines[0]["step"] if lines else None
        rec["last_step"] = lines[-1]["step"] if lines else None
        out.setdefault(str(job.dc), []).append(rec)
    return out


TIME_KEYS = ("steps", "samples", "tokens", "run_s", "idle_s", "rounds_s", "busy_s")


def goodput(fleet) -> dict:
    """Each datacenter's steps, samples, tokens and seconds over its incarnations — ``run_s``
    from its loop's start, ``idle_s`` waiting for the others at rounds, ``rounds_s`` in rounds
    (waits and reductions), ``busy_s`` the rest (training) — and the fleet's ``goodput``, the
    busy seconds over the members' available ones (their ``run_s``), with ``idle_fraction``.
    A finished incarnation's figures are its summary's; one that failed, its last metrics
    line's (its steps after that line are lost with it)."""
    by_dc: dict[str, dict] = {}
    for who, job, lines in incarnations(fleet):
        s = _json(job.folder / "summary.json") if job is not None and job.done else None
        t = (s or {}).get("fleet", {}).get("time")
        if t is None:
            timed = [x for x in lines if "run_s" in x]
            if not timed:
                continue
            last = timed[-1]
            t = {"steps": last["step"] - lines[0]["step"] + 1, "samples": None,
                 "tokens": None, **{k: last[k] for k in ("run_s", "idle_s", "rounds_s")},
                 "busy_s": last["run_s"] - last["rounds_s"]}
        acc = by_dc.setdefault(str(who["dc"]), {k: 0 for k in TIME_KEYS})
        for k in TIME_KEYS:
            acc[k] = None if acc[k] is None or t.get(k) is None else acc[k] + t[k]
    run = sum(d["run_s"] for d in by_dc.values())
    return {"by_dc": {k: {**v, **{f: round(v[f], 3) for f in TIME_KEYS[3:]}}
                      for k, v in sorted(by_dc.items(), key=lambda kv: int(kv[0]))},
            "goodput": sum(d["busy_s"] for d in by_dc.values()) / run if run else None,
            "idle_fraction": sum(d["idle_s"] for d in by_dc.values()) / run if run else None}


def _result(fleet) -> tuple[dict, list[dict]]:
    """The summary of the datacenter that finished first in index order, and all finished."""
    done = []
    for job in fleet.history:
        s = _json(job.folder / "summary.json") if job.done else None
        if s is not None:
            done.append(s)
    if not done:
        return {}, []
    return done[0], done


def _bytes(fleet, finished: list[dict]) -> tuple[int, dict]:
    total, by_level = 0, {}
    for s in finished:
        total += s.get("bytes_total", 0)
        for lv, b in s.get("bytes_by_level", {}).items():
            by_level[lv] = by_level.get(lv, 0) + b
    for _, job, lines in incarnations(fleet):  # the ended ones: their last metrics line
        if job is not None and not job.done:
            lines = [x for x in lines if "bytes" in x]
            total += lines[-1]["bytes"] if lines else 0
    return total, by_level


def write_report(fleet, wall_s: float) -> dict:
    """Write ``OUT/summary.json`` and ``OUT/metrics.jsonl``; return the summary."""
    events = numbered(_events(fleet.out / "membership.jsonl"))
    committed = rounds(events)
    failures, heals = failures_and_heals(events, committed)
    head, finished = _result(fleet)
    total, by_level = _bytes(fleet, finished)
    failed = {f["dc"] for f in failures} | {j.dc for j in fleet.history
                                            if j.exit is not None and not j.done}
    shas = {s["state_sha256"] for s in finished}
    summary = {
        "method": head.get("method"), "task": head.get("task"), "ranks": fleet.np,
        "steps": fleet.cfg.steps, "params": head.get("params"), "dcs": fleet.dcs,
        "min_dcs": fleet.min_dcs, "final_loss": head.get("final_loss"),
        "eval_loss": head.get("eval_loss", float("nan")), "bytes_total": total,
        "bytes_by_level": by_level, "wall_s": wall_s, "state_sha256": head.get("state_sha256"),
        "dcs_agree": len(shas) == 1, "ranks_agree": all(s.get("ranks_agree") for s in finished),
        "finished_dcs": sorted({s["fleet"]["dc"] for s in finished}),
        "fleet": {"membership": [{k: v for k, v in r.items() if k != "t"} for r in committed],
                  "failures": failures, "heals": heals,
                  "steps_lost": steps_lost(fleet, committed, failed),
                  "left_out": [{"dc": d, "why": w} for d, w in sorted(fleet.retired.items())],
                  "fallbacks": fleet.fallbacks, "datacenters": datacenters(fleet),
                  "time": goodput(fleet), **arrivals(events)},
        "config": head.get("config"),
    }
    if fleet.stopping:
        summary["stopped"] = {"signal": signal.Signals(fleet.stopping).name,
                              "signum": int(fleet.stopping), "step": fleet.stopped_at(),
                              "resume": f"lowcomm train --dcs {fleet.dcs} --resume {fleet.out}"}
    write_text(fleet.out / "summary.json", json_text(summary))
    write_text(fleet.out / "metrics.jsonl", "".join(
        json.dumps(x) + "\n" for x in _merged(fleet, committed, failures, heals)))
    return summary


def arrivals(events: list[dict]) -> dict:
    """Under asynchronous DiLoCo: ``{"arrivals": {dc: the arrivals the server answered}}``
    (a datacenter's final one included); nothing for a fleet of rounds."""
    by: dict[str, int] = {}
    for e in events:
        if e["event"] == "arrival":
            by[str(e["dc"])] = by.get(str(e["dc"]), 0) + 1
    return {"arrivals": dict(sorted(by.items()))} if by else {}


def _merged(fleet, committed: list[dict], failures: list[dict], heals: list[dict]) -> list[dict]:
    lines = []
    for who, _, own in incarnations(fleet):
        lines += [{**who, **x} for x in own]
    lines += [{"event": "round", **r} for r in committed]
    lines += [{"event": "failure", **f} for f in failures]
    lines += [{"event": "heal", **h} for h in heals]
    return sorted(lines, key=lambda x: (x.get("step") if x.get("step") is not None else -1,
                                        "event" in x, x.get("t", 0)))


__all__ = ["arrivals", "failures_and_heals", "goodput", "incarnations", "numbered", "rounds", "steps_lost",
           "write_report"]
