"""Shared by the check files of the methods that split the model (pipeline, tensor): the small
language models they split, their batches, and the comparisons against one process training
the whole model."""
import copy

import torch

from helpers import tiny_gpt2, tiny_llama
from lowcomm.run.evaluate import state_sha256
from lowcomm.tasks.tinygpt import TinyGPT


def language_models(positions: int, layers: int, gpt2_heads: int) -> dict:
    """``{name: constructor}`` of three seeded models of width 32 and ``layers`` blocks:
    lowcomm's TinyGPT (4 heads), transformers' GPT-2 (``gpt2_heads`` heads) and Llama."""
    def tinygpt():
        torch.manual_seed(0)
        return TinyGPT(positions, 32, layers, 4)
    return {"tinygpt": tinygpt, "gpt2": lambda: tiny_gpt2(positions, layers, gpt2_heads),
            "llama": lambda: tiny_llama(positions, layers)}


def token_batch(step: int, shape: tuple, vocab: int):
    """The (inputs, targets) of ``step``: uniform tokens of ``shape``, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g)


def train_beside(opt, ref, ropt, batches, loss_fn, whole_loss, clip=None):
    """Train the split method ``opt`` (``opt.forward_backward(loss_fn, b)``) and the whole model
    ``ref`` (its optimizer ``ropt``, ``whole_loss(ref, b)``) on the same ``batches``, clipping
    both by the norm ``clip`` (and asserting the two norms agree). Returns both loss lists."""
    ours, theirs = [], []
    for b in batches:
        opt.zero_grad()
        ours.append(float(opt.forward_backward(loss_fn, b)))
        norm = opt.clip_grad_norm_(clip) if clip else None
        opt.step()
        ropt.zero_grad()
        loss = whole_loss(ref, b)
        loss.backward()
        if clip:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (norm, ref_norm)
        ropt.step()
        theirs.append(loss.item())
    return ours, theirs


def assert_same_state(model, ref, rtol: float, atol: float) -> None:
    """Every entry of ``model``'s state dict a plain tensor of ``ref``'s shape and close to it."""
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert type(a) is torch.Tensor and a.shape == b.shape, (n, type(a), a.shape)
        assert torch.allclose(a, b, rtol=rtol, atol=atol), \
            f"{n}: max |diff| {(a - b).abs().max().item():.3g}"


def assert_resumes_bit_for_bit(fresh, steps) -> None:
    """``fresh()`` -> (model, method); ``steps(method, a, b)`` trains steps a..b-1. Four steps
    straight and two more from the state after two (deep-copied, as a checkpoint keeps it)
    leave the same model, bit for bit."""
    model, opt = fresh()
    steps(opt, 0, 2)
    saved = copy.deepcopy((opt.model_state_dict(), opt.state_dict()))
    steps(opt, 2, 4)
    opt.finish()
    again, opt2 = fresh()
    opt2.load_model_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    steps(opt2, 2, 4)
    opt2.finish()
    assert state_sha256(again) == state_sha256(model)
