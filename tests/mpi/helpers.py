"""Shared by the check files: small models, batches, and comparisons that name what differs."""
import numpy as np
import torch

import lowcomm
from lowcomm.comm.ledger import Ledger


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


def toy_dataset() -> torch.utils.data.TensorDataset:
    """600 Gaussian points in 10-D, labelled by the signs of their first two coordinates (3
    classes)."""
    X = torch.randn(600, 10, generator=torch.Generator().manual_seed(7))
    return torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long() + (X[:, 1] > 0).long())


def flat(tensors) -> torch.Tensor:
    """The tensors (or a model's parameters) as one detached vector."""
    if isinstance(tensors, torch.nn.Module):
        tensors = tensors.parameters()
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def assert_models_close(a, b, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every parameter of model ``a`` against the same one of ``b``; the message names each one
    that differs and by how much."""
    off = [f"{name} by {float((p - q).detach().abs().max()):.3g}"
           for (name, p), q in zip(a.named_parameters(), b.parameters())
           if not torch.allclose(p, q, rtol=rtol, atol=atol)]
    assert len(list(a.parameters())) == len(list(b.parameters())), f"{what}: other parameters"
    assert not off, f"{what}: {', '.join(off)} differ"


def assert_models_equal(a, b, what: str) -> None:
    """As :func:`assert_models_close`, bit for bit."""
    off = [f"{name} by {float((p - q).detach().abs().max()):.3g}"
           for (name, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p, q)]
    assert not off, f"{what}: {', '.join(off)} differ"


def control(comm):
    """A duplicate of ``comm`` for the checks' own traffic: its own ledger, no shape checks."""
    ctl = comm.dup(Ledger(), "control")
    ctl.validate = False
    return ctl


def agree(ctl, t: torch.Tensor) -> bool:
    """Whether every rank holds the same tensor (the same answer on every rank)."""
    g = ctl.allgather(t.detach().contiguous())
    return all(torch.equal(g[0], g[k]) for k in range(len(g)))


_REFERENCE = []      # the world's duplicate the references are summed on (made on first use)


def vendor_sum(t: torch.Tensor) -> np.ndarray:
    """The reference: vendor MPI_Allreduce (sum) of ``t`` in float64 over the world, through
    ``Comm.allreduce_`` (the vendor's call, watched) on a duplicate with a ledger of its own,
    so the reference is charged to no communicator a check reads."""
    if not _REFERENCE:                  # collective: every rank's first reference
        _REFERENCE.append(lowcomm.init().dup(Ledger(), "reference"))
    ref = t.detach().double().reshape(-1).clone()
    _REFERENCE[0].allreduce_(ref)
    return ref.numpy().reshape(tuple(t.shape))


def sent(ledger, skip_checks: bool = True) -> int:
    """Bytes this rank sent, from a ledger (without the shape-agreement checks)."""
    return sum(row["bytes_sent"] for row in ledger.rows() if not skip_checks or row["op"] != "check")


def train_steps(model, opt, batch, steps: int, first: int = 0) -> None:
    """``steps`` steps of the user's loop from step ``first``: ``batch(step)`` gives this rank's
    (inputs, class labels), cross-entropy."""
    import torch.nn.functional as F
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def every_method(variants: dict) -> dict:
    """Every registered method one MPI job runs (those of a fleet only are the fleet's tests')
    as its registry entry's example runs it: ``{name: (spec, run
    keys)}`` (:func:`lowcomm.run.registry.example`; user-registered methods included, so a new
    method is checked without editing a test), then ``variants`` (more of one method: another
    algorithm, compressor, backend, policy, or the settings a check needs)."""
    from lowcomm.run.registry import example, in_one_job
    return {**{name: example(m) for name, m in in_one_job().items()}, **variants}


def inner_optimizer(name: str, params, lr: float = 0.1):
    """The inner optimizer method ``name`` needs (its registry entry's ``optimizer``, at lr/10),
    else plain SGD."""
    from lowcomm.run.optimizers import OPTIMIZERS
    from lowcomm.run.registry import STRATEGIES
    needs = STRATEGIES[name].optimizer if name in STRATEGIES else ""
    return OPTIMIZERS[needs](params, lr=lr / 10) if needs else torch.optim.SGD(params, lr=lr)


def tiny_gpt2(positions: int, layers: int, heads: int):
    """A seeded transformers GPT-2 of width 32 (dropout off: splits compare exactly)."""
    import transformers
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=positions, n_embd=32, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def tiny_llama(positions: int, layers: int):
    """A seeded transformers Llama of width 32, 4 heads sharing 2 key/value heads."""
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))
