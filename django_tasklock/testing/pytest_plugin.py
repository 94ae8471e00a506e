"""The pytest plugin of django_tasklock: the ``tasklock`` fixture.

Installed with the package (a ``pytest11`` entry point), it does nothing until
a test asks for the fixture: no hook runs, no setting changes, so a project
whose tests never use it sees no difference. A test that does::

    def test_a_duplicate_is_skipped(tasklock):
        ...
        tasklock.assert_refused("feeds.import_feed-lock-...")

runs in a key space of its own on the configured lock store, and fails if it
leaves a lock held (``tasklock.allow_held()`` says it may). See
``django_tasklock.testing.Isolation`` for the assertions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from . import Isolation


@pytest.fixture
def tasklock() -> Iterator[Isolation]:
    """This test's django_tasklock: isolated, recorded, checked at its end."""
    from . import Isolation

    isolation = Isolation()
    isolation.start()
    try:
        yield isolation
    finally:
        isolation.stop()
