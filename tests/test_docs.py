"""The documentation: it builds without a warning, the README stays short, no work-item numbers
anywhere, and every example of the README and the guides runs (tests/doc_examples.py)."""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, run_mpi_suite, scaled
from doc_examples import all_examples, work_dir

KINDS = ("python", "bash", "file", "skip")


def test_every_example_is_marked_with_how_it_runs():
    found = all_examples()
    assert len(found) >= 20, f"only {len(found)} examples found: the parser is broken"
    bad = [f"{e.id}: {e.kind}" for e in found if e.kind not in KINDS]
    assert not bad, "examples without a known '<!-- test: ... -->' marker:\n" + "\n".join(bad)
    assert all(e.options.get("reason") for e in found if e.kind == "skip"), "a skip needs its reason"
    # what a block may say of how it runs: nothing it does not show runs before it
    assert all(set(e.options) <= {"np"} for e in found if e.kind in ("python", "bash")), \
        [e.id for e in found if e.kind in ("python", "bash") and set(e.options) - {"np"}]


def test_readme_is_short_and_no_work_item_numbers_anywhere():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    pattern = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("README.md", "docs", "lowcomm", "tests",
                                                      "experiments", "scripts")
            for p in ([ROOT / base] if base.endswith(".md") else (ROOT / base).rglob("*"))
            if p.is_file() and p.suffix in (".md", ".py", ".toml", ".sh")
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if pattern.search(line)]
    assert not hits, "work-item numbers in " + ", ".join(hits)


def test_docs_build_without_a_warning(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b",
                        "html", str(ROOT / "docs"), str(tmp_path / "html")],
                       capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "html" / "configuration.html").exists()
    # offline: no page loads a script or a stylesheet from elsewhere (MathJax from a CDN did),
    # and the formulas are MathML in the page, not TeX left for a script to typeset
    remote = re.compile(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    pages = sorted((tmp_path / "html").rglob("*.html"))
    hits = [f"{p.name}: {m}" for p in pages for m in remote.findall(p.read_text())]
    assert not hits, "pages load from the network: " + "; ".join(hits[:5])
    html = (tmp_path / "html" / "methods" / "data-parallel.html").read_text()
    assert html.count("<math") >= 10 and "\\frac" not in html


def run_local(example, folder: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(folder)}
    if example.kind == "file":
        (folder / example.options["name"]).write_text(example.code)
        return
    cmd = ["bash", "-euo", "pipefail", "-c", example.code] if example.kind == "bash" else \
        [sys.executable, "-c", example.script()]
    r = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert r.returncode == 0, f"{example.id} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_every_example_runs():
    """Page by page, in order, in one work folder per page: the files, the one-process scripts
    and the shell commands here; then every 2-rank script in one mpirun."""
    with tempfile.TemporaryDirectory() as base:
        base = Path(base)
        for page in {e.page for e in all_examples()}:
            work_dir(page, base)             # made here, before the ranks need them
        for e in all_examples():
            if e.kind in ("file", "bash") or (e.kind == "python" and "np" not in e.options):
                run_local(e, work_dir(e.page, base))
        cases = run_mpi_suite(2, "check_docs.py", timeout=600,
                              env={"LOWCOMM_DOCS_WORK": str(base)})
    assert len(cases) == sum(e.kind == "python" and e.options.get("np") == "2"
                             for e in all_examples())


@pytest.mark.parametrize("text,kind,opts", [
    ("python np=2", "python", {"np": "2"}),
    ("file my_task.py", "file", {"name": "my_task.py"}),
    ("skip: CI's own", "skip", {"reason": "CI's own"})])
def test_markers_parse(text, kind, opts):
    from doc_examples import parse_marker
    assert parse_marker(text) == (kind, opts)


def test_every_public_name_is_on_the_api_page():
    """The public page documents each name of ``lowcomm.__all__`` under that name, and leads
    with the public API, not the communication layer's modules (those are on Internals)."""
    import lowcomm
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: lowcomm\.(\w+)$", text, re.M))
    documented |= set(re.findall(r"^\.\. py:\w+:: (\w+)\n   :module: lowcomm$", text, re.M))
    missing = [n for n in lowcomm.__all__ if n != "__version__" and n not in documented]
    assert not missing, f"public names missing from docs/api.md: {missing}"
    assert "`lowcomm.__version__`" in text
    assert not re.search(r"automodule:: lowcomm\.(comm|strategies|run)\b", text)


def test_configuration_reference_keeps_whole_comments_and_has_a_heading_per_table():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import lowcomm_config
    finally:
        sys.path.pop(0)
    from lowcomm.run.registry import STRATEGIES
    from lowcomm.strategies.sync.syncdp import SyncDPSettings
    from lowcomm.run.config import CommConfig
    # a comment continued on the next line, and a block comment above a key
    assert lowcomm_config.field_comments(SyncDPSettings)["overlap"].endswith(
        "when a core is left for it (see SyncDP)")
    assert "$LOWCOMM_TIMEOUT_S" in lowcomm_config.field_comments(CommConfig)["timeout_s"]
    lines = lowcomm_config.whole_reference(str(ROOT / "docs"))
    headings = [line for line in lines if line.startswith("#")]
    for name in STRATEGIES:
        assert f"### `{name}`" in headings, name
    for table in ("[data]", "[optimizer]", "[comm]", "[compressor]", "[task]"):
        assert f"### `{table}`" in headings, table
    assert not [h for h in headings if re.search(r":(mod|func|class):`", h)]
    assert not [line for line in lines if re.search(r":(mod|func|class|meth):`", line)]
