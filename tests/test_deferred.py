"""A model built on the meta device (lowcomm.parallel.deferred) and materialised part by part
equals the whole build under the same seed, bit for bit: parameters, buffers (transformers'
Llama's non-persistent rotary frequencies too) and the generator's state after the build."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lowcomm.errors import ConfigError
from lowcomm.parallel.deferred import build_deferred, deferred_of
from lowcomm.tasks.tinygpt import TinyGPT

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from helpers import tiny_gpt2, tiny_llama  # noqa: E402

MODELS = {"tinygpt": lambda: TinyGPT(16, 32, 3, 4), "gpt2": lambda: tiny_gpt2(16, 3, 2),
          "llama": lambda: tiny_llama(16, 3)}


def tensors(model: nn.Module) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parts_materialised_one_by_one_equal_the_whole_build(name):
    if name != "tinygpt":
        pytest.importorskip("transformers")
    torch.manual_seed(3)
    whole = MODELS[name]()
    after_whole = torch.get_rng_state()
    torch.manual_seed(3)
    model = build_deferred(MODELS[name], "strategy.build")
    assert torch.equal(torch.get_rng_state(), after_whole)     # later draws unchanged
    assert all(t.is_meta for t in tensors(model).values())
    first = next(n for n, _ in model.named_parameters()).rsplit(".", 1)[0]   # one part
    deferred_of(model).materialise(model, [first])
    mine = {id(p) for p in model.get_submodule(first).parameters()}
    assert not any(p.is_meta for p in model.get_submodule(first).parameters())
    assert all(p.is_meta for p in model.parameters() if id(p) not in mine)
    deferred_of(model).materialise(model, [n for n, _ in model.named_children()])   # the rest
    ours, theirs = tensors(model), tensors(whole)
    assert ours.keys() == theirs.keys()
    for k, t in theirs.items():
        assert torch.equal(ours[k], t), k
    assert torch.get_rng_state().equal(after_whole)


def test_the_objects_an_optimizer_holds_are_the_ones_materialised():
    model = build_deferred(lambda: TinyGPT(16, 32, 2, 4), "strategy.build")
    params = list(model.parameters())
    deferred_of(model).materialise(model, ["tok", "pos", "blocks", "ln"])
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert not any(p.is_meta for p in params)


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.scale = float(self.w.abs().max())     # a value of the initialisation: not on meta


def test_a_build_that_reads_its_values_names_the_setting():
    with pytest.raises(ConfigError, match=r"strategy\.build.*meta device"):
        build_deferred(ReadsValues, "strategy.build")
