"""``{lowcomm-config}`` — the configuration reference, generated from the code, so it is never
written twice: the run's own tables (:class:`lowcomm.run.config.Config` and the dataclasses of
its sub-tables) and every registered method's settings dataclass, each key with its type, its
default and the comment written beside it in the source."""
from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize

from docutils.parsers.rst import Directive
from docutils.statemachine import StringList


def field_comments(cls) -> dict[str, str]:
    """``{field: the comment on its line}`` for ``cls`` and its dataclass bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        names = {f.name for f in dataclasses.fields(klass)}
        line_field: dict[int, str] = {}
        for i, line in enumerate(src.splitlines(), 1):
            head = line.strip().split(":")[0]
            if head in names and line.startswith("    ") and not line.startswith("     "):
                line_field[i] = head
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT and tok.start[0] in line_field:
                out[line_field[tok.start[0]]] = tok.string.lstrip("#").strip()
    return out


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("|", "or")


def _cell(text: str) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|") or " "


def table(title: str, cls, prefix: str, skip=()) -> list[str]:
    """An RST list-table of ``cls``'s fields (nested dataclass fields are their own tables)."""
    notes = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(default_of(f)):
            continue
        value = default_of(f)
        shown = repr(value) if not isinstance(value, float) else f"{value:g}"
        rows.append((f"``{prefix}{f.name}``", _type(f), f"``{shown}``", notes.get(f.name, "")))
    lines = [f".. list-table:: {title}", "   :header-rows: 1", "   :widths: 22 12 16 50", "",
             "   * - key", "     - type", "     - default", "     - meaning"]
    for key, typ, default, note in rows:
        lines += [f"   * - {_cell(key)}", f"     - {_cell(typ)}", f"     - {_cell(default)}",
                  f"     - {_cell(note)}"]
    return lines + [""]


class LowcommConfig(Directive):
    """The whole reference: the run's tables, then one table per registered method."""

    def run(self):
        from lowcomm.run.config import Config
        from lowcomm.run.registry import STRATEGIES
        lines = table("The run's own keys (top level)", Config, "",
                      skip=("policy", "strategy", "task"))
        lines += ["``policy.<level>``: a method's spec string for one topology level, e.g. "
                  "``policy.dc = \"diloco:period=50\"``; ``strategy.name``: the method (below).", ""]
        for f in dataclasses.fields(Config):
            value = default_of(f)
            if dataclasses.is_dataclass(value):
                lines += table(f"``[{f.name}]``" + (f" — {inspect.getdoc(type(value)).splitlines()[0]}"
                                                   if type(value).__doc__ else ""),
                               type(value), f"{f.name}.")
        for name, m in STRATEGIES.items():
            lines += [f"``strategy.name = \"{name}\"`` — {m.summary}", ""]
            lines += table(f"``[strategy]`` keys of ``{name}``", m.settings, "strategy.")
        node_list = StringList(lines, source="lowcomm-config")
        from docutils import nodes
        container = nodes.container()
        self.state.nested_parse(node_list, 0, container)
        return container.children


def setup(app):
    app.add_directive("lowcomm-config", LowcommConfig)
    return {"version": "1", "parallel_read_safe": True}
