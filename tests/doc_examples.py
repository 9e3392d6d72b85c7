"""The examples of the README and of the docs' guides, as the tests run them.

Every fenced ``python`` or ``bash`` block is preceded by a marker comment saying how it is run:

* ``<!-- test: python -->`` — a script, in one process;
* ``<!-- test: python np=2 -->`` — a script on 2 ranks under mpirun (tests/mpi/check_docs.py);
* ``<!-- test: bash -->`` — shell commands, with the virtual environment on ``PATH``;
* ``<!-- test: file NAME -->`` — the block is the content of file NAME, which later blocks of
  the same page use; above a ``{literalinclude} PATH`` block (the page shows the file at PATH,
  relative to the page, e.g. the small model of ``docs/examples/toy.py``) that file's content;
* ``<!-- test: skip: REASON -->`` — not run, for the reason given (CI's own commands, a cluster).

Blocks of one page run in order, in one work folder of their own (with ``launchers``,
``experiments`` and ``docs`` linked in), so a page reads as a session a newcomer would type.
A ``python`` or ``bash`` block without a marker is an error: no example escapes the tests.
Nothing is run that the page does not show: a block runs as a reader pastes it (into a file,
with the page's files beside it).
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs").glob("methods/*.md"))]
MARK = re.compile(r"<!--\s*test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
INCLUDE = re.compile(r"^```\{literalinclude\}\s+(\S+)\s*$")
RUNNABLE = ("python", "bash")

@dataclass
class Example:
    page: Path
    line: int
    lang: str
    kind: str                      # python | bash | file | skip
    code: str
    options: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def script(self) -> str:
        """The code to run: the block as the page shows it."""
        return self.code


def parse_marker(text: str) -> tuple[str, dict]:
    """``"python np=2"`` -> ("python", {"np": "2"}); ``"file toy.py"`` -> ("file", {"name": "toy.py"})."""
    if text.startswith("skip:"):
        return "skip", {"reason": text[5:].strip()}
    words = shlex.split(text)
    kind, opts = words[0], {}
    for w in words[1:]:
        k, eq, v = w.partition("=")
        opts[k] = v if eq else True
    if kind == "file":
        opts = {"name": words[1]}
    return kind, opts


def examples(page: Path) -> list[Example]:
    """The fenced blocks of ``page`` with their markers (see the module docstring)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        inc = INCLUDE.match(lines[i])
        if inc:                     # a file the page shows from docs/: its content, as it is
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            marker = _marker_above(lines, i)
            if marker and marker[0] == "file":
                code = (page.parent / inc.group(1)).read_text()
                out.append(Example(page, i + 1, "python", "file", code, marker[1]))
            i = j + 1
            continue
        m = FENCE.match(lines[i])
        if not m or not m.group(1) and i == 0:
            i += 1
            continue
        if not m.group(1):          # a closing fence met first: skip it
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        code = "\n".join(lines[i + 1:j]) + "\n"
        marker = _marker_above(lines, start)
        if marker:
            kind, opts = marker
            out.append(Example(page, start + 1, lang, kind, code, opts))
        elif lang in RUNNABLE:
            out.append(Example(page, start + 1, lang, "unmarked", code))
        i = j + 1
    return out


def _marker_above(lines: list[str], start: int) -> tuple[str, dict] | None:
    """The parsed marker on the last non-blank line above line ``start``, if there is one."""
    k = start - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    marker = MARK.match(lines[k].strip()) if k >= 0 else None
    return parse_marker(marker.group(1)) if marker else None


def all_examples() -> list[Example]:
    return [e for p in PAGES for e in examples(p)]


def work_dir(page: Path, base: Path) -> Path:
    """The page's work folder under ``base``, with the repository's launchers, experiments and
    docs linked in."""
    d = base / str(page.relative_to(ROOT)).replace("/", "_").replace(".md", "")
    d.mkdir(parents=True, exist_ok=True)
    for name in ("launchers", "experiments", "docs"):
        try:
            os.symlink(ROOT / name, d / name)
        except FileExistsError:      # made already (by this page's earlier block, or another rank)
            pass
    return d
