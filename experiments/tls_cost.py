"""What TLS costs between a fleet's datacenters: a ring all-reduce over TLS 1.3
(:class:`~lowcomm.comm.tls.TlsComm`, ``fleet.transport = "tls"``) against the same ring over
gloo's plain TCP (:class:`~lowcomm.comm.gloo.GlooComm`, ``"gloo"``).

Question: how much throughput, round time and CPU does encrypting and authenticating the rounds
cost, on loopback (where the CPU is the limit) and over the emulated WAN at 100 Mbit/s (where
the link is; the goal: TLS at >= 0.9 of plaintext's throughput)?

    PYTHONPATH=. python experiments/tls_cost.py --mb 64 --repeats 3            # loopback
    lowcomm wan up --dcs 2 --delay-ms 25 --rate-mbit 100
    PYTHONPATH=. python experiments/tls_cost.py --mb 64 --repeats 3 --wan      # namespaces
    lowcomm wan down

Each run starts ``--dcs`` member processes (over the WAN: member i in namespace
``lowcomm-dc<i>``, at ``10.77.0.<i+1>``, gloo on its device ``lcwan<i>``, as a fleet on the
WAN; member 0 holds the store they meet at), forms the
group, all-reduces ``--mb`` MB of float32 once to warm up, then ``--rounds`` times, each round
started together (a small all-reduce first) and timed on every member; a round's time is the
slowest member's. Throughput: the bytes a member sends in a ring all-reduce, 2 (n − 1) / n ×
the tensor, over the round's time. CPU: the members' process CPU seconds (every thread) over the
timed rounds, per GB a member sends. Runs alternate between the transports (``--repeats``
each), so that the machine's load falls on both alike; prints a Markdown table of ranges and
``uptime``'s load before and after, and writes ``--out`` (JSON) when given.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

SECRET = bytes(range(32))


def member(a) -> dict:
    """One member's part of a run (``--member R``): its round times and CPU seconds."""
    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
    from lowcomm.comm.collectives import allreduce_
    from lowcomm.comm.gloo import GlooComm
    from lowcomm.comm.tls import Rendezvous, TlsComm
    host = f"10.77.0.{a.member + 1}" if a.wan else "127.0.0.1"
    store = TCPStore(a.store_host, a.port, a.dcs, a.member == 0,
                     timeout=datetime.timedelta(seconds=120))
    prefix = f"{a.transport}/"
    if a.transport == "gloo":
        comm = GlooComm(ProcessGroupGloo(PrefixStore(prefix, store), a.member, a.dcs,
                                         datetime.timedelta(seconds=600)), timeout_s=600)
    else:
        comm = TlsComm(Rendezvous(store, prefix, a.member, a.dcs, SECRET, host=host),
                       timeout_s=600)
    x = torch.randn(a.mb * 2**18, generator=torch.Generator().manual_seed(a.member))
    allreduce_(x.clone(), comm, "ring", op="sum")                     # warm-up
    seconds, cpu0 = [], time.process_time()
    for _ in range(a.rounds):
        allreduce_(torch.ones(1), comm, "ring", op="sum")            # start together
        y, t0 = x.clone(), time.perf_counter()
        allreduce_(y, comm, "ring", op="sum")
        seconds.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    allreduce_(torch.ones(1), comm, "ring", op="sum")                # nobody closes early
    comm.close()
    return {"seconds": seconds, "cpu_s": cpu, "checksum": float(y.double().sum())}


def run(a, transport: str, port: int) -> dict:
    """One run: ``--dcs`` member processes; the slowest member's round times, the CPU."""
    procs = []
    for r in range(a.dcs):
        cmd = [sys.executable, __file__, "--member", str(r), "--transport", transport,
               "--port", str(port), "--dcs", str(a.dcs), "--mb", str(a.mb),
               "--rounds", str(a.rounds), "--store-host", a.store_host] + \
            (["--wan"] if a.wan else [])
        if a.wan:
            cmd = ["ip", "netns", "exec", f"lowcomm-dc{r}"] + cmd
        env = {**os.environ, "GLOO_SOCKET_IFNAME": f"lcwan{r}" if a.wan else "lo"}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"a {transport} member failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    rounds = [max(o["seconds"][i] for o in outs) for i in range(a.rounds)]
    sent_gb = 2 * (a.dcs - 1) / a.dcs * a.mb * 2**20 / 1e9
    return {"transport": transport, "round_s": rounds,
            "mbit_s": [sent_gb * 8e3 / s for s in rounds],
            "cpu_s_per_gb": [o["cpu_s"] / (sent_gb * a.rounds) for o in outs],
            "same_sum": len({o["checksum"] for o in outs}) == 1}


def table(results: list[dict]) -> str:
    rows = ["| transport | round s | Mbit/s sent per member | CPU s per GB sent |",
            "|---|---|---|---|"]
    for t in ("gloo", "tls"):
        rs = [r for r in results if r["transport"] == t]
        span = lambda k, f: (lambda v: f"{min(v):{f}} – {max(v):{f}}")(  # noqa: E731
            [x for r in rs for x in r[k]])
        rows.append(f"| {t} | {span('round_s', '.3f')} | {span('mbit_s', '.0f')} | "
                    f"{span('cpu_s_per_gb', '.2f')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wan", action="store_true", help="members in the emulated WAN's namespaces")
    p.add_argument("--out", default="")
    p.add_argument("--member", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--transport", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-host", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.member >= 0:
        print(json.dumps(member(a)), flush=True)
        return
    a.store_host = "10.77.0.1" if a.wan else "127.0.0.1"
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    results = []
    for i in range(a.repeats):
        for j, t in enumerate(("gloo", "tls")):
            results.append(run(a, t, 29500 + 2 * i + j + os.getpid() % 1000 * 8))
            print(json.dumps(results[-1]), flush=True)
    load.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(table(results))
    print("load before:", load[0], "\nload after: ", load[1])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "results": results, "uptime": load}, f, indent=1)


if __name__ == "__main__":
    main()
