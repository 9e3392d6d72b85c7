"""``{lowcomm-config}`` — the configuration reference, generated from the code, so it is never
written twice: the run's own tables (:class:`lowcomm.run.config.Config` and the dataclasses of
its sub-tables) and every registered method's settings dataclass, each key with its type, its
default and the comment written beside it in the source (all of it: a comment continued on the
lines below, and a block comment above a key).

Without an argument the directive writes the whole reference, a heading per table (so the page
has a contents sidebar and an anchor per table); with arguments (``{lowcomm-config} diloco``) it
writes only those tables, titled in bold, for a method's own page. ``{lowcomm-methods}`` writes
the table of every registered method (its page, Python name, compare name, summary)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import os
import re
import textwrap
import tokenize

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList


def _comments(src: str) -> dict[int, tuple[int, str]]:
    """``{line: (column, text)}`` of every comment in ``src``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    return out


def field_comments(cls) -> dict[str, str]:
    """``{field: its comment}`` for ``cls`` and its dataclass bases: the comments on the field's
    own lines, the comment-only lines just below it indented further (a continuation), and a
    block of comment-only lines just above it at its own indentation. A field redefined
    without a comment (a preset's new default) keeps the comment of its base."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        names = {f.name for f in dataclasses.fields(klass)}
        lines = src.splitlines()
        comments = _comments(src)
        only = {i for i, (col, _) in comments.items() if not lines[i - 1][:col].strip()}
        body = ast.parse(src).body[0].body
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and node.target.id in names):
                continue
            indent = node.col_offset
            above = []
            i = node.lineno - 1
            while i in only and comments[i][0] == indent:
                above.insert(0, comments[i][1])
                i -= 1
            own = [comments[i][1] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
            i = node.end_lineno + 1
            while i in only and comments[i][0] > indent:
                own.append(comments[i][1])
                i += 1
            text = " ".join(t for t in own if t)
            if above:
                text = (text + " — " if text else "") + " ".join(t for t in above if t)
            if text:                         # a subclass's bare override keeps its base's
                out[node.target.id] = text
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


_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|obj|exc):`~?([^`]+)`")


def markdown(rst: str) -> str:
    """An inline reST fragment of a docstring as Markdown: ``:mod:`x``` and ````x```` as `x`."""
    return _ROLE.sub(r"`\1`", rst).replace("``", "`")


def rows(cls, prefix: str, skip=()) -> list[str]:
    """A Markdown table of ``cls``'s fields (nested dataclass fields are their own tables)."""
    notes = field_comments(cls)
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        value = default_of(f)
        if f.name in skip or dataclasses.is_dataclass(value):
            continue
        shown = repr(value) if not isinstance(value, float) else f"{value:g}"
        lines.append(f"| `{prefix}{f.name}` | {_cell(_type(f))} | `{_cell(shown)}` | "
                     f"{_cell(markdown(notes.get(f.name, '')))} |")
    return lines + [""]


def summary(cls) -> str:
    """The first paragraph of ``cls``'s own docstring (not the one dataclasses makes up), in
    Markdown."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    if not doc or doc.startswith(cls.__name__ + "("):
        return ""
    return markdown(" ".join(doc.split("\n\n")[0].split()))


@dataclasses.dataclass
class Table:
    """One table of the reference: its heading, the words under it and its rows."""
    key: str          # "[data]", or a method's name
    heading: str      # the heading's text
    intro: str        # a paragraph under the heading ("" for none)
    rows: list[str]

    def lines(self, level: int) -> list[str]:
        """As a section (``level`` > 0: a Markdown heading of that level) or, at 0, a bold title."""
        title = f"{'#' * level} {self.heading}" if level else f"**{self.heading}**"
        return [title, ""] + ([self.intro, ""] if self.intro else []) + self.rows


def method_table(name: str, m) -> Table:
    return Table(name, f"`{name}`", f"`[strategy]` with `name = \"{name}\"`: {m.summary}.",
                 rows(m.settings, "strategy."))


def run_subtables() -> dict[str, Table]:
    """``{"[table]": its Table}`` for the run's sub-tables ([optimizer], [compressor], ...)."""
    from lowcomm.run.config import Config
    out = {}
    for f in dataclasses.fields(Config):
        value = default_of(f)
        if dataclasses.is_dataclass(value):
            key = f"[{f.name}]"
            out[key] = Table(key, f"`{key}`", summary(type(value)), rows(type(value), f"{f.name}."))
    return out


