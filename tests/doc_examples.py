"""The examples of the README and of the docs' guides, as the tests run them.

Every fenced ``python`` or ``bash`` block is preceded by a marker comment saying how it is run:

* ``<!-- test: python -->`` — a script, in one process;
* ``<!-- test: python np=2 -->`` — a script on 2 ranks under mpirun (tests/mpi/check_docs.py);
  ``prelude=NAME`` runs :data:`PRELUDES` ``[NAME]`` first (the user's model, data and loss that
  a fragment takes as given);
* ``<!-- test: bash -->`` — shell commands, with the virtual environment on ``PATH``;
* ``<!-- test: file NAME -->`` — the block is the content of file NAME, which later blocks of
  the same page use;
* ``<!-- test: skip: REASON -->`` — not run, for the reason given (CI's own commands, a cluster).

Blocks of one page run in order, in one work folder of their own (with ``launchers`` and
``experiments`` linked in), so a page reads as a session a newcomer would type. A ``python``
or ``bash`` block without a marker is an error: no example escapes the tests.
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
RUNNABLE = ("python", "bash")

PRELUDES = {
    # a small model with BatchNorm, its loss and 20 steps of this rank's batches
    "toy": """
import torch, lowcomm
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 1))
loss_fn = torch.nn.functional.mse_loss
steps = 20
_g = torch.Generator().manual_seed(lowcomm.init().rank)
batches = [(x, x.sum(1, keepdim=True)) for x in (torch.randn(16, 8, generator=_g) for _ in range(steps))]
""",
    # language-model examples of real text: {"input_ids", "labels"} windows of 32 bytes
    "text": """
import torch
from pathlib import Path
_text = b"".join(p.read_bytes() for p in sorted(Path("/usr/share/common-licenses").iterdir())
                 if p.is_file())[:120_000]
class _Windows(torch.utils.data.Dataset):
    def __init__(self, data): self.x = torch.tensor(list(data), dtype=torch.long).view(-1, 32)
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {"input_ids": self.x[i], "labels": self.x[i]}
train, held_out = _Windows(_text[:96_000]), _Windows(_text[96_000:96_000 + 8_192])
""",
}


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
        """The code to run, its prelude first."""
        prelude = PRELUDES[self.options["prelude"]] if "prelude" in self.options else ""
        return prelude + "\n" + self.code


def parse_marker(text: str) -> tuple[str, dict]:
    """``"python np=2 prelude=toy"`` -> ("python", {"np": "2", "prelude": "toy"})."""
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
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARK.match(lines[k].strip()) if k >= 0 else None
        if marker:
            kind, opts = parse_marker(marker.group(1))
            out.append(Example(page, start + 1, lang, kind, code, opts))
        elif lang in RUNNABLE:
            out.append(Example(page, start + 1, lang, "unmarked", code))
        i = j + 1
    return out


def all_examples() -> list[Example]:
    return [e for p in PAGES for e in examples(p)]


def work_dir(page: Path, base: Path) -> Path:
    """The page's work folder under ``base``, with the repository's launchers and experiments
    linked in."""
    d = base / str(page.relative_to(ROOT)).replace("/", "_").replace(".md", "")
    d.mkdir(parents=True, exist_ok=True)
    for name in ("launchers", "experiments"):
        try:
            os.symlink(ROOT / name, d / name)
        except FileExistsError:      # made already (by this page's earlier block, or another rank)
            pass
    return d
