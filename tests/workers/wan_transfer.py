"""A 16 MiB message from datacenter 0 to datacenter 1 over the emulated WAN, timed against the
α–β model of the link the WAN was brought up with (run by tests/test_wan.py under
launchers/wan.sh -n 2 --dcs 2). T = send 16 MiB + 1-byte reply, model 2α + n/β."""
import json
import os
import socket
import statistics
import time

import torch

import lowcomm
from common import Checks
from lowcomm.topology import LinkModel
from lowcomm.wan import state

comm = lowcomm.init()
r = comm.rank
ok = Checks(r)
ok(comm.size == 2, "needs 2 ranks")
hosts = comm.allgather_object(socket.gethostname())
ok(hosts == ["lowcomm-dc0", "lowcomm-dc1"], f"ranks run on {hosts}")
st = state()
link = LinkModel(st["delay_ms"] / 1e3, st["rate_mbit"] * 1e6 / 8, "wan")
n = 16 << 20
buf, one = torch.zeros(n, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)


def trip() -> float:
    t0 = time.perf_counter()
    if r == 0:
        comm.send(buf, 1)
        comm.recv_(one, 1)
    else:
        comm.recv_(buf, 0)
        comm.send(one, 0)
    return time.perf_counter() - t0


comm.send(one, 1) if r == 0 else comm.recv_(one, 0)   # connect first: not part of a transfer
times = [trip() for _ in range(3)]
measured = comm.bcast_object(statistics.median(times) if r == 0 else None)
model = link.seconds(n) + link.seconds(1)
ratio = measured / model
ok(0.8 <= ratio <= 1.5, f"16 MiB took {measured:.3f} s, α–β model {model:.3f} s: ratio {ratio:.2f}")
if r == 0 and os.environ.get("LOWCOMM_WAN_RESULT"):
    with open(os.environ["LOWCOMM_WAN_RESULT"], "w") as f:
        json.dump({"measured_s": measured, "model_s": model, "ratio": ratio, "times": times}, f)
ok.report()