def method_pages(srcdir: str) -> dict[str, str]:
    """``{method name: the section under methods/ that describes it}``: the page that embeds its
    table, at the heading above the table (MyST's anchor of that heading)."""
    from myst_parser.slugs import github_slugify
    out = {}
    folder = os.path.join(srcdir, "methods")
    for page in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if page.endswith(".md"):
            with open(os.path.join(folder, page), encoding="utf-8") as fh:
                text = fh.read()
            for m in re.finditer(r"```\{lowcomm-config\}([^\n]*)", text):
                headings = re.findall(r"^(#{2,3}) (.+)$", text[:m.start()], re.M)
                anchor = f"#{github_slugify(headings[-1][1])}" if headings else ""
                for name in m.group(1).split():
                    out.setdefault(name, f"methods/{page}{anchor}")
    return out


def whole_reference(srcdir: str) -> list[str]:
    """Every table, a heading each: the run's keys, then every registered method's."""
    from lowcomm.run.config import Config
    from lowcomm.run.registry import STRATEGIES
    lines = ["## The run's tables", "", "### Top level", "",
             "Keys outside any table.", ""]
    lines += rows(Config, "", skip=("policy", "strategy", "task"))
    lines += ["`policy.<level>`: a method's spec string for one level of the topology, e.g. "
              "`policy.dc = \"diloco:period=50\"`; `strategy.name`: the method, whose keys "
              "follow under [the methods' keys](#the-methods-keys-strategy).", ""]
    for t in run_subtables().values():
        lines += t.lines(3)
    pages = method_pages(srcdir)
    lines += ["## The methods' keys (`[strategy]`)", "",
              "`[strategy]` holds `name` and the keys of that method, below; a key of another "
              "method is accepted only at its default.", ""]
    for name, m in STRATEGIES.items():
        t = method_table(name, m)
        if name in pages:
            t.intro += f" Described on [its method page]({pages[name]})."
        lines += t.lines(3)
    return lines


def methods_table(srcdir: str, docname: str = "methods/index") -> list[str]:
    """Every registered method (:func:`lowcomm.run.registry.catalogue`) as a Markdown table: its
    spec name linked to the section that describes it, its Python name, the inner optimizer it
    needs, its name in ``lowcomm compare`` and its summary. A method no page describes is listed
    without a link (``test_docs`` asks every built-in one to have a page)."""
    from lowcomm.run.registry import catalogue
    pages = method_pages(srcdir)
    here = os.path.dirname(docname)
    lines = ["| spec name | Python | needs | `lowcomm compare` | what it does |",
             "|---|---|---|---|---|"]
    for r in catalogue():
        name = f"`{r['name']}`"
        if r["name"] in pages:
            page, _, anchor = pages[r["name"]].partition("#")
            name = f"[{name}]({os.path.relpath(page, here or '.')}{'#' + anchor if anchor else ''})"
        python = r["python"] if "." in r["python"] else f"lowcomm.{r['python']}" if r["python"] else ""
        python = f"`{python}`" if python else ""
        need = f"`optimizer.name = \"{r['optimizer']}\"`" if r["optimizer"] else ""
        lines.append(f"| {name} | {python} | {need} | `{r['compare']}` | {r['summary']} |")
    return lines + [""]


class LowcommMethods(Directive):
    """``{lowcomm-methods}``: the table of every registered method (:func:`methods_table`)."""

    def run(self):
        env = self.state.document.settings.env
        container = nodes.container()
        self.state.nested_parse(StringList(methods_table(env.srcdir, env.docname),
                                           source="lowcomm-methods"), 0, container)
        return container.children


class LowcommConfig(Directive):
    """The whole reference; with an argument, only the tables of the methods it names
    (``{lowcomm-config} diloco streaming-diloco``)."""
    optional_arguments = 20

    def run(self):
        from lowcomm.run.registry import STRATEGIES
        env = self.state.document.settings.env
        if not self.arguments:
            lines = whole_reference(env.srcdir)
        else:
            lines = []
            tables = run_subtables()
            for name in self.arguments:
                if name in tables:
                    lines += tables[name].lines(0)
                elif name in STRATEGIES:
                    lines += method_table(name, STRATEGIES[name]).lines(0)
                else:
                    raise self.error(f"{name!r} is neither a registered method ({', '.join(STRATEGIES)}) "
                                     f"nor a table ({', '.join(tables)})")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="lowcomm-config"), 0, container,
                                match_titles=not self.arguments)
        return container.children


def setup(app):
    app.add_directive("lowcomm-config", LowcommConfig)
    app.add_directive("lowcomm-methods", LowcommMethods)
    return {"version": "2", "parallel_read_safe": True}
