"""Sphinx configuration: guides in Markdown (myst-parser), the API reference from the docstrings.

Built by .ci/run with warnings as errors:

    python -m sphinx -W --keep-going -b html docs docs/_build/html

autodoc imports torch_ext, so the C++ engine must be built (pip install -e ".[test]").
"""

project = "torch_ext"
author = "torch_ext developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    # Google-style "Args:" sections in the docstrings.
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# Anchors for headings down to ###, so that pages can link to each other's sections.
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_member_order = "bysource"
# The signatures say what the parameters are; their types are in the docstrings' prose.
autodoc_typehints = "none"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "torch_ext"
