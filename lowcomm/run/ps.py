"""The parameter server's part of the one training loop (``strategy.name = "async-ps"``):
servers serve, workers train, nobody waits for a collective.

:func:`lowcomm.run.loop.run` hands a run whose strategy is the parameter server to
:func:`run_async_ps` after building the model, the optimizer and the rank's role, because its
per-step reductions over all ranks are exactly what an asynchronous parameter server must not
do (servers do not train; workers never wait for each other). Workers take the loop's steps on
the task's batches. Outputs are the same files:

* ``steps`` is the run's budget in step-equivalents: the servers take ``steps × W`` gradients
  in all (what SyncDP's ``steps`` on W ranks computes), then answer STOP; fast workers do more
  steps than slow ones, and the survivors of a lost worker do its share.
* ``metrics.jsonl`` (rank 0 = server 0): one line per ``log_every × W`` gradients applied
  (``step`` counts step-equivalents of all W workers: gradients / W), with the mean training loss
  of those gradients, the samples, the bytes all ranks have sent so far, the mean staleness and
  the largest clock lag since the previous line, ``comm_s`` (rank 0's) and ``rounds`` (messages
  per rank) for ``lowcomm compare`` (and ``eval_loss`` every ``eval_every`` steps
  with one server, which then holds the whole model).
* ``summary.json``: train.py's keys plus ``servers``, ``workers``, ``staleness`` and
  ``clock_lag`` (distributions), ``workers_lost``, ``workers_finished``, ``status`` and
  ``samples_per_s``. Bytes of a lost worker are what the servers received from it.
* checkpoints every N steps (``max_staleness = 0`` only, where every rank passes step N
  together): every rank saves at step N — servers their shard, optimizer, versions and clocks;
  workers their clock and compressor state — and ``--resume`` continues bit-identically.
* SIGINT/SIGTERM, at any ``max_staleness``, on any rank: the servers answer STOP from then on (a
  worker that got the signal tells them with its end-of-run message), so every worker ends after
  the step it is in and nothing is in flight; rank 0 then tells every live rank to write one
  final checkpoint (named after the step-equivalents the servers have taken, gradients / W) and
  every rank exits with 128 + signal. It holds the model as the servers' shards with their
  optimizer state, versions, clocks and each worker's read version; each worker's own step (its
  batch sequence), clock, compressor state, RNG and the parameters it last pulled. ``--resume``
  continues from there; for τ > 0 the run is not bit-identical to an uninterrupted one (the
  interleaving of asynchronous updates is timing's), and with τ = 0 the round in which the stop
  arrives may run on fewer workers. With a lost worker no final checkpoint can be written (it
  needs every rank): the run says so and exits 128 + signal.

At the end the other servers send rank 0 their shard and counters, the finished workers their
ledgers, all point-to-point: a lost worker cannot hold the end of the run up. Rank 0 then sends
the final parameters to every live rank, which loads them and answers their sha256: the summary's
``ranks_agree`` says every live rank holds the delivered model (``final_model_bytes``: what that
delivery sent, on the uncharged control channel).
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path


from ..comm.comm import Comm
from ..errors import LowcommError, NonFiniteError
from ..comm.ledger import compute_cpu_clock
from .evaluate import evaluate, nonfinite, state_sha256
from .signals import Interrupted, StopFlag
from .snapshot import restore, snapshot
from ..strategies.async_ps import AsyncPS
from ..strategies.ps.protocol import PUSH, ServerLost, WorkersLost, recovery_enabled

log = logging.getLogger("lowcomm.train")
TAG_STATS = 77
TAG_FINAL = 78          # rank 0 -> every live rank: the run's final parameters
TAG_AGREE = 79          # every live rank -> rank 0: the sha256 of the parameters it now holds


def _hist(h: dict) -> dict:
    """``{σ: count}`` → ``{"hist": {"σ": count}, "mean", "max", "count"}`` (JSON keys are text)."""
    n = sum(h.values())
    return {"hist": {str(k): h[k] for k in sorted(h)}, "count": n,
            "mean": sum(k * v for k, v in h.items()) / n if n else float("nan"),
            "max": max(h) if h else None}


def _merge(hists: list[dict]) -> dict:
    out: dict[int, int] = {}
    for h in hists:
        for k, v in h.items():
            out[int(k)] = out.get(int(k), 0) + v
    return out


def _recv_from(ctl: Comm, src: int, timeout_s: float, what: str, tag: int = TAG_STATS):
    """Receive a pickled end-of-run message from ``src`` on the control channel, or raise
    naming ``src``."""
    t0 = time.monotonic()
    while ctl.iprobe(src, tag) is None:
        if time.monotonic() - t0 > timeout_s:
            raise ServerLost(f"rank {ctl.rank}: rank {src} ({what}) sent no end-of-run message "
                             f"for {timeout_s:g} s; it is gone, ending the job")
        time.sleep(0.001)
    return ctl.recv_object(src, tag)


def _send_sync(ctl: Comm, obj, dest: int, tag: int, timeout_s: float, what: str) -> None:
    """Send ``obj`` synchronously (so that this process may end at once after)."""
    req = ctl.issend_object(obj, dest, tag)
    t0 = time.monotonic()
    while not req.test():
        if time.monotonic() - t0 > timeout_s:
            raise ServerLost(f"rank {ctl.rank}: rank {dest} ({what}) took no end-of-run message "
                             f"for {timeout_s:g} s; it is gone, ending the job")
        time.sleep(0.001)


def _report_to_rank0(ctl: Comm, report: dict, timeout_s: float) -> None:
    _send_sync(ctl, report, 0, TAG_STATS, timeout_s, "parameter server 0")


def _take_final_model(ctl: Comm, model, timeout_s: float) -> dict | None:
    """Every live rank but 0: load the run's final model from rank 0, answer its hash;
    or, when the run was stopped by a signal, return rank 0's notice (``{"signum", "step",
    "save"}``) instead."""
    final = _recv_from(ctl, 0, timeout_s, "parameter server 0", TAG_FINAL)
    if "model" not in final:
        return final
    model.load_state_dict(final["model"])
    _send_sync(ctl, state_sha256(model), 0, TAG_AGREE, timeout_s, "parameter server 0")
    return None


def _deliver_final_model(ctl: Comm, model, ranks: list[int], timeout_s: float) -> tuple[bool, int]:
    """Rank 0: send the final model (its whole state: parameters and buffers) to ``ranks`` (the
    live ones) and check that each now holds it (its sha256 equals ours). Returns (every rank
    agrees, bytes sent)."""
    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for r in ranks:
        _send_sync(ctl, {"model": final}, r, TAG_FINAL, timeout_s, f"rank {r}")
    mine = state_sha256(model)
    same = all(_recv_from(ctl, r, timeout_s, f"rank {r}", TAG_AGREE) == mine for r in ranks)
    return same, len(ranks) * sum(t.numel() * t.element_size() for t in final.values())


def _skip_mpi_finalize(code: int) -> None:
    """Under mpirun ``--enable-recovery``, end this process at exit with status ``code`` and
    without ``MPI_Finalize``: after a rank died, Open MPI 4.1's finalize can wait forever for it
    (its closing fence includes the dead process; seen here in about 1 run in 3). Every message
    this rank sent has been received by then (synchronous sends), and every file is written."""
    if not recovery_enabled():       # nothing can have died without ending the job
        return

    def bye():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    atexit.register(bye)


def run_async_ps(cfg, task, model, ps: AsyncPS, comm: Comm, ctl: Comm, out: Path | None, ckpt,
                 progress: bool = True, resume: str | Path | None = None) -> dict:
    """The part of :func:`lowcomm.run.loop.run` that is the parameter server's: servers serve,
    workers train; rank 0 returns (and writes) the summary, other ranks their own counters.
    Raises :class:`WorkersLost` (exit status 4) on rank 0, after writing the summary, when
    workers were lost."""
    rank, K, s = comm.rank, comm.size, ps
    n_params = sum(p.numel() for p in model.parameters())
    held_out = task.eval_batches(cfg) if cfg.eval_batches else []
    S, W, B = ps.servers, ps.workers, cfg.batch_size
    if rank == 0 and recovery_enabled() is False:
        log.warning("async-ps: Open MPI's mpirun ends the whole job when any rank dies; launch "
                    "with --enable-recovery (e.g. LOWCOMM_MPIRUN_ARGS=--enable-recovery "
                    "launchers/local.sh ...) for the servers to outlive a lost worker")

    # rank 0's log of the run (restored on resume)
    lg = {"gradients": 0, "samples": 0, "skipped": 0, "window": [], "sigma": [], "lag": 0,
          "traffic": [0.0] * W, "recent": float("nan"), "step": 0}
    wloop = {"skipped": 0, "wall_s": 0.0}
    first = 1
    if resume:
        step, loop = restore(resume, cfg, comm, ctl, model, ps, out)
        (lg if ps.is_server else wloop).update(loop)   # on W workers (Server.reshard folds it)
        first = (step if ps.is_server else wloop.get("step", step)) + 1   # a worker's own steps
    every = cfg.checkpoint.every if ckpt else 0

    def save(step: int, loop: dict):
        return ckpt.save(step, snapshot(model, ps, comm, loop), cfg.to_dict())

    def stopped(notice: dict, loop: dict):
        """Stopped by a signal: every live rank writes the final checkpoint (rank 0's notice
        names its step), then raises Interrupted (exit status 128 + signal)."""
        where = save(notice["step"], loop) if notice["save"] else None
        if notice["save"] is False and ckpt is not None and rank == 0:
            log.error("async-ps: workers were lost, so no final checkpoint can be written (it "
                      "needs every rank); resume from the last one, if any")
        raise Interrupted(notice["signum"], notice["step"], where)

    ctl.barrier()
    t0 = time.perf_counter()
    wall_before = lg.get("wall_s", 0.0) if ps.is_server else wloop["wall_s"]
    if ps.is_server:
        metrics = open(out / "metrics.jsonl", "a" if resume else "w") if out and rank == 0 else None
        bar = None
        if progress and rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=first - 1, desc=cfg.method, unit="step",
                       dynamic_ncols=True, mininterval=1.0)
        self_comm = Comm.self_comm(comm.watchdog)
        rounds = [first - 1]

        def line(step: int) -> None:
            w = lg["window"]
            lg["recent"] = sum(w) / len(w) if w else float("nan")
            row = {"step": step, "samples": lg["samples"], "loss": lg["recent"],
                   "bytes": int(sum(lg["traffic"])), "wall_s": wall_before + time.perf_counter() - t0,
                   "staleness_mean": sum(lg["sigma"]) / len(lg["sigma"]) if lg["sigma"] else 0.0,
                   "clock_lag_max": lg["lag"],
                   # for lowcomm compare's α–β model: rank 0's communication seconds, and the
                   # message rounds per rank (a push and a pull per gradient and server)
                   "comm_s": comm.ledger.totals()["seconds"], "rounds": 2 * lg["gradients"] * S / K}
            if cfg.eval_batches and cfg.eval_every and step % cfg.eval_every == 0 and S == 1:
                row["eval_loss"] = evaluate(model, task, held_out, self_comm)
            lg["window"], lg["sigma"], lg["lag"], lg["step"] = [], [], 0, step
            if metrics:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            if bar:
                bar.set_postfix(loss=f"{lg['recent']:.3f}", MB=f"{row['bytes'] / 1e6:.1f}")

        def on_update(entries) -> None:
            if rank == 0:
                srv = ps.server
                for w, h, sigma in entries:
                    lg["gradients"] += 1
                    if sigma is not None:
                        lg["sigma"].append(sigma)
                    if h[0] == PUSH:
                        lg["samples"] += B
                        lg["window"].append(float(h[2]))
                    else:
                        lg["skipped"] += 1
                    lg["traffic"][w] = float(h[3] + h[4])
                lg["lag"] = max(lg["lag"], srv.lag_since)
                srv.lag_since = 0
                step = lg["gradients"] // W
                if step > lg["step"] and (step % cfg.log_every == 0):
                    line(step)
                if bar:
                    bar.n = min(step, cfg.steps)
                    bar.refresh()
            if ps.max_staleness == 0 and not ps.server.interrupt:   # a stop: saved at the end
                if every and ps.server.lost:
                    raise LowcommError(f"worker(s) {sorted(ps.server.lost)} lost: a checkpointed "
                                       "synchronous run needs every worker at every checkpoint; "
                                       "resume from the last checkpoint with --resume")
                rounds[0] += 1
                if every and rounds[0] % every == 0 and rounds[0] < cfg.steps:
                    save(rounds[0], {**lg, "wall_s": wall_before + time.perf_counter() - t0}
                         if rank == 0 else {})

        early: dict[int, dict] = {}   # end-of-run reports that arrive while rank 0 still serves

        def on_idle() -> None:
            if stop.signum:
                ps.server.stop(stop.signum)
            while rank == 0 and (msg := ctl.iprobe(Comm.ANY_SOURCE, TAG_STATS)) is not None:
                early[msg[0]] = ctl.recv_object(msg[0], TAG_STATS)

        try:
            with StopFlag() as stop:
                ps.serve(on_update, on_idle)
        finally:
            if bar:
                bar.close()
        wall = wall_before + time.perf_counter() - t0
        if rank == 0 and lg["window"]:
            line(max(lg["step"] + 1, math.ceil(lg["gradients"] / W)))
        if metrics:
            metrics.close()
        srv = ps.server
        if rank != 0:
            limit = s.server_timeout_s + s.worker_timeout_s + 30
            _report_to_rank0(ctl, {"stats": srv.stats(), "ledger": comm.ledger.rows(), "wall_s": wall,
                                   "values": srv.flat, "signum": srv.interrupt}, limit)
            notice = _take_final_model(ctl, model, limit)
            if notice:
                ps.close()
                stopped(notice, {})
            ps.close()
            _skip_mpi_finalize(0)
            return {"method": cfg.method, "rank": rank, "role": "server", **srv.stats()}
        # rank 0: assemble the model and the summary
        reports = [{"stats": srv.stats(), "ledger": comm.ledger.rows(), "wall_s": wall}]
        limit = s.server_timeout_s + s.worker_timeout_s + 30
        for r in range(1, S):
            rep = early.pop(r) if r in early else _recv_from(ctl, r, limit, f"parameter server {r}")
            ps.load_shard(r, rep["values"])
            reports.append(rep)
        lost: dict[int, dict] = {}
        for rep in reports:
            for w, info in rep["stats"]["lost"].items():
                lost.setdefault(int(w), info)
        finished = sorted(w for w in srv.done if w not in lost)
        for w in finished:
            reports.append(early.pop(S + w) if S + w in early else
                           _recv_from(ctl, S + w, limit, f"worker {w}"))
        signum = max([srv.interrupt, *(rep.get("signum", 0) for rep in reports)])
        if signum:                  # stopped on request: a final checkpoint instead of the end
            notice = {"signum": signum, "step": srv.taken // W,
                      "save": (not lost) if ckpt is not None else None}
            for r in [*range(1, S), *(S + w for w in finished)]:
                _send_sync(ctl, notice, r, TAG_FINAL, limit, f"rank {r}")
            ps.close()
            stopped(notice, {**lg, "wall_s": wall})
        agree, delivered = _deliver_final_model(ctl, model, [*range(1, S), *(S + w for w in finished)],
                                                limit)
        ps.close()
        _skip_mpi_finalize(WorkersLost.exit_code if lost else 0)
        return _summary(cfg, model, task, held_out, comm, ps, reports, lost, finished,
                        n_params, lg, max(r["wall_s"] for r in reports), out, agree, delivered)

    # worker ---------------------------------------------------------------------------------
    w = ps.index
    skipped = wloop["skipped"]
    step = first - 1
    compute = wloop.get("compute_cpu_s", 0.0 if not resume else float("nan"))
    c0 = compute_cpu_clock()
    try:
        with StopFlag() as stop:
            for step in itertools.count(first):   # until a server says the budget is spent
                compute += compute_cpu_clock() - c0     # the step before, ended however it ended
                c0 = compute_cpu_clock()
                batch = task.batch(step, w, W, cfg)
                ps.zero_grad()
                loss = task.loss(model, batch)
                value = loss.item()
                ps.note_loss(value)
                if not math.isfinite(value):
                    if cfg.on_nonfinite != "skip":
                        raise NonFiniteError(rank, "the loss", step)
                    log.warning("rank %d step %d: the loss is not finite; this worker skips the "
                                "step", rank, step)
                    ps.skip()
                    skipped += 1
                else:
                    loss.backward()           # full shards are pushed from inside the backward pass
                    bad = nonfinite(loss, model)
                    if bad and cfg.on_nonfinite == "skip":
                        log.warning("rank %d step %d: %s is not finite; this worker skips the step",
                                    rank, step, bad)
                        ps.skip()
                        skipped += 1
                    elif bad:
                        raise NonFiniteError(rank, bad, step)
                    else:
                        ps.step()
                if ps.stopped:            # the budget is spent, or a stop was asked for
                    break
                if every and step % every == 0:
                    save(step, {"skipped": skipped, "step": step,
                                "wall_s": wall_before + time.perf_counter() - t0,
                                "compute_cpu_s": compute + compute_cpu_clock() - c0})
                if stop.signum:           # after the step's exchange: nothing left in flight
                    break
            compute += compute_cpu_clock() - c0
            ps.done(stop.signum)
    finally:
        ps.close()
    wall = wall_before + time.perf_counter() - t0
    mine = {"worker": w, "ledger": comm.ledger.rows(), "wall_s": wall, "compute_cpu_s": compute,
            "skipped": skipped,
            "clock_lag": dict(ps.lag_hist), "wait_s": ps.wait_s, "clock": ps.clock,
            "signum": stop.signum}
    _report_to_rank0(ctl, mine, s.server_timeout_s + 30)   # rank 0 takes it while serving
    notice = _take_final_model(ctl, model, s.server_timeout_s + s.worker_timeout_s + 30)
    if notice:                    # this worker's own step: it resumes its own batch sequence
        stopped(notice, {"skipped": skipped, "step": step, "wall_s": wall, "compute_cpu_s": compute})
    _skip_mpi_finalize(0)
    return {"method": cfg.method, "rank": rank, "role": "worker", **{k: v for k, v in mine.items()
                                                                     if k != "ledger"}}


def _summary(cfg, model, task, held_out, comm, ps, reports, lost, finished, n_params, lg,
             wall, out, agree: bool, delivered: int):
    S, W = ps.servers, ps.workers
    self_comm = Comm.self_comm(comm.watchdog)
    eval_loss = evaluate(model, task, held_out, self_comm) if held_out else float("nan")
    by_level: dict[str, int] = {}
    for rep in reports:
        for row in rep["ledger"]:
            by_level[row["level"]] = by_level.get(row["level"], 0) + row["bytes_sent"]
    servers = [r["stats"] for r in reports[:S]]
    lost_bytes = sum(st["recv_from"][w] for st in servers for w in lost)
    if lost_bytes:
        by_level[comm.level] = by_level.get(comm.level, 0) + lost_bytes
    total = sum(by_level.values())
    applied = servers[0]["applied"]
    samples = sum(applied) * cfg.batch_size
    summary = {
        "method": cfg.method, "task": task.where, "ranks": comm.size, "steps": cfg.steps, "params": n_params,
        "final_loss": lg["recent"], "eval_loss": eval_loss,
        "bytes_total": int(total), "bytes_by_level": {k: int(v) for k, v in sorted(by_level.items())},
        "bytes_per_step_per_rank": total / comm.size / cfg.steps,
        "wall_s": wall, "compute_cpu_s": max((r["compute_cpu_s"] for r in reports[S:]),
                                             default=float("nan")),
        "samples": samples, "samples_per_s": samples / wall if wall > 0 else float("nan"),
        "skipped_steps": sum(servers[0]["skipped"]),
        "servers": S, "workers": W, "max_staleness": ps.max_staleness,
        "staleness_lr": ps.staleness_lr, "dc_lambda": ps.dc_lambda,
        "shard_numel": [sh.numel for sh in ps.shards],
        "resizes": lg.get("resizes", []),
        "gradients_per_worker": applied,
        "staleness": _hist(_merge([st["staleness"] for st in servers])),
        "clock_lag": _hist(_merge([st["clock_lag"] for st in servers])),
        "workers_finished": len(finished),
        "workers_lost": [lost[w] for w in sorted(lost)],
        "status": "ok" if not lost else f"{len(lost)} of {W} workers lost",
        "mpirun_recovery": recovery_enabled(),
        "state_sha256": state_sha256(model),
        "ranks_agree": agree,                 # every live rank holds these parameters
        "final_model_bytes": delivered,       # rank 0 sent them there (control channel)
        "ledger_rank0": comm.ledger.rows(),
        "config": cfg.to_dict(),
    }
    if out:
        (Path(out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if lost:
        names = ", ".join(f"worker {i['worker']} (rank {i['rank']}, after {i['clock']} gradients)"
                          for i in summary["workers_lost"])
        raise WorkersLost(f"async-ps finished with {len(finished)} of {W} workers; lost: {names}; "
                          f"summary written" + (f" to {Path(out) / 'summary.json'}" if out else ""))
    return summary
