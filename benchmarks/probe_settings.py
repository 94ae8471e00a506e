"""The CPU probe's settings: the suite's, less the apps whose models have fence
fields (``tests.fenced``, the example project's feeds), as in a project that
makes no fenced writes, where a ``with`` block pushes no holder. The rows
marked "fence fields on" measure a project that has some."""

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS as _SUITES

INSTALLED_APPS = [
    app for app in _SUITES if app not in ("tests.fenced", "example_project.feeds")
]
