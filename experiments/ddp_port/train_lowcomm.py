"""A CNN with BatchNorm on scikit-learn's digits: DistributedSampler, momentum SGD, a cosine LR
schedule and gradient clipping. train_ddp.py is plain PyTorch DDP; train_lowcomm.py is the same
script ported to lowcomm (10 lines differ), taking any method's spec:

    torchrun --nproc_per_node 2 experiments/ddp_port/train_ddp.py
    launchers/local.sh -n 2 python experiments/ddp_port/train_lowcomm.py "diloco:period=20"
"""
import hashlib
import sys

import torch
import lowcomm
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from digits_cnn_task import DigitsCNN, splits  # noqa: E402  (the model and the images)


def evaluate(model, rank: int, held) -> None:
    net = getattr(model, "module", model).eval()
    with torch.no_grad():
        loss = F.cross_entropy(net(held.tensors[0]), held.tensors[1]).item()
    state = b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values())
    print(f"rank {rank}: eval loss {loss:.6f} state {hashlib.sha256(state).hexdigest()[:16]}")


def main(epochs: int = 2):
    torch.set_num_threads(1)
    comm = lowcomm.init()
    rank, world = comm.rank, comm.size
    train, held = splits(type("cfg", (), {"task": type("t", (), {"options": {}})})())
    torch.manual_seed(0)
    model = DigitsCNN(width=8, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = lowcomm.build(sys.argv[1] if len(sys.argv) > 1 else "syncdp", model, opt)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    opt.finish()
    evaluate(model, rank, held)


if __name__ == "__main__":
    main()
