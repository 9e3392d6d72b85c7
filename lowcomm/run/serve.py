"""The parameter server's server ranks in a run (``strategy.name = "async-ps"``): they serve
while the workers take the one loop's steps (:class:`~lowcomm.run.lockstep.Detached`), and
rank 0 — server 0 — keeps the run's log and writes its files. Outputs are every run's files:

* ``steps`` is the run's budget in step-equivalents: the servers take ``steps × W`` gradients
  in all (what SyncDP's ``steps`` on W ranks computes), then answer STOP; fast workers do more
  steps than slow ones, and the survivors of a lost worker do its share.
* ``metrics.jsonl`` (rank 0): one line per ``log_every × W`` gradients applied (``step`` counts
  step-equivalents of all W workers: gradients / W), with the mean training loss of those
  gradients, the samples, the bytes all ranks have sent so far, the mean staleness and the
  largest clock lag since the previous line, ``comm_s`` (rank 0's) and ``rounds`` (messages per
  rank) for ``lowcomm compare`` (and ``eval_loss`` every ``eval_every`` steps with one server,
  which then holds the whole model).
* ``summary.json``: every run's keys plus ``servers``, ``workers``, ``staleness`` and
  ``clock_lag`` (distributions), ``workers_lost``, ``workers_finished``, ``status`` and
  ``samples_per_s``. Bytes of a lost worker are what the servers received from it.
* checkpoints every N steps (``max_staleness = 0`` only, where every rank passes step N
  together): servers save their shard, optimizer, versions and clocks; workers their clock and
  compressor state — and ``--resume`` continues bit-identically.
* SIGINT/SIGTERM, at any ``max_staleness``, on any rank: the servers answer STOP from then on (a
  worker that got the signal tells them with its end-of-run message), so every worker ends after
  the step it is in and nothing is in flight; rank 0 then tells every live rank to write one
  final checkpoint (named after the step-equivalents the servers have taken, gradients / W) and
  every rank exits with 128 + signal. ``--resume`` continues from there; for τ > 0 the run is not
  bit-identical to an uninterrupted one (the interleaving of asynchronous updates is timing's).
  With a lost worker no final checkpoint can be written (it needs every rank).

At the end the other servers send rank 0 their shard and counters, the finished workers their
ledgers, all point-to-point: a lost worker cannot hold the end of the run up. Rank 0 then sends
the final model (its whole state) to every live rank, which loads it and answers its sha256: the
summary's ``ranks_agree`` says every live rank holds the delivered model (``final_model_bytes``:
what that delivery sent, on the uncharged control channel).
"""
from __future__ import annotations

import logging
import math

from ..comm.comm import Comm
from ..errors import LowcommError
from ..strategies.ps.async_ps import PUSH, WorkersLost, recovery_enabled
from .lockstep import Coordination
from .ending import (TAG_FINAL, TAG_STATS, deliver_final_model, recv_from, report_to_rank0,
                     send_sync, skip_mpi_finalize, stopped, take_final_model)
from .evaluate import evaluate, state_sha256
from .folder import write_summary
from .signals import StopFlag
from .state import Run

log = logging.getLogger("lowcomm.train")


