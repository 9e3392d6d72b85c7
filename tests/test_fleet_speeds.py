"""experiments/fleet_speeds.py's reading of eval loss at equal wall-clock, which the fleet-speeds
results page quotes: T is when the quickest run of a speeds made its last evaluation; a run is
read at its last evaluation by then, or with its delivered model once its whole fleet had ended;
the second reading is at synchronous DiLoCo's quickest end. Nothing is run but the table."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, experiment


@pytest.fixture(scope="module")
def fs():
    return experiment("fleet_speeds")


def row(method, wall, evals, loss, rep=0, speeds="1,1,0.5"):
    return {"method": method, "speeds": speeds, "wall_s": wall, "eval_loss": loss, "rep": rep,
            "goodput": 0.9, "steps": [160, 160, 80], "evals": evals}


ROWS = [
    # synchronous: evaluations at 10, 20, 30 s; the fleet ended at 33 s
    row("diloco", 33.0, [[10.0, 20, 3.5], [20.0, 40, 3.2], [30.0, 60, 3.0]], 2.9),
    # asynchronous: datacenter 0 done early (its last evaluation at 12 s), the fleet at 25 s
    row("diloco-async", 25.0, [[6.0, 20, 3.3], [12.0, 40, 3.1]], 2.8),
    # one that had not evaluated by 12 s
    row("torchft", 60.0, [[15.0, 20, 3.4], [40.0, 40, 3.0]], 2.95),
    {"method": "torchft", "speeds": "1,1,0.5", "rep": 1, "failed": "torchft replica 2 exited 1",
     "why": "replica2.0.out: TimeoutError"},
]


def test_equal_wall_clock_is_the_quickest_runs_last_evaluation(fs):
    ok = [r for r in ROWS if "failed" not in r]
    assert fs.equal_wall(ok) == {"1,1,0.5": 12.0}
    assert fs.synchronous_end(ok) == {"1,1,0.5": 30.0}
    # read at T: each run's last evaluation by then; none yet is None (a dash in the table)
    assert [fs.at(r, 12.0) for r in ok] == [3.5, 3.1, None]
    # read when synchronous DiLoCo ended: the asynchronous fleet had ended (25 s <= 30 s), so
    # its delivered model counts; the others their last evaluation by then
    assert [fs.at(r, 30.0) for r in ok] == [3.0, 2.8, 3.4]
    assert fs.equal(ok[:2], 12.0) == "3.1000–3.5000 at 12.0 s"
    assert fs.equal(ok, 12.0) == "–"


def test_the_table_reprints_a_runs_results_with_both_readings_and_its_failures(fs, tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": ROWS, "load": [[0, 0, 0], [0, 0, 0]]}))
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "fleet_speeds.py"),
                          "--table", str(results)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split(" | ")[0].strip("| "): line for line in out.stdout.splitlines()}
    assert "| 3.5000 at 12.0 s | 3.0000 at 30.0 s |" in lines["diloco"], lines["diloco"]
    assert "| 3.1000 at 12.0 s | 2.8000 at 30.0 s |" in lines["diloco-async"]
    assert "failed in 1 of 2 runs: replica2.0.out: TimeoutError" in out.stdout
    assert "| – | 3.4000 at 30.0 s |" in out.stdout
