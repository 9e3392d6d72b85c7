"""The pipeline's bubble measured beside its schedule's formula, at 2 ranks (one core each).

The built-in byte-level GPT (``--d-model``, ``--layers``) on batches of real text (the Python
standard library's source, the default task's corpus), cut into 2 stages by parameter count;
for each schedule and number of micro-batches M, ``--steps`` training steps, and the measured
bubble (1 − the stage's time in its forward and backward passes / the schedule's wall-clock,
mean over ranks and over the steps after the first two) beside (P−1)/(M+P−1). Run::

    launchers/local.sh -n 2 python experiments/pipeline_bubble.py

and rank 0 prints one JSON line per (schedule, M).
"""
import argparse
import json

import torch

import lowcomm
from lowcomm.comm.ledger import Ledger
from lowcomm.parallel.pipeline import PipelineParallel, bubble_formula
from lowcomm.run.config import load_config
from lowcomm.tasks import bytelm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedules", default="GPipe,1F1B")
    ap.add_argument("--microbatches", default="2,4,8,16")
    a = ap.parse_args()
    torch.set_num_threads(1)
    comm = lowcomm.init()
    ctl = comm.dup(Ledger(), "control")
    cfg = load_config(None, [f"model.d_model={a.d_model}", f"model.n_layers={a.layers}",
                             f"batch_size={a.batch}", "data.seq_len=64"])
    for schedule in a.schedules.split(","):
        for m in map(int, a.microbatches.split(",")):
            torch.manual_seed(0)
            model = bytelm.model(cfg)
            opt = PipelineParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3), comm,
                                   microbatches=m, schedule=schedule, criterion=bytelm.criterion)
            for step in range(1, a.steps + 1):
                if step == 3:
                    opt.metrics(ctl)                # the first two steps (set-up) left out
                opt.zero_grad()
                opt.forward_backward(None, bytelm.batch(step, 0, 1, cfg))
                opt.step()
            got = opt.metrics(ctl)
            opt.finish()
            if comm.rank == 0:
                print(json.dumps({"schedule": schedule, "microbatches": m, "ranks": comm.size,
                                  "bubble": round(got["pp_bubble"], 3),
                                  "bubble_max": round(got["pp_bubble_max"], 3),
                                  "formula": round(bubble_formula(schedule, comm.size, m), 3)}),
                      flush=True)


if __name__ == "__main__":
    main()
