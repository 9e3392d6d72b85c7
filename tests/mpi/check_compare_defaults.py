"""Every method at ``lowcomm compare``'s settings trains without diverging, on 2 ranks.

``lowcomm compare`` runs each registered method at the settings its registry entry gives
(:attr:`lowcomm.Method.compare`; a compressor's :data:`lowcomm.compress.COMPARE`), on top of the
shared config. Here each of them trains a small byte LM (the built-in task) for ``STEPS`` steps
(past one outer period of 50): its final eval loss must be finite and at least ``MARGIN`` nats
below the untrained model's, on every rank, and the ranks must end with one model. The methods whose steps are signs or 1-bit codes --
the ones a shared learning rate makes diverge -- also train a GPT-2 of ``transformers``
(experiments/hf_gpt2_task.py) at the same settings, under the same rule.
"""
import math
import os

import pytest
import torch

import lowcomm
from lowcomm.run.api import load_config
from lowcomm.run.evaluate import evaluate
from lowcomm.run.registry import in_one_job
from lowcomm.run.snapshot import seed_all
from lowcomm.tasks import load_task
from lowcomm.tools.compare import VARIANTS, methods
from under_mpi import SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_TASK = os.path.join(ROOT, "experiments", "hf_gpt2_task.py")
STEPS = 60
MARGIN = 0.3
BYTELM = ["task=lowcomm.tasks.bytelm", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "batch_size=8",
          "data.seq_len=32", "data.max_bytes=300000", "eval_batches=4", "log_every=20"]
GPT2 = [f"task={HF_TASK}", "task.n_embd=32", "task.n_layer=1", "task.n_head=2", "task.seq_len=32",
        "batch_size=8", "eval_batches=4", "log_every=20"]
#: every comparison that is one registered method or one compressor (not a composed variant)
EVERY = [m for m in methods() if m not in VARIANTS]
#: sign steps and 1-bit codes: at risk under a learning rate that is not theirs
AT_RISK = ["demo", "distro", "sign", "sign-mv", "ef-sign", "onebit-adam", "zeroone-adam"]

pytestmark = pytest.mark.mpi(sizes=(2,))


def test_every_registered_method_and_compressor_is_checked():
    assert {m.compare_name or n for n, m in in_one_job().items()} <= set(EVERY)
    assert set(AT_RISK) <= set(EVERY)


_untrained: dict = {}


def untrained_eval_loss(task_sets, comm) -> float:
    """The eval loss of the model every run starts from (the run's seed, the task's model)."""
    key = tuple(task_sets)
    if key not in _untrained:
        cfg = load_config(None, [*task_sets, "steps=1"])
        task = load_task(cfg.task.name)
        seed_all(cfg.seed)
        _untrained[key] = evaluate(task.model(cfg), task, task.eval_batches(cfg), comm)
    return _untrained[key]


def trains(name, task_sets, comm, tmp):
    start = untrained_eval_loss(task_sets, comm)
    out = comm.bcast_object(str(tmp) if comm.rank == 0 else None)
    task = load_config(None, task_sets).task.name
    s = lowcomm.train(task, set=[*task_sets, *methods()[name], f"steps={STEPS}"], out=out, comm=comm)
    # every rank's summary holds the run's losses (the parameter server's servers: none)
    got = [x for x in comm.allgather_object((s.get("final_loss"), s.get("eval_loss"),
                                             s.get("ranks_agree"))) if x[0] is not None]
    assert got and got == [got[0]] * len(got) and (len(got) == SIZE or name == "async-ps"), got
    final, end, agree = got[0]
    assert agree is True, f"{name}: ranks_agree is {agree}"
    assert math.isfinite(final) and math.isfinite(end), (name, final, end)
    assert end < start - MARGIN, f"{name}: eval loss {start:.3f} untrained, {end:.3f} after {STEPS} steps"


@pytest.mark.parametrize("name", EVERY)
def test_trains_the_built_in_task_at_its_compare_settings(name, comm, tmp_path_factory):
    trains(name, BYTELM, comm, tmp_path_factory.mktemp(name))


@pytest.mark.parametrize("name", AT_RISK)
def test_trains_a_transformers_gpt2_at_its_compare_settings(name, comm, tmp_path_factory):
    trains(name, GPT2, comm, tmp_path_factory.mktemp(name))
