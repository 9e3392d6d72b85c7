"""The run's inner optimizer is any torch optimizer, named in the config with its own keys, and
``muon`` is torch's Muon on the matrices with AdamW on the rest (MuonAdamW), step for step the
two torch optimizers themselves."""
import copy

import pytest
import torch

from lowcomm.errors import ConfigError
from lowcomm.run.optimizers import MuonAdamW, OPTIMIZERS
from lowcomm.run.api import load_config
from lowcomm.run.schedule import build_optimizer


def test_optimizer_name_is_any_torch_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    for name, cls in [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("nadam", torch.optim.NAdam),
                      ("rmsprop", torch.optim.RMSprop), ("adafactor", torch.optim.Adafactor),
                      ("muon", MuonAdamW)]:
        opt = build_optimizer(load_config(None, [f"optimizer.name={name}"]), model.parameters())
        assert type(opt) is cls and opt.param_groups[0]["lr"] == 3e-3
    assert "lbfgs" not in OPTIMIZERS and "muon" in OPTIMIZERS
    sgd = build_optimizer(load_config(None, ["optimizer.name=sgd", "optimizer.momentum=0.9",
                                             "optimizer.options.nesterov=true"]), model.parameters())
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["nesterov"] is True
    muon = build_optimizer(load_config(None, ["optimizer.name=muon", "optimizer.options.ns_steps=3",
                                              "optimizer.options.ns_coefficients=[3.0, -4.0, 2.0]"]),
                           model.parameters())
    assert [g["algorithm"] for g in muon.param_groups] == ["muon", "adamw"]
    assert muon.param_groups[0]["ns_steps"] == 3 and muon.param_groups[0]["ns_coefficients"] == (3.0, -4.0, 2.0)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"     # one lr for both groups
    assert muon.param_groups[0]["momentum"] == 0.95                        # Muon's own default


@pytest.mark.parametrize("overrides,key,message", [
    (["optimizer.name=lion"], "optimizer.name", "known: adadelta"),
    (["optimizer.name=lbfgs"], "optimizer.name", "closure"),
    (["optimizer.name=adam", "optimizer.momentum=0.9"], "optimizer.momentum", "takes no momentum"),
    (["optimizer.name=muon", "optimizer.options.nsteps=3"], "optimizer.options.nsteps", "it takes: "),
    (["optimizer.name=adamw", "optimizer.options.betas=[0.8, 0.9]"], "optimizer.options.betas",
     "optimizer.beta1/beta2"),
    (["optimizer.name=muon", "optimizer.options.ns_steps=2.5"], "optimizer.options.ns_steps", "default 5"),
    (["optimizer.name=muon", "optimizer.options.adjust_lr_fn=fast"], "optimizer.options", "fast"),
    (["optimizer.options=3"], "optimizer.options", "is a table"),
])
def test_optimizer_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert e.value.key == key


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _train(model, opts, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        for o in opts:
            o.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for o in opts:
            o.step()


def test_muon_adamw_is_torch_muon_on_matrices_and_torch_adamw_on_the_rest():
    ours, ref = _net(), _net()
    opt = MuonAdamW(ours.parameters(), lr=0.02, weight_decay=0.01, ns_steps=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    matrices = [p for p in ref.parameters() if p.ndim == 2]
    refs = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01, ns_steps=4),
            torch.optim.AdamW([p for p in ref.parameters() if p.ndim != 2], lr=0.02,
                              betas=(0.9, 0.95), weight_decay=0.01)]
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in refs]
    for step in range(5):
        _train(ours, [opt], 1, step)
        _train(ref, refs, 1, step)
        sched.step()
        for s in ref_scheds:
            s.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)                    # bit for bit: the same torch steps
    # a saved state resumes exactly (load_state_dict re-links the parts to the new groups)
    again = _net()
    again.load_state_dict(ours.state_dict())
    resumed = MuonAdamW(again.parameters(), lr=0.02, weight_decay=0.01, ns_steps=4)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))     # (as if read from a file)
    _train(ours, [opt], 2, 5)
    _train(again, [resumed], 2, 5)
    for a, b in zip(ours.parameters(), again.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="parameter groups"):
        MuonAdamW([{"params": list(_net().parameters())}])
