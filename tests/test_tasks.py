"""Your model, your data: the task contract, the Dataset helper, data from any directory, and
every method on a user's task (a Hugging Face GPT-2 from a config) under real mpirun."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_ranks, shared_mpi_suite
from lowcomm.run.config import load_config as load_generic
from lowcomm.tasks.corpus import Corpus
from lowcomm.errors import ConfigError
from lowcomm.run.api import load_config
from lowcomm.run.registry import in_one_job
from lowcomm.tasks import TaskError, dataset_batches, from_functions, load_task

HF_TASK = ROOT / "experiments" / "hf_gpt2_task.py"
TINY_HF = ["task.n_embd=32", "task.n_layer=1", "task.n_head=2", "task.seq_len=32", "batch_size=4",
           "eval_batches=2", "log_every=2"]


# --- the contract --------------------------------------------------------------------------------
def write(tmp_path, text, name="task.py"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


GOOD = """
import torch
def model(cfg): return torch.nn.Linear(4, 1)
def loss(model, batch): return model(batch).pow(2).mean()
def batch(step, rank, world, cfg): return torch.full((2, 4), float(step + rank))
"""


def test_task_file_loads_and_errors_name_the_file_and_function(tmp_path):
    t = load_task(write(tmp_path, GOOD))
    cfg = load_generic()
    m = t.model(cfg)
    assert t.loss(m, t.batch(1, 0, 1, cfg)).shape == () and t.eval_batches(cfg) == []
    missing = write(tmp_path, GOOD.replace("def batch", "def batches"), "nobatch.py")
    with pytest.raises(TaskError, match=r"nobatch\.py: defines no function batch\(\)"):
        load_task(missing)
    bad = load_task(write(tmp_path, GOOD.replace(".pow(2).mean()", ""), "vector.py"))
    with pytest.raises(TaskError, match=r"vector\.py: loss\(model, batch\) must return a floating-point "
                                        r"scalar tensor, got a tensor of shape \(2, 1\)"):
        bad.loss(m, bad.batch(1, 0, 1, cfg))
    notmodule = load_task(write(tmp_path, GOOD.replace("torch.nn.Linear(4, 1)", "42"), "int.py"))
    with pytest.raises(TaskError, match=r"int\.py: model\(cfg\) must return a torch.nn.Module, got int"):
        notmodule.model(cfg)
    with pytest.raises(ConfigError, match="no such file or module") as e:
        load_config(None, ["task=no_such_package.task_module"])
    assert e.value.key == "task"
    with pytest.raises(TaskError, match="loss must be callable"):
        from_functions(lambda cfg: None, 3, lambda *a: None)
    detached = load_task(write(tmp_path, GOOD.replace(".pow(2).mean()", ".pow(2).mean().detach()"),
                               "detached.py"))
    with pytest.raises(TaskError, match=r"detached\.py: loss\(model, batch\) returned a tensor "
                                        "without grad_fn"):
        detached.loss(m, detached.batch(1, 0, 1, cfg))       # training: backward needs one
    with torch.no_grad():                                    # evaluating: it is fine
        assert detached.loss(m, detached.batch(1, 0, 1, cfg)).shape == ()


def test_task_table_options_reach_the_task(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(f'[task]\nname = "{HF_TASK}"\nn_embd = 32\npath = "/usr/share/common-licenses"\n')
    cfg = load_config(f, ["task.n_layer=1"])
    assert cfg.task.name == str(HF_TASK)
    assert cfg.task.options == {"n_embd": 32, "path": "/usr/share/common-licenses", "n_layer": 1}
    again = load_config(None, base=cfg.to_dict())        # config.json round trip (--resume)
    assert again.task == cfg.task
    # config.json shows them as task.options.<name>: that spelling sets the option too (it was
    # stored as options["options.x"], which config.json wrote as options.options.x)
    spelled = load_config(f, ["task.options.n_layer=2", "task.options.depth=3"])
    assert spelled.task.options == {"n_embd": 32, "path": "/usr/share/common-licenses", "n_layer": 2,
                                    "depth": 3}


def test_dataset_batches_shard_like_distributed_sampler():
    data = torch.utils.data.TensorDataset(torch.arange(103))
    batch = dataset_batches(data, batch_size=4, seed=5)
    cfg = load_generic()
    world, per_epoch = 3, 103 // 3 // 4               # 8 steps per epoch, 96 samples seen
    seen = [batch(s, r, world, cfg)[0] for s in range(1, per_epoch + 1) for r in range(world)]
    flat = torch.cat(seen)
    assert len(flat) == 96 and len(set(flat.tolist())) == 96, "an epoch sees each sample once"
    assert torch.equal(batch(3, 1, world, cfg)[0], batch(3, 1, world, cfg)[0]), "pure function"
    assert not torch.equal(batch(1, 0, world, cfg)[0], batch(per_epoch + 1, 0, world, cfg)[0]), \
        "a new permutation every epoch"
    with pytest.raises(ValueError, match="fewer than one batch"):
        dataset_batches(data, batch_size=50)(1, 0, 3, cfg)


# --- data from any directory ------------------------------------------------------------------------
def test_directory_corpus_reads_text_skips_binary_and_never_opens_a_fifo(tmp_path):
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"text file {i} " * 400)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.md").write_text("markdown " * 300)
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0" * 100)
    os.mkfifo(tmp_path / "pipe")                    # opening it would block forever
    c = Corpus.load(str(tmp_path), max_bytes=10**6, eval_fraction=0.3)
    assert c.files == 7 and c.skipped == {"binary": 1, "not a regular file": 1}, c.describe()
    assert "7 files read" in c.describe() and "1 binary" in c.describe()
    only_md = Corpus.load(str(tmp_path), glob="**/*.md")
    assert only_md.files == 1 and len(only_md.train) + len(only_md.eval) == len("markdown ") * 300
    with pytest.raises(ValueError, match=rf"data.path '{tmp_path}'.*too few for seq_len \(data.seq_len=10000\)"):
        c.check(10_000, 2)


def test_train_on_a_directory_of_text_files(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for f in sorted(Path("/usr/share/common-licenses").iterdir())[:8]:
        (docs / (f.name + ".txt")).write_bytes(f.read_bytes())
    os.mkfifo(docs / "fifo")
    r = run_ranks(2, "lowcomm", "train", "--quiet", "--out", tmp_path / "run", "--set", "steps=4",
                  "--set", f"data.path={docs}", "--set", "model.d_model=32", "--set",
                  "eval_batches=2", timeout=120)
    assert r.returncode == 0, r.output
    assert "8 files read" in r.stderr and "1 not a regular file" in r.stderr, r.output
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert math.isfinite(s["eval_loss"]) and s["ranks_agree"] is True


# --- every method, one loop -------------------------------------------------------------------------
@pytest.mark.mpi_checks("check_every_method.py", np=3, timeout=400)
def test_every_method_from_python_ends_with_one_model_on_every_rank():
    """tests/mpi/check_every_method.py on 3 ranks, each case asserted on every rank."""
    cases = shared_mpi_suite(3, "check_every_method.py")
    # every registered method built from its spec (async-ps needs the loop's serving side)
    for name in (n for n in in_one_job() if n != "async-ps"):
        assert f"check_every_method.py::test_build_makes_every_registered_method_from_its_spec[{name}]" in cases
    # every registered method (derived from the registry) through the loop
    for name in in_one_job():
        test = "test_ends_with_one_whole_state_on_every_rank_finite_losses_and_bytes_counted"
        assert f"check_every_method.py::{test}[{name}]" in cases, (test, name)
    assert "check_every_method.py::test_the_readmes_example_method_equals_localsgd" in cases


def elsewhere(tmp_path) -> str:
    """The GPT-2 task as a user would have it: a file outside the repository."""
    f = tmp_path / "user" / "my_gpt2_task.py"
    f.parent.mkdir()
    shutil.copy(HF_TASK, f)
    return str(f)


def test_compare_runs_methods_on_a_users_transformers_task(tmp_path):
    task = elsewhere(tmp_path)
    sets = [a for o in (f"task={task}", *TINY_HF) for a in ("--set", o)]
    r = subprocess.run([sys.executable, "-m", "lowcomm.cli", "compare", "--np", "2", "--methods",
                        "ddp,diloco,async-ps", "--steps", "6", "--out",
                        str(tmp_path / "cmp"), *sets], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    results = {x["method"]: x for x in json.loads((tmp_path / "cmp" / "results.json").read_text())}
    assert set(results) == {"ddp", "diloco", "async-ps"}, results
    for name, x in results.items():
        s = json.loads((tmp_path / "cmp" / name / "summary.json").read_text())
        assert x["status"] == "ok" and s["task"] == task, (name, x)
        assert math.isfinite(s["eval_loss"]) and s["bytes_total"] > 0, (name, s)
    assert results["diloco"]["bytes_total"] < results["ddp"]["bytes_total"] / 3


def test_the_docs_show_the_example_method_that_the_tests_run():
    page = (ROOT / "docs" / "extending.md").read_text()
    code = (ROOT / "experiments" / "example_method.py").read_text()
    assert code.strip() in page, "docs/extending.md must show experiments/example_method.py"
    assert len(code.strip().splitlines()) <= 45
