"""``{lowcomm-project}``: a ``lowcomm project`` command and what it prints, run when the docs are
built (from the repository root), so a page of projections is the command's output of the day.

    ```{lowcomm-project}
    lowcomm project docs/results/data/which-method.json --ranks 8,64 --link 25,100 --target 2.6
    ```

A command that is not ``lowcomm project``, or that fails, fails the build with its message."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList


def run_project(args: list[str], root: Path) -> str:
    """What ``lowcomm ARGS`` prints, run in ``root``; a RuntimeError with its output if it fails."""
    from click.testing import CliRunner

    from lowcomm.cli.main import cli
    here = os.getcwd()
    os.chdir(root)
    try:
        r = CliRunner().invoke(cli, args)
    finally:
        os.chdir(here)
    if r.exit_code != 0:
        raise RuntimeError(f"exit status {r.exit_code}: {r.output.strip()} {r.exception or ''}")
    return r.output


class LowcommProject(Directive):
    """The command (shown as a code block) and its output (Markdown tables)."""
    has_content = True

    def run(self):
        env = self.state.document.settings.env
        root = Path(env.srcdir).parent
        text = "\n".join(self.content)
        args = shlex.split(text.replace("\\\n", " "))
        if args[:2] != ["lowcomm", "project"]:
            raise self.error(f"{{lowcomm-project}} runs `lowcomm project ...`, got {text!r}")
        folder = root / args[2] if len(args) > 2 else None
        if folder is not None and folder.is_file():
            env.note_dependency(str(folder))
        try:
            out = run_project(args[1:], root)
        except RuntimeError as e:
            raise self.error(f"{text}: {e}") from None
        lines = ["```bash", *self.content, "```", "", *out.splitlines()]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="lowcomm-project"), 0, container)
        return container.children


def setup(app):
    app.add_directive("lowcomm-project", LowcommProject)
    return {"version": "1", "parallel_read_safe": True}
