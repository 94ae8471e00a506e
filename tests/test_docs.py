"""README.rst stays true: valid reStructuredText, every check id and setting."""

from __future__ import annotations

import re
from pathlib import Path

import docutils.frontend
import docutils.parsers.rst
import docutils.utils

from django_tasklock import checks
from django_tasklock.conf import DEFAULTS

README = (Path(__file__).resolve().parent.parent / "README.rst").read_text()


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


def test_readme_documents_every_check_id():
    in_code = set(
        re.findall(r"django_tasklock\.[EW]\d{3}", Path(checks.__file__).read_text())
    )
    in_readme = set(re.findall(r"django_tasklock\.[EW]\d{3}", README))
    assert in_code == in_readme


def test_readme_documents_every_setting_with_its_default():
    for key, default in DEFAULTS.items():
        row = re.search(rf"^``{key}``\s+``(.+?)``", README, re.MULTILINE)
        assert row, f"TASKLOCK[{key!r}] missing from README's settings table"
        assert row.group(1) == repr(default).replace("'", '"')
