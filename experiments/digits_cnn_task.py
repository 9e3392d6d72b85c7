"""A vision task with BatchNorm and dropout on real images: scikit-learn's 8×8 handwritten
digits (1,797 scans that ship inside the package, no download), classified by a small CNN.

Its BatchNorm running statistics are model state that no gradient moves: every method must keep
them consistent across ranks (``ranks_agree`` hashes the whole ``state_dict``). Run it under any
method::

    launchers/local.sh -n 2 lowcomm train --set task=experiments/digits_cnn_task.py --set steps=100
    lowcomm compare --np 2 --set task=experiments/digits_cnn_task.py --methods ddp,diloco,gossip

Options (``--set task.<option>=...``): ``width`` (channels of the first convolution, 8),
``dropout`` (0.1), ``eval_fraction`` (0.15: the last images, in the package's order). The batch
size is the run's ``batch_size``; held-out batches: the run's ``eval_batches``.
"""
import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.tasks import dataset_batches

DEFAULTS = {"width": 8, "dropout": 0.1, "eval_fraction": 0.15}


def options(cfg) -> dict:
    unknown = set(cfg.task.options) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg.task.options}


class DigitsCNN(nn.Module):
    """conv 3×3 → BatchNorm → ReLU → conv 3×3 → BatchNorm → ReLU → max-pool → dropout → linear."""

    def __init__(self, width: int = 8, dropout: float = 0.1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width * 16, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(self.drop(x.flatten(1)))


_data: dict = {}


def splits(cfg):
    """(training set, held-out set) of (image, label) pairs: images scaled to [0, 1]."""
    frac = options(cfg)["eval_fraction"]
    if frac not in _data:
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        cut = len(y) - int(len(y) * frac)
        _data[frac] = (torch.utils.data.TensorDataset(x[:cut], y[:cut]),
                       torch.utils.data.TensorDataset(x[cut:], y[cut:]))
    return _data[frac]


def model(cfg):
    o = options(cfg)
    return DigitsCNN(o["width"], o["dropout"])


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


_batches: dict = {}


def batch(step, rank, world, cfg):
    train = splits(cfg)[0]
    if id(train) not in _batches:
        _batches[id(train)] = dataset_batches(train)
    return _batches[id(train)](step, rank, world, cfg)


def eval_batches(cfg):
    held = splits(cfg)[1]
    n = min(len(held), cfg.eval_batches * cfg.batch_size)
    return [held[b:min(n, b + cfg.batch_size)] for b in range(0, n, cfg.batch_size)]


def describe(cfg):
    train, held = splits(cfg)
    return f"scikit-learn digits: {len(train)} training and {len(held)} held-out 8x8 images"
