"""Sphinx configuration: Markdown pages (MyST), the API from docstrings (autodoc + napoleon),
the configuration reference generated from the settings dataclasses (_ext/lowcomm_config.py),
math as MathML written at build time (_ext/lowcomm_mathml.py)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_ext"))

project = "lowcomm"
author = "the lowcomm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
              "sphinx.ext.viewcode", "lowcomm_config", "lowcomm_mathml",
              "lowcomm_project"]
# math is MathML written into the pages at build time (_ext/lowcomm_mathml.py): no MathJax from a
# CDN, so formulas render offline
html_math_renderer = "mathml"
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "lowcomm"
autodoc_member_order = "bysource"
# no "members" default: Sphinx 8 lets a boolean default override a directive's own
# ":members: a, b" list, which the public API page needs; each page says :members: itself
autodoc_default_options = {"show-inheritance": False}
autodoc_typehints = "none"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
