"""``lowcomm bench memory`` and ``lowcomm bench step`` on the model-parallel axes: the rows of
``pp`` and ``tp`` exist and agree with the split they ran (each a real 2-rank mpirun)."""
import json
import subprocess
import sys

from conftest import ROOT, run_ranks, scaled
from lowcomm.parallel.chains import chain_for
from lowcomm.parallel.pipeline import bubble_formula
from lowcomm.parallel.plans import tinygpt_plan
from lowcomm.parallel.stages import Stage, cut
from lowcomm.tasks.tinygpt import TinyGPT

D, LAYERS, HEADS, SEQ = 64, 4, 4, 64
SETS = ["--set", f"model.d_model={D}", "--set", f"model.n_layers={LAYERS}", "--set",
        f"model.n_heads={HEADS}", "--set", "batch_size=8", "--set", "optimizer.name=adamw"]


def stage_bytes(model, parts: int) -> int:
    """The largest pipeline stage's parameter bytes (a tied tensor once per stage)."""
    chain = chain_for(model)
    b = cut(model, chain, parts, "params")
    return max(4 * sum(p.numel() for p in Stage(model, chain, i, parts, b[i], b[i + 1]).parameters())
               for i in range(parts))


def tp_bytes(model, degree: int) -> int:
    """A rank's parameter bytes under tp: the plan's split parameters 1/degree, the rest whole."""
    split = {}
    for name, style in tinygpt_plan(model, False).styles.items():
        module = model.get_submodule(name)
        for pname, dim in style._dims(module).items():
            if dim is not None:
                split[id(getattr(module, pname))] = degree
    return sum(4 * p.numel() // split.get(id(p), 1) for p in model.parameters())


def test_memory_rows_of_pp_and_tp_hold_their_parts(tmp_path):
    out = tmp_path / "memory.json"
    r = subprocess.run([sys.executable, "-m", "lowcomm.cli", "bench", "memory", "--ranks", "2",
                        "--method", "pp", "--method", "tp", *SETS, "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=scaled(400))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {x["method"]: x for x in json.loads(out.read_text())["table"]}
    model = TinyGPT(SEQ, D, LAYERS, HEADS)
    whole = 4 * sum(p.numel() for p in model.parameters())
    assert rows["pp"]["param_bytes"] == stage_bytes(model, 2) < whole
    assert rows["tp"]["param_bytes"] == tp_bytes(model, 2) < whole
    for row in rows.values():
        assert row["grad_bytes"] == row["param_bytes"]
        extra = row["optimizer_state_bytes"] - 2 * row["param_bytes"]     # AdamW's two moments
        assert 0 <= extra < 0.01 * row["param_bytes"], row                # (and its step counts)
        assert row["activation_bytes"] > 0 and row["peak_bytes"] > row["param_bytes"]
        assert row["params"] == whole // 4


def test_step_rows_of_pp_and_tp_time_a_step_and_the_pipelines_bubble(tmp_path):
    out = tmp_path / "step.json"
    r = run_ranks(2, "lowcomm", "bench", "step", "--strategies", "local,pp,tp", "--steps", "2",
                  "--warmup", "1", *SETS, "--json", out, timeout=300)
    assert r.returncode == 0, r.output
    rows = {x["strategy"]: x for x in json.loads(out.read_text())}
    assert list(rows) == ["local", "pp", "tp"]
    assert all(x["step_ms"] > 0 for x in rows.values()) and len({x["params"] for x in rows.values()}) == 1
    assert rows["pp"]["pp_bubble_formula"] == bubble_formula("1F1B", 2, 4)
    assert 0 <= rows["pp"]["pp_bubble"] < 1
    assert "pp_bubble" not in rows["tp"]
    assert f"({bubble_formula('1F1B', 2, 4):.2f})" in r.stdout
