"""Test accuracy on scikit-learn's digits (experiments/digits_cnn_task.py, a BatchNorm CNN) of
methods given as specs, two seeds, through ``lowcomm.train``: how far averaged BatchNorm
statistics leave DiLoCo from SyncDP, and what ``bn_recompute`` recovers.

    launchers/local.sh -n 2 python experiments/digits_bn_recompute.py --steps 300 \\
        syncdp diloco:period=50 diloco:period=50,bn_recompute=16

Prints one line per (seed, method): accuracy on the 270 held-out images and their loss.
"""
import argparse
import os
import sys

import torch

import lowcomm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits_cnn_task as digits  # noqa: E402


def accuracy(model, cfg) -> float:
    x, y = digits.splits(cfg)[1].tensors
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--set", action="append", default=["optimizer.name=sgd", "lr=0.05"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    comm = lowcomm.init()
    for seed in map(int, a.seeds.split(",")):
        for spec in a.methods:
            built = []

            def model(cfg):
                built.append((digits.model(cfg), cfg))
                return built[-1][0]
            task = lowcomm.from_functions(model, digits.loss, digits.batch, digits.eval_batches)
            s = lowcomm.train(task, strategy=spec, steps=a.steps,
                              batch_size=16, seed=seed, log_every=a.steps,
                              set=[*a.set, "eval_batches=17"], comm=comm)
            acc = accuracy(*built[-1])
            if comm.rank == 0:
                print(f"seed {seed}  {spec:45s} accuracy {acc:.4f}  held-out loss {s['eval_loss']:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
