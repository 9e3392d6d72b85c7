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

    def models_close(self, a, b, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
        """One check per parameter of model ``a`` against the same one of ``b``."""
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            self(torch.allclose(p, q, rtol=rtol, atol=atol),
                 f"{what}: {name} differs by {float((p - q).detach().abs().max()):.3g}")


class MLP(torch.nn.Module):
    """A tanh MLP whose layers are named a, b, c, … (``sizes`` = widths, input first);
    ``unused=True`` adds a layer that never gets a gradient."""

    def __init__(self, *sizes: int, unused: bool = False):
        super().__init__()
        self.names = "abcdefgh"[:len(sizes) - 1]
        for name, n_in, n_out in zip(self.names, sizes, sizes[1:]):
            setattr(self, name, torch.nn.Linear(n_in, n_out))
        if unused:
            self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        for i, name in enumerate(self.names):
            x = getattr(self, name)(x if i == 0 else torch.tanh(x))
        return x


def seeded_mlp(*sizes: int, unused: bool = False) -> MLP:
    """The same initial model on every rank (seed 0)."""
    torch.manual_seed(0)
    return MLP(*sizes, unused=unused)


def random_batch(step: int, n: int, features: int = 10, classes: int = 3):
    """The global batch of ``step``: n Gaussian inputs and uniform labels, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)
