"""DiLoCo over 2 emulated datacenters × 2 ranks rides out WAN faults (run by tests/test_wan.py
under launchers/wan.sh -n 4 --dcs 2): three runs of one tiny deterministic config in one mpirun,

  A  no fault (the reference);
  B  the inter-dc link down for 2.5 s from the run's start (its packets dropped: TCP
     retransmits once it is back);
  C  5 % random loss each way on the inter-dc link (seeded) for the whole run;

B's and C's final parameters (``state_sha256``) and eval losses equal A's on every rank (a
fault only delays bytes), and the forwarder counted packets that each fault dropped (so the
fault hit the run's traffic). Every rank then writes its report, and

  D  the link goes down for 12 s, longer than the watchdog's allowance (floor
     comm.timeout_s = 3 s + comm.outage_s = 2 s on the wide-area link): the job must end with
     the watchdog's one-line error naming the rank, the op and the level (the test checks
     stderr and the exit status), not hang and not finish.

argv[1]: a scratch folder."""
import json
import sys
import time
from pathlib import Path

from common import Checks

import lowcomm
from lowcomm.tools import wan
from lowcomm.comm.ledger import Ledger
from lowcomm.run.api import load_config
from lowcomm.run.api import run
from lowcomm.run.folder import RunOptions
from lowcomm.tools.wan_faults import make

TINY = ["strategy.name=diloco", "strategy.period=3", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "batch_size=4", "data.seq_len=32", "data.max_bytes=300000",
        "eval_batches=2", "steps=9", "log_every=3"]

world = lowcomm.init()
ok = Checks(world.rank)
scratch = Path(sys.argv[1])


def train(name: str, fault=None) -> tuple[dict, int]:
    """One run; ``fault`` is put on the link 0-1 by rank 0 just before it starts (after every
    rank is ready); returns the summary and the packets the fault dropped."""
    added = []
    world.barrier()
    if world.rank == 0 and fault is not None:
        added = wan.fault([fault])
    summary = run(load_config(None, TINY), RunOptions(scratch / name, progress=False), world.dup(Ledger(), "world"))
    dropped = 0
    if world.rank == 0 and added:
        end = added[0].end
        if end > time.time():          # a fault outlasting the run: end it now
            wan.fault([], clear=True)
        time.sleep(1.3)                # the forwarder writes its counters once a second
        stats = json.loads((wan.STATE_DIR / "forwarder-stats.json").read_text())
        dropped = stats["by_fault"].get(str(added[0].id), 0)
    return summary, world.bcast_object(dropped)


ref, _ = train("a")
ok(ref["ranks_agree"], "reference: the ranks' parameters differ")
for name, fault in (("b", make("down", "0-1", duration=2.5)),
                    ("c", make("loss", "0-1", rate=0.05, seed=1))):
    got, dropped = train(name, fault)
    ok(dropped > 0, f"run {name}: the fault dropped no packet of the run")
    ok(got["state_sha256"] == ref["state_sha256"] and got["ranks_agree"],
       f"run {name} ({fault.kind}): final parameters differ from the run without the fault")
    ok(got["eval_loss"] == ref["eval_loss"], f"run {name}: eval loss {got['eval_loss']} != {ref['eval_loss']}")
    if world.rank == 0:
        print(f"run {name} ({fault.kind}): {dropped} packets dropped by the fault, "
              f"wall {got['wall_s']:.2f} s against {ref['wall_s']:.2f} s", flush=True)
ok.report()

cfg = load_config(None, TINY + ["comm.timeout_s=3", "comm.outage_s=2"])
world.barrier()
if world.rank == 0:
    wan.fault([make("down", "0-1", duration=12)])
run(cfg, RunOptions(scratch / "d", progress=False), world)   # the world itself: open_run applies cfg.comm first
raise SystemExit("run d finished although the link was down past the watchdog's allowance")
