"""Shared by the worker scripts: a check counter and the final per-rank report."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)


class Checks:
    def __init__(self, rank: int):
        self.rank, self.n = rank, 0

    def __call__(self, cond: bool, message: str = "") -> None:
        assert cond, f"rank {self.rank}: {message}"
        self.n += 1

    def report(self) -> None:
        with open(os.path.join(os.environ["LOWCOMM_TEST_REPORTS"], f"rank{self.rank}"), "w") as f:
            f.write(str(self.n))
