"""The end of a parameter-server run, point to point on the uncharged control channel: the
reports to rank 0, the final model's delivery and its hashes, the stop notice and the final
checkpoint it asks for, and leaving without ``MPI_Finalize`` after a lost rank. Shared by the
servers (:mod:`lowcomm.run.serve`) and the workers' coordination
(:class:`lowcomm.run.lockstep.Detached`)."""
from __future__ import annotations

import atexit
import logging
import os
import sys
import time

from ..comm.comm import Comm
from ..strategies.ps.async_ps import ServerLost, recovery_enabled
from .evaluate import state_sha256
from .signals import Interrupted

log = logging.getLogger("lowcomm.train")
TAG_STATS = 77
TAG_FINAL = 78          # rank 0 -> every live rank: the run's final model
TAG_AGREE = 79          # every live rank -> rank 0: the sha256 of the model it now holds


# the end of the run, point to point on the control channel -----------------------------------
def recv_from(ctl: Comm, src: int, timeout_s: float, what: str, tag: int = TAG_STATS):
    """Receive a pickled end-of-run message from ``src``, or raise naming ``src``."""
    t0 = time.monotonic()
    while ctl.iprobe(src, tag) is None:
        if time.monotonic() - t0 > timeout_s:
            raise ServerLost(f"rank {ctl.rank}: rank {src} ({what}) sent no end-of-run message "
                             f"for {timeout_s:g} s; it is gone, ending the job")
        time.sleep(0.001)
    return ctl.recv_object(src, tag)


def send_sync(ctl: Comm, obj, dest: int, tag: int, timeout_s: float, what: str) -> None:
    """Send ``obj`` synchronously (so that this process may end at once after)."""
    req = ctl.issend_object(obj, dest, tag)
    t0 = time.monotonic()
    while not req.test():
        if time.monotonic() - t0 > timeout_s:
            raise ServerLost(f"rank {ctl.rank}: rank {dest} ({what}) took no end-of-run message "
                             f"for {timeout_s:g} s; it is gone, ending the job")
        time.sleep(0.001)


def report_to_rank0(ctl: Comm, report: dict, timeout_s: float) -> None:
    send_sync(ctl, report, 0, TAG_STATS, timeout_s, "parameter server 0")


def take_final_model(ctl: Comm, model, timeout_s: float) -> dict | None:
    """Every live rank but 0: load the run's final model from rank 0, answer its hash; or, when
    the run was stopped by a signal, return rank 0's notice (``{"signum", "step", "save"}``)."""
    final = recv_from(ctl, 0, timeout_s, "parameter server 0", TAG_FINAL)
    if "model" not in final:
        return final
    model.load_state_dict(final["model"])
    send_sync(ctl, state_sha256(model), 0, TAG_AGREE, timeout_s, "parameter server 0")
    return None


def deliver_final_model(ctl: Comm, model, ranks: list[int], timeout_s: float) -> tuple[bool, int]:
    """Rank 0: send the final model (parameters and buffers) to ``ranks`` (the live ones) and
    check that each now holds it. Returns (every rank agrees, bytes sent)."""
    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for r in ranks:
        send_sync(ctl, {"model": final}, r, TAG_FINAL, timeout_s, f"rank {r}")
    mine = state_sha256(model)
    same = all(recv_from(ctl, r, timeout_s, f"rank {r}", TAG_AGREE) == mine for r in ranks)
    return same, len(ranks) * sum(t.numel() * t.element_size() for t in final.values())


def stopped(coord, notice: dict):
    """Stopped by a signal: this live rank writes its final checkpoint (rank 0's notice names
    the step) with ``coord``'s counters, then raises :class:`Interrupted` (exit status 128 +
    signal)."""
    r = coord.r
    where = coord.save(notice["step"]) if notice["save"] else None
    if notice["save"] is False and r.ckpt is not None and r.comm.rank == 0:
        log.error("async-ps: workers were lost, so no final checkpoint can be written (it needs "
                  "every rank); resume from the last one, if any")
    raise Interrupted(notice["signum"], notice["step"], where)


def skip_mpi_finalize(code: int) -> None:
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
