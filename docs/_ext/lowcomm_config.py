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

from docutils import nodes
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
    """A Markdown table of ``cls``'s fields (nested dataclass fields are their own tables)."""
    notes = field_comments(cls)
    lines = [f"**{title}**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        value = default_of(f)
        if f.name in skip or dataclasses.is_dataclass(value):
            continue
        shown = repr(value) if not isinstance(value, float) else f"{value:g}"
        lines.append(f"| `{prefix}{f.name}` | {_cell(_type(f))} | `{_cell(shown)}` | "
                     f"{_cell(notes.get(f.name, ''))} |")
    return lines + [""]


def summary_line(cls) -> str:
    """The first line of ``cls``'s own docstring (not the one dataclasses makes up)."""
    doc = " ".join((cls.__dict__.get("__doc__") or "").split())
    if not doc or doc.startswith(cls.__name__ + "("):
        return ""
    return doc.split(". ")[0].rstrip(".") + "."


class LowcommConfig(Directive):
    """The whole reference; with an argument, only the tables of the methods it names
    (``{lowcomm-config} diloco streaming-diloco``)."""
    optional_arguments = 20

    def run(self):
        from lowcomm.run.registry import STRATEGIES
        if not self.arguments:
            lines = run_tables()
            for name, m in STRATEGIES.items():
                lines += method_table(name, m)
        else:
            lines = []
            tables = {f"[{k}]": v for k, v in run_subtables().items()}
            for name in self.arguments:
                if name in tables:
                    lines += tables[name]
                elif name in STRATEGIES:
                    lines += method_table(name, STRATEGIES[name])
                else:
                    raise self.error(f"{name!r} is neither a registered method ({', '.join(STRATEGIES)}) "
                                     f"nor a table ({', '.join(tables)})")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="lowcomm-config"), 0, container)
        return container.children


def method_table(name: str, m) -> list[str]:
    return table(f"[strategy] with name = \"{name}\" — {m.summary}", m.settings, "strategy.")


def run_subtables() -> dict[str, list[str]]:
    """``{table name: its lines}`` for the run's sub-tables ([optimizer], [compressor], ...)."""
    from lowcomm.run.config import Config
    out = {}
    for f in dataclasses.fields(Config):
        value = default_of(f)
        if dataclasses.is_dataclass(value):
            note = summary_line(type(value))
            out[f.name] = table(f"[{f.name}]" + (f" — {note}" if note else ""), type(value), f"{f.name}.")
    return out


def run_tables() -> list[str]:
    """The run's own keys and its sub-tables."""
    from lowcomm.run.config import Config
    lines = table("The run's own keys (top level)", Config, "", skip=("policy", "strategy", "task"))
    lines += ["`policy.<level>`: a method's spec string for one level of the topology, e.g. "
              "`policy.dc = \"diloco:period=50\"`; `strategy.name`: the method, whose keys "
              "follow.", ""]
    for lines_of_table in run_subtables().values():
        lines += lines_of_table
    return lines


def setup(app):
    app.add_directive("lowcomm-config", LowcommConfig)
    return {"version": "1", "parallel_read_safe": True}
