"""A small model with BatchNorm, its loss, and 20 batches for this rank (stand-ins for yours)."""
import torch

import lowcomm

torch.manual_seed(0)                                   # the same initial model on every rank
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 1))
loss_fn = torch.nn.functional.mse_loss
steps = 20
rank = lowcomm.init().rank                             # starts MPI (once; methods reuse it)
gen = torch.Generator().manual_seed(rank)              # each rank its own share of the data
batches = [(x, x.sum(1, keepdim=True)) for x in (torch.randn(16, 8, generator=gen)
                                                 for _ in range(steps))]
