"""The README's and the docs' Python examples marked ``python np=2``, each on 2 ranks, in its
page's work folder (made by tests/test_docs.py, which passes its location)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from doc_examples import all_examples, work_dir  # noqa: E402

CASES = [e for e in all_examples() if e.kind == "python" and e.options.get("np") == "2"]


@pytest.mark.parametrize("example", CASES, ids=[e.id for e in CASES])
def test_example(example, comm):
    here = os.getcwd()
    folder = work_dir(example.page, Path(os.environ["LOWCOMM_DOCS_WORK"]))
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        exec(compile(example.script(), example.id, "exec"), {"__name__": "__main__"})
    finally:
        sys.path.remove(str(folder))
        os.chdir(here)
        # the page's own modules (toy.py) afresh for the next block, as a new script gets them
        for name in [n for n, m in sys.modules.items()
                     if str(getattr(m, "__file__", None) or "").startswith(str(folder))]:
            del sys.modules[name]
