"""Every list of methods is derived from the registry: each registered method is in ``lowcomm
compare``, ``lowcomm methods``, the every-method checks (tests/mpi/helpers.every_method), the
docs' method table and pages, and on the API page; and a method registered from outside
(tests/toy_method.py, through ``lowcomm.register``) appears in all of them with no other file
touched."""
import json
import re
import subprocess
import sys

import pytest

import lowcomm
from conftest import ROOT
from lowcomm.run.registry import (STRATEGIES, catalogue, example, in_one_job, parse_spec, register,
                                  settings)
from lowcomm.tools.compare import VARIANTS, methods, resolve_methods

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import helpers  # noqa: E402
import lowcomm_config  # noqa: E402

BUILT_IN = [n for n, m in STRATEGIES.items() if m.build.__module__.startswith("lowcomm.")]


def api_names() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: lowcomm\.(\w+)$", text, re.M))


@pytest.fixture
def toy():
    """tests/toy_method.py imported (its method registered) for one test, then forgotten."""
    assert "toy-average" not in STRATEGIES
    try:
        import toy_method
        yield toy_method
    finally:
        STRATEGIES.pop("toy-average", None)
        sys.modules.pop("toy_method", None)


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_built_in_method_is_in_every_derived_table(name):
    m = STRATEGIES[name]
    spec, keys = example(m)
    got, opts = parse_spec(spec)
    assert got is m, f"{name}'s example {spec!r} names {got.name}"
    settings(m, opts, "")                                   # valid settings
    assert name in {r["name"] for r in catalogue()}
    if m.fleet or m.splits:      # a fleet's only, or a model splitter: its own checks
        assert name not in methods() and name not in helpers.every_method({})
    else:
        assert methods()[m.compare_name or name] == [f"strategy.name={name}", *m.compare]
        assert helpers.every_method({})[name] == (spec, keys)
    assert not m.optimizer or keys == [f"optimizer.name={m.optimizer}"]
    # the Python name: public, and documented on the API page
    assert m.python in lowcomm.__all__, f"{name}: python={m.python!r} is not a public lowcomm name"
    assert m.python in api_names(), f"lowcomm.{m.python} ({name}) is missing from docs/api.md"
    # a section of a methods page embeds its table, and the generated table links it
    pages = lowcomm_config.method_pages(str(ROOT / "docs"))
    assert name in pages, f"no docs/methods page embeds {{lowcomm-config}} {name}"
    row = [r for r in lowcomm_config.methods_table(str(ROOT / "docs")) if r.startswith(f"| [`{name}`](")]
    assert len(row) == 1 and f"`lowcomm.{m.python}`" in row[0], row


def test_the_api_page_names_every_built_in_method_and_what_the_issue_found_missing():
    missing = sorted({STRATEGIES[n].python for n in BUILT_IN} - api_names())
    assert not missing, f"docs/api.md lacks {missing}"
    assert {"ZeroOneAdam", "Sparta", "MuonAdamW", "CompressorSettings", "train_fleet"} <= api_names()


def test_compare_lists_every_compressor_and_variant_once():
    from lowcomm.compress import COMPARE, COMPRESSORS
    known = methods()
    assert known["ddp"] == ["strategy.name=syncdp"]
    # a compressor with its own compare settings (compress.COMPARE) after its name
    assert all(known[c] == [f"compressor.name={c}", *COMPARE.get(c, ())] for c in COMPRESSORS if c != "none")
    assert known["ef-sign"] == ["compressor.name=ef-sign", "lr=0.0003"]
    assert all(known[v] == o for v, o in VARIANTS.items())
    assert len(known) == len(in_one_job()) + len(COMPRESSORS) - 1 + len(VARIANTS)


def test_a_method_registered_from_outside_appears_in_every_derived_table(toy):
    # lowcomm compare: under its compare name, with its own settings
    assert methods()["toy"] == ["strategy.name=toy-average", "strategy.period=5"]
    assert "toy" in resolve_methods("all") and resolve_methods("toy") == ["toy"]
    # lowcomm methods, the docs' method table and the configuration reference
    assert {"name": "toy-average", "python": "toy_method.build", "optimizer": "adam",
            "example": "toy-average:period=2", "compare": "toy",
            "summary": "a toy: average the parameters every H steps"} in catalogue()
    rows = lowcomm_config.methods_table(str(ROOT / "docs"))
    assert "| `toy-average` | `toy_method.build` | `optimizer.name = \"adam\"` | `toy` | " \
           "a toy: average the parameters every H steps |" in rows
    ref = lowcomm_config.whole_reference(str(ROOT / "docs"))
    at = ref.index("### `toy-average`")
    assert "| `strategy.period` | int | `4` | H: local steps between averagings |" in ref[at:at + 8]
    # the every-method checks (tests/mpi/check_every_method.py, check_optimizer.py, check_resize.py)
    assert helpers.every_method({})["toy-average"] == ("toy-average:period=2", ["optimizer.name=adam"])


def test_a_task_that_registers_a_method_can_name_it_in_its_keys():
    """The task is loaded before the method keys are checked (it may register the method)."""
    from lowcomm.run.api import load_config
    assert "toy-average" not in STRATEGIES
    try:
        cfg = load_config(None, [f"task={ROOT / 'tests' / 'toy_method.py'}",
                                 "strategy.name=toy-average", "strategy.period=3"])
        assert cfg.strategy == {"name": "toy-average", "period": 3}
    finally:
        STRATEGIES.pop("toy-average", None)
        sys.modules.pop("toy_method", None)
        sys.modules.pop("lowcomm_task_toy_method", None)


def test_lowcomm_methods_lists_the_built_in_ones_and_a_task_s():
    r = subprocess.run([sys.executable, "-m", "lowcomm.cli", "methods", "--json", "--set",
                        f"task={ROOT / 'tests' / 'toy_method.py'}"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["name"] for row in rows] == [*BUILT_IN, "toy-average"]
    assert rows[-1]["compare"] == "toy" and rows[-1]["python"] == "toy_method.build"


def test_register_refuses_a_name_a_compare_name_or_an_example_it_cannot_take(toy):
    m = toy.METHOD
    import dataclasses
    with pytest.raises(ValueError, match="registered already"):
        register(m)
    with pytest.raises(ValueError, match="lowcomm compare already has 'toy' .method 'toy-average'."):
        register(dataclasses.replace(m, name="toy-2", example=""))
    with pytest.raises(ValueError, match="example 'diloco:period=2' must be a spec of 'toy-3'"):
        register(dataclasses.replace(m, name="toy-3", compare_name="t3", example="diloco:period=2"))
    assert "toy-2" not in STRATEGIES and "toy-3" not in STRATEGIES
