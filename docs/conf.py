"""Sphinx configuration of django_tasklock's documentation.

Built by ``make docs`` (and by ``make test``, with warnings as errors); the
examples in the pages run in the test suite (``tests/project/test_docs_examples.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

import django_tasklock  # noqa: E402

project = "django_tasklock"
author = "the django_tasklock authors"
copyright = "2026, " + author
release = version = django_tasklock.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "tasklock_docs",
]
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
nitpicky = False
exclude_patterns = ["_build"]
html_theme = "furo"
# The lock console's screenshot, taken by tests/console/test_console_browser.py.
html_static_path = ["_static"]
html_title = f"django_tasklock {release}"
templates_path: list[str] = []
