"""An outer loop's log of synchronisations: ``[local step, fragment, bytes sent here]`` of each,
its traffic charged to the method's ledger when its average is applied (so the byte counts
logged at a step do not depend on the reduction thread's timing)."""
from __future__ import annotations

import torch

from ...comm.comm import Comm
from ...errors import CommError


class SyncLog(list):
    """``[local step, fragment, bytes sent here]`` of every synchronisation, in order."""

    def charge(self, start: int, fragment: int, rows: list[dict], ledger) -> None:
        """Charge the ledger ``rows`` of a synchronisation (fragment ``fragment`` sent at local
        step ``start``) to ``ledger`` and log it."""
        for row in rows:
            ledger.record(row["op"], row["level"], row["bytes_sent"], row["bytes_recv"],
                          row["seconds"], calls=row["calls"])
        self.append([start, fragment, sum(row["bytes_sent"] for row in rows)])

    def summary(self, ctl: Comm, wait_s: float) -> dict:
        """The bytes of each synchronisation, all ranks together (``sync_bytes_peak``,
        ``sync_bytes_mean``), and as ``wait_s_by_rank`` every rank's ``wait_s``, the seconds its
        steps waited for reductions in flight; collective over ``ctl``."""
        mine = torch.tensor([float(b) for _, _, b in self], dtype=torch.float64)
        every = ctl.allgather_object((len(mine), wait_s))
        if len({n for n, _ in every}) != 1:
            raise CommError("outer.summary", ctl.rank, f"ranks made different numbers of "
                            f"synchronisations: {[n for n, _ in every]}")
        if ctl.size > 1 and len(mine):
            ctl.allreduce_(mine)
        return {"syncs": len(mine), "sync_bytes_peak": int(mine.max()) if len(mine) else 0,
                "sync_bytes_mean": float(mine.mean()) if len(mine) else 0.0,
                "wait_s_by_rank": [round(w, 4) for _, w in every]}
