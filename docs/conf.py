"""Sphinx configuration for megatron_core's documentation (build: sphinx-build -W -b html docs docs/_build)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src")))

from megatron_core.package_info import __version__  # noqa: E402

project = "megatron_core"
author = "megatron_core developers"
copyright = "2026, megatron_core developers"
version = release = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_mock_imports = ["transformer_engine", "flash_attn", "modelopt", "tiktoken", "sentencepiece"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "description"
suppress_warnings = ["myst.xref_missing", "myst.header"]
nitpicky = False
html_theme = "alabaster"
