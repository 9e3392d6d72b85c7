"""Math as MathML written into the pages when they are built (latex2mathml): no script, no CDN,
so the formulas render offline in any browser that renders MathML (Firefox, Safari, Chrome 109+).

A formula latex2mathml cannot convert fails the build, naming the page and the TeX."""
from __future__ import annotations

from docutils import nodes
from latex2mathml.converter import convert
from sphinx.errors import ExtensionError


def mathml(tex: str, display: str, where) -> str:
    """``tex`` as one MathML element; an ExtensionError naming ``where`` if it does not convert."""
    try:
        return convert(tex, display=display)
    except Exception as e:  # noqa: BLE001 - latex2mathml raises many kinds; the build must stop
        raise ExtensionError(f"{where}: math {tex!r} does not convert to MathML: {e}") from e


def visit_math(self, node: nodes.math) -> None:
    self.body.append(self.starttag(node, "span", "", CLASS="math notranslate"))
    self.body.append(mathml(node.astext(), "inline", node.source or self.builder.current_docname))
    self.body.append("</span>")
    raise nodes.SkipNode


def visit_displaymath(self, node: nodes.math_block) -> None:
    self.body.append(self.starttag(node, "div", CLASS="math notranslate"))
    where = node.source or self.builder.current_docname
    for part in (p for p in node.astext().split("\n\n") if p.strip()):
        self.body.append(mathml(part, "block", where))
    self.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", inline_renderers=(visit_math, None),
                               block_renderers=(visit_displaymath, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
