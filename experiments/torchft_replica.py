"""One torchft replica group (of one rank) for experiments/fleet_vs_torchft.py: lowcomm's
workload trained under torchft's Manager, ProcessGroupGloo and DiLoCo.

    python experiments/torchft_replica.py --replica 1 --groups 3 --period 20 \\
        --lighthouse http://127.0.0.1:29510 --log runs/x/replica1.0.jsonl --set steps=240

What is the same as a lowcomm fleet's datacenter: the config (``lowcomm.run.api.load_config``
with the ``--set`` overrides), the task, the model built after ``seed_all(cfg.seed)`` (so every
group starts from the same parameters, hence ``init_sync=False``), the inner optimizer
(``lowcomm.run.schedule.build_optimizer``, its lr set by ``lr_at`` every step), the outer
optimizer (SGD with Nesterov momentum at lowcomm's DiLoCo defaults) and the batches: group r at
step t trains on ``task.batch(t, r, groups, cfg)``, where t = committed outer steps × H + the
inner step in the round. The state a recovering group receives is the model, the inner
optimizer's state and what torchft's DiLoCo registers itself (outer parameters, outer
optimizer), as lowcomm's fleet copies them (``fleet.heal_inner = "copy"``).

The log (one JSON object a line, flushed at once): ``start`` (the process began), ``ready``
(the Manager is up), one ``step`` line per inner step (t, the committed outer steps before it,
wall-clock start and end, and on the round's last step whether torchft committed the round and
how many groups took part), ``eval`` (group 0, every ``eval_every`` steps when set: the eval
loss then), ``heal`` (the state of a peer was loaded) and ``end`` (the eval loss on
``task.eval_batches(cfg)``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


class Log:
    """A JSONL file written line by line, each flushed at once (a SIGKILL loses nothing)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def __call__(self, kind: str, **fields) -> None:
        self.f.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        self.f.flush()


def workload(overrides: list[str]):
    """The config, task, model, inner and outer optimizer, as lowcomm builds them."""
    from lowcomm.run.api import load_config
    from lowcomm.run.schedule import build_optimizer
    from lowcomm.run.snapshot import seed_all
    from lowcomm.strategies.outer.diloco import DiLoCoSettings
    from lowcomm.tasks import load_task
    cfg = load_config(None, overrides)
    task = load_task(cfg.task.name)
    seed_all(cfg.seed)
    model = task.model(cfg)
    inner = build_optimizer(cfg, model.parameters())
    d = DiLoCoSettings()
    outer = torch.optim.SGD(model.parameters(), lr=d.outer_lr, momentum=d.outer_momentum,
                            nesterov=d.outer_optimizer == "nesterov")
    return cfg, task, model, inner, outer


def manager(a, model, inner, log: Log):
    """torchft's Manager of this group (its own TCPStore, gloo, the lighthouse at
    ``a.lighthouse``); the recorder of its commit decisions (a list, appended to per round)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    store = TCPStore(a.host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout_s)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        log("heal", outer_step=m.current_step())

    m = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                state_dict=state_dict, min_replica_size=a.min_replicas, use_async_quorum=False,
                replica_id=f"group{a.replica}", store_addr=a.host, store_port=store.port,
                rank=0, world_size=1, lighthouse_addr=a.lighthouse, hostname=a.host,
                timeout=timeout, quorum_timeout=timedelta(seconds=a.quorum_timeout_s),
                connect_timeout=timeout, init_sync=False)
    m._lowcomm_store = store                  # kept alive as long as the Manager
    commits: list[bool] = []
    decide = m.should_commit

    def should_commit(*args, **kwargs):
        ok = decide(*args, **kwargs)
        commits.append(bool(ok))
        return ok

    m.should_commit = should_commit           # what torchft's DiLoCo calls at each round's end
    return m, commits


def train(a, cfg, task, model, inner, outer, m, commits, log: Log) -> None:
    """Inner steps under torchft's DiLoCo until ``cfg.steps // a.period`` outer steps are
    committed; one ``step`` line each."""
    from lowcomm.run.schedule import lr_at, set_lr
    from torchft.local_sgd import DiLoCo
    H, k = a.period, 0
    with DiLoCo(m, [model], inner, outer, sync_every=H, backup_device=torch.device("cpu"),
                pin_memory=False):
        while m.current_step() < cfg.steps // H:
            before, t, start = m.current_step(), m.current_step() * H + k + 1, time.time()
            inner.zero_grad()
            loss = task.loss(model, task.batch(t, a.replica, a.groups, cfg))
            loss.backward()
            set_lr(inner, lr_at(cfg, t))
            n = len(commits)
            inner.step()                      # the H-th step of a round ends with the sync
            k += 1
            line = dict(t=t, outer_step=before, start=start, loss=loss.item())
            if k == H:
                k = 0
                line.update(sync=True, committed=commits[n] if len(commits) > n else None,
                            participants=m.num_participants())
            log("step", **line)
            if cfg.eval_every and t % cfg.eval_every == 0 and a.replica == 0:
                log("eval", t=t, eval_loss=eval_loss(task, model, cfg))   # as lowcomm's eval_every


@torch.no_grad()
def eval_loss(task, model, cfg) -> float:
    """Mean loss on the task's held-out batches (lowcomm's ``evaluate`` on one rank)."""
    model.eval()
    losses = [task.loss(model, b).item() for b in task.eval_batches(cfg)]
    model.train()
    return sum(losses) / len(losses) if losses else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--period", type=int, required=True, help="H: inner steps per round")
    p.add_argument("--lighthouse", required=True, help="http://HOST:PORT of torchft_lighthouse")
    p.add_argument("--log", required=True, help="the JSONL this group writes")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address the other groups reach this one's store and Manager at "
                        "(torchft gives its checkpoint server and rendezvous store this machine's "
                        "hostname: on the emulated WAN the group's hostname is this address)")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--quorum-timeout-s", type=float, default=120.0)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    log = Log(a.log)
    log("start", replica=a.replica, pid=os.getpid())
    cfg, task, model, inner, outer = workload(a.overrides)
    m, commits = manager(a, model, inner, log)
    log("ready")
    train(a, cfg, task, model, inner, outer, m, commits, log)
    log("end", eval_loss=eval_loss(task, model, cfg), outer_steps=m.current_step())
    m.shutdown(wait=False)
    os._exit(0)                               # torchft's threads need not be joined


if __name__ == "__main__":
    main()
