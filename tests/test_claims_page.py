"""docs/results/claims.md: the page is what experiments/claims.py writes from its data file (no
hand edits), every ratio on it is the ledger's bytes of the runs it names, and the verdict rule
says what the page says it does. Nothing is trained."""
import importlib.util
import json

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def claims():
    spec = importlib.util.spec_from_file_location("claims", ROOT / "experiments" / "claims.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_page_is_generated_from_its_data(claims, tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "PAGE", tmp_path / "claims.md")
    claims.page()
    assert (tmp_path / "claims.md").read_text() == (ROOT / "docs" / "results" / "claims.md").read_text()


def test_every_ratio_is_the_ledgers_bytes_of_the_runs_named(claims):
    data = json.loads(claims.DATA.read_text())
    measured = [r for r in claims.rows(data) if r["ratio"] is not None]
    assert measured, "no claim row measured"
    for r in measured:
        runs = data["workloads"][r["workload"]]["runs"]
        run, base = runs[r["run"]], runs[r["base"]]
        if r["method"] == "Streaming DiLoCo":     # bandwidth: per step against the peak over τ = 5
            want = base["bytes_total"] / base["steps"] / (run["sync_bytes_peak"] / 5)
        else:                                   # the initial broadcast left out
            want = (base["bytes_total"] - base["bcast_bytes"]) / (run["bytes_total"] - run["bcast_bytes"])
        assert r["ratio"] == pytest.approx(want, rel=1e-12), r
        assert run["steps"] == base["steps"] and run["ranks"] == base["ranks"], \
            f"{r['run']} and {r['base']} did not see the same tokens"
        assert run["ranks_agree"] is True and base["ranks_agree"] is True


def test_the_verdict_rule(claims):
    equal = {"target": 100, "loss": "equal"}
    better = {"target": 8, "loss": "better"}
    assert claims.verdict(equal, 90.0, 1.0199, 1.0) == "holds"             # both at the edge
    assert claims.verdict(equal, 95.0, 1.05, 1.0) == "holds for bytes; loss worse (+5.0 %)"
    assert claims.verdict(equal, 89.0, 1.0, 1.0).startswith(
        "does not hold at this scale: 89.0× of the claim's 100×; loss holds")
    assert claims.verdict(better, 10.0, 0.99, 1.0) == "holds"
    assert claims.verdict(better, 10.0, 1.0, 1.0) == "holds for bytes; loss not lower (+0.0 %)"
    assert "loss does not (+10.0 %)" in claims.verdict(better, 1.0, 1.1, 1.0)
