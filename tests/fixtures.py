"""Fixtures several test modules share (conftest.py loads this module as a
plugin): each module asks for one by name, in its ``pytestmark``."""

from __future__ import annotations

import pytest


@pytest.fixture
def memcached_locks(request: pytest.FixtureRequest, settings: object) -> None:
    """TASKLOCK on the session's memcached (the "default" alias), with the
    module's ``LOCK_EXPIRE`` (60 s unless the module sets one)."""
    expire = getattr(request.module, "LOCK_EXPIRE", 60)
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": expire}  # type: ignore[attr-defined]