# a server rank's run ---------------------------------------------------------------------------
class Serving(Coordination):
    """One server rank's part of a run; rank 0 (server 0) also keeps the run's log. The loop's
    coordination (:class:`~lowcomm.run.lockstep.Coordination`) for what every run does — the
    resume, the clock, checkpoints, the progress bar and the checked metrics file — with the
    servers' log ``lg`` as the loop's counters."""

    def __init__(self, r: Run):
        super().__init__(r)
        self.ps = r.strategy
        self.S, self.W = self.ps.servers, self.ps.workers
        self.limit = self.ps.server_timeout_s + self.ps.worker_timeout_s + 30
        # rank 0's log of the run (restored on resume)
        self.lg = {"gradients": 0, "samples": 0, "skipped": 0, "window": [], "sigma": [], "lag": 0,
                   "traffic": [0.0] * self.W, "recent": float("nan"), "step": 0}
        self.rounds = 0                       # τ = 0: rounds applied (checkpoint steps)
        self.early: dict[int, dict] = {}      # end-of-run reports that arrive while serving
        self.stop = None

    def start(self) -> None:
        r = self.r
        if r.comm.rank == 0 and recovery_enabled() is False:
            log.warning("async-ps: Open MPI's mpirun ends the whole job when any rank dies; "
                        "launch with --enable-recovery (e.g. LOWCOMM_MPIRUN_ARGS=--enable-recovery "
                        "launchers/local.sh ...) for the servers to outlive a lost worker")
        super().start()
        self.open_log(self.rounds)

    def resumed(self, step: int, loop: dict) -> float:
        self.lg.update(loop)          # on W workers (ParameterServer.reshard folds it)
        self.rounds = step
        return self.lg.get("wall_s", 0.0)

    def loop_state(self) -> dict:
        """Rank 0's log (the other servers keep none), the clock brought up to now."""
        return {**self.lg, "wall_s": self.wall()} if self.r.comm.rank == 0 else {}

    # while serving ------------------------------------------------------------------------------
    def line(self, step: int) -> None:
        """Rank 0: one metrics line for the gradients since the previous one."""
        lg, r = self.lg, self.r
        w = lg["window"]
        lg["recent"] = sum(w) / len(w) if w else float("nan")
        row = {"step": step, "samples": lg["samples"], "loss": lg["recent"],
               "bytes": int(sum(lg["traffic"])), "wall_s": self.wall(),
               "staleness_mean": sum(lg["sigma"]) / len(lg["sigma"]) if lg["sigma"] else 0.0,
               "clock_lag_max": lg["lag"],
               # for lowcomm compare's α–β model: rank 0's communication seconds, and the
               # message rounds per rank (a push and a pull per gradient and server)
               "comm_s": r.comm.ledger.totals()["seconds"],
               "rounds": 2 * lg["gradients"] * self.S / r.comm.size}
        if r.cfg.eval_batches and r.cfg.eval_every and step % r.cfg.eval_every == 0 and self.S == 1:
            row["eval_loss"] = evaluate(r.model, r.task, r.held_out, Comm.self_comm(r.comm.watchdog))
        lg["window"], lg["sigma"], lg["lag"], lg["step"] = [], [], 0, step
        self.write_metrics(row)
        if self.bar:
            self.bar.set_postfix(loss=f"{lg['recent']:.3f}", MB=f"{row['bytes'] / 1e6:.1f}")

    def on_update(self, entries) -> None:
        """After every update: rank 0 logs the gradients; with τ = 0 every server checkpoints
        every N rounds (every rank passes them together)."""
        r = self.r
        if r.comm.rank == 0:
            self._log_gradients(entries)
        if self.ps.max_staleness == 0 and not self.ps.server.interrupt:   # a stop: saved at the end
            every = r.cfg.checkpoint.every if r.ckpt else 0
            if every and self.ps.server.lost:
                raise LowcommError(f"worker(s) {sorted(self.ps.server.lost)} lost: a checkpointed "
                                   "synchronous run needs every worker at every checkpoint; resume "
                                   "from the last checkpoint with --resume")
            self.rounds += 1
            if every and self.rounds % every == 0 and self.rounds < r.cfg.steps:
                self.save(self.rounds)

    def _log_gradients(self, entries) -> None:
        lg, srv = self.lg, self.ps.server
        for w, h, sigma in entries:
            lg["gradients"] += 1
            if sigma is not None:
                lg["sigma"].append(sigma)
            if h[0] == PUSH:
                lg["samples"] += self.r.cfg.batch_size
                lg["window"].append(float(h[2]))
            else:
                lg["skipped"] += 1
            lg["traffic"][w] = float(h[3] + h[4])
        lg["lag"] = max(lg["lag"], srv.lag_since)
        srv.lag_since = 0
        step = lg["gradients"] // self.W
        if step > lg["step"] and step % self.r.cfg.log_every == 0:
            self.line(step)
        if self.bar:
            self.bar.n = min(step, self.r.cfg.steps)
            self.bar.refresh()

    def on_idle(self) -> None:
        if self.stop.signum:
            self.ps.server.stop(self.stop.signum)
        ctl = self.r.ctl
        while ctl.rank == 0 and (msg := ctl.iprobe(Comm.ANY_SOURCE, TAG_STATS)) is not None:
            self.early[msg[0]] = ctl.recv_object(msg[0], TAG_STATS)

    def serve(self) -> float:
        """Serve until every worker has finished or is lost; returns the wall-clock."""
        try:
            with StopFlag() as self.stop:
                self.ps.serve(self.on_update, self.on_idle)
            wall = self.wall()
            if self.r.comm.rank == 0 and self.lg["window"]:
                self.line(max(self.lg["step"] + 1, math.ceil(self.lg["gradients"] / self.W)))
        finally:
            self.close()
        return wall

    # the end ------------------------------------------------------------------------------------
    def end_other_server(self, wall: float) -> dict:
        """A server but rank 0: report to rank 0, take the final model (or the stop notice)."""
        r, srv = self.r, self.ps.server
        report_to_rank0(r.ctl, {"stats": srv.stats(), "ledger": r.comm.ledger.rows(), "wall_s": wall,
                                "values": srv.flat, "signum": srv.interrupt}, self.limit)
        notice = take_final_model(r.ctl, r.model, self.limit)
        self.ps.close()
        if notice:
            stopped(self, notice)
        skip_mpi_finalize(0)
        return {"method": r.cfg.method, "rank": r.comm.rank, "role": "server", **srv.stats()}

    def gather_reports(self, wall: float) -> tuple[list[dict], dict, list[int]]:
        """Rank 0: every other server's shard and counters, every finished worker's report."""
        srv, ctl = self.ps.server, self.r.ctl
        reports = [{"stats": srv.stats(), "ledger": self.r.comm.ledger.rows(), "wall_s": wall}]
        for s in range(1, self.S):
            rep = self.early.pop(s) if s in self.early else \
                recv_from(ctl, s, self.limit, f"parameter server {s}")
            self.ps.load_shard(s, rep["values"])
            reports.append(rep)
        lost: dict[int, dict] = {}
        for rep in reports:
            for w, info in rep["stats"]["lost"].items():
                lost.setdefault(int(w), info)
        finished = sorted(w for w in srv.done if w not in lost)
        for w in finished:
            reports.append(self.early.pop(self.S + w) if self.S + w in self.early else
                           recv_from(ctl, self.S + w, self.limit, f"worker {w}"))
        return reports, lost, finished

    def end_rank0(self, wall: float) -> dict:
        """Rank 0: assemble the model, stop everyone or deliver the model, write the summary."""
        reports, lost, finished = self.gather_reports(wall)
        live = [*range(1, self.S), *(self.S + w for w in finished)]
        signum = max([self.ps.server.interrupt, *(rep.get("signum", 0) for rep in reports)])
        if signum:                  # stopped on request: a final checkpoint instead of the end
            notice = {"signum": signum, "step": self.ps.server.taken // self.W,
                      "save": (not lost) if self.r.ckpt is not None else None}
            for rank in live:
                send_sync(self.r.ctl, notice, rank, TAG_FINAL, self.limit, f"rank {rank}")
            self.ps.close()
            stopped(self, notice)
        agree, delivered = deliver_final_model(self.r.ctl, self.r.model, live, self.limit)
        self.ps.close()
        skip_mpi_finalize(WorkersLost.exit_code if lost else 0)
        return self._summary(reports, lost, finished, max(rep["wall_s"] for rep in reports),
                             agree, delivered)

    def _summary(self, reports, lost, finished, wall, agree: bool, delivered: int) -> dict:
        r, ps, S, W = self.r, self.ps, self.S, self.W
        self_comm = Comm.self_comm(r.comm.watchdog)
        eval_loss = evaluate(r.model, r.task, r.held_out, self_comm) if r.held_out else float("nan")
        by_level: dict[str, int] = {}
        for rep in reports:
            for row in rep["ledger"]:
                by_level[row["level"]] = by_level.get(row["level"], 0) + row["bytes_sent"]
        servers = [rep["stats"] for rep in reports[:S]]
        lost_bytes = sum(st["recv_from"][w] for st in servers for w in lost)
        if lost_bytes:
            by_level[r.comm.level] = by_level.get(r.comm.level, 0) + lost_bytes
        total = sum(by_level.values())
        applied = servers[0]["applied"]
        samples = sum(applied) * r.cfg.batch_size
        summary = write_summary(r, {
            "final_loss": self.lg["recent"], "eval_loss": eval_loss,
            "bytes_total": int(total), "bytes_by_level": {k: int(v) for k, v in sorted(by_level.items())},
            "bytes_per_step_per_rank": total / r.comm.size / r.cfg.steps,
            "wall_s": wall, "compute_cpu_s": max((rep["compute_cpu_s"] for rep in reports[S:]),
                                                 default=float("nan")),
            "samples": samples, "samples_per_s": samples / wall if wall > 0 else float("nan"),
            "skipped_steps": sum(servers[0]["skipped"]),
            "servers": S, "workers": W, "max_staleness": ps.max_staleness,
            "staleness_lr": ps.staleness_lr, "dc_lambda": ps.dc_lambda,
            "shard_numel": [sh.numel for sh in ps.shards], "resizes": self.lg.get("resizes", []),
            "gradients_per_worker": applied,
            "staleness": _hist(_merge([st["staleness"] for st in servers])),
            "clock_lag": _hist(_merge([st["clock_lag"] for st in servers])),
            "workers_finished": len(finished),
            "workers_lost": [lost[w] for w in sorted(lost)],
            "status": "ok" if not lost else f"{len(lost)} of {W} workers lost",
            "mpirun_recovery": recovery_enabled(),
            "state_sha256": state_sha256(r.model),
            "ranks_agree": agree,                 # every live rank holds this model
            "final_model_bytes": delivered,       # rank 0 sent it there (control channel)
            "ledger_rank0": r.comm.ledger.rows()}, write=True)
        if lost:
            names = ", ".join(f"worker {i['worker']} (rank {i['rank']}, after {i['clock']} gradients)"
                              for i in summary["workers_lost"])
            where = f" to {r.out / 'summary.json'}" if r.out else ""
            raise WorkersLost(f"async-ps finished with {len(finished)} of {W} workers; lost: "
                              f"{names}; summary written{where}")
        return summary


def serve(r: Run) -> dict:
    """A server rank's run: serve, then end it (rank 0 returns and writes the summary; the
    others their counters). Raises :class:`WorkersLost` (exit status 4) on rank 0, after writing
    the summary, when workers were lost."""
    s = Serving(r)
    s.start()
    wall = s.serve()
    return s.end_rank0(wall) if r.comm.rank == 0 else s.end_other_server(wall)


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
