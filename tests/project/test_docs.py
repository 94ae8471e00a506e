"""README.rst and the docs stay true: valid reStructuredText, every check id
and setting documented. (``make docs`` builds the docs with warnings as
errors; tests/project/test_docs_examples.py runs their examples.)"""

from __future__ import annotations

import re
from pathlib import Path

import docutils.frontend
import docutils.parsers.rst
import docutils.utils

from django_tasklock import check_ids
from django_tasklock.conf import DEFAULTS
from tests.helpers import ROOT

README = (ROOT / "README.rst").read_text()
CHECKS = (ROOT / "docs" / "reference" / "checks.rst").read_text()
SETTINGS = (ROOT / "docs" / "reference" / "settings.rst").read_text()


def test_readme_is_valid_restructuredtext():
    problems = []
    document = docutils.utils.new_document(
        "README.rst",
        docutils.frontend.get_default_settings(docutils.parsers.rst.Parser),
    )
    document.reporter.report_level = docutils.utils.Reporter.WARNING_LEVEL
    document.reporter.attach_observer(lambda message: problems.append(message.astext()))
    docutils.parsers.rst.Parser().parse(README, document)
    assert problems == []


def test_docs_document_every_check_id():
    """Every id ``check_ids`` names is documented, and reported by a check
    somewhere in the package (``checks``, or a store package's own)."""
    in_code = {getattr(check_ids, name) for name in check_ids.__all__}
    in_docs = set(re.findall(r"django_tasklock\.[EW]\d{3}", CHECKS))
    assert in_code == in_docs
    package = Path(check_ids.__file__).parent
    sources = "\n".join(
        path.read_text()
        for path in package.rglob("*.py")
        if path.name != "check_ids.py"
    )
    unused = [
        name for name in check_ids.__all__ if not re.search(rf"\b{name}\b", sources)
    ]
    assert unused == []


def test_docs_document_every_setting_with_its_default():
    for key, default in DEFAULTS.items():
        row = re.search(rf"^``{key}``\s+``(.+?)``", SETTINGS, re.MULTILINE)
        assert row, f"TASKLOCK[{key!r}] missing from the docs' settings table"
        assert row.group(1) == repr(default).replace("'", '"')
