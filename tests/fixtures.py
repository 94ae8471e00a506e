"""Fixtures several test modules share (conftest.py loads this module as a
plugin): a test asks for one by name, as an argument or in its module's
``pytestmark``."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest


@pytest.fixture
def memcached_locks(request: pytest.FixtureRequest, settings: object) -> None:
    """TASKLOCK on the session's memcached (the "default" alias), with the
    module's ``LOCK_EXPIRE`` (60 s unless the module sets one)."""
    expire = getattr(request.module, "LOCK_EXPIRE", 60)
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": expire}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def broker(redis_server):
    """Celery's broker and result backend: databases 3 and 4 of the private Redis."""
    from tests.celery_app import app
    from tests.helpers import reset_publisher, use_redis_broker

    env = use_redis_broker(app, redis_server.url)
    yield env
    reset_publisher(app)


@pytest.fixture
def holders():
    """Start a ``tests.workers.Holder`` (a lock holder in a process of its
    own): each is resumed if stopped and closed at the end."""
    from tests.workers import Holder

    started: list[Holder] = []

    def start(*args, **kwargs) -> Holder:
        holder = Holder(*args, **kwargs)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.process.pid, signal.SIGCONT)
        holder.close()


@pytest.fixture
def own_memcached_alias(settings):
    """A private memcached, the cache "own" and TASKLOCK's store (30 s of
    restart grace); stopped at the end."""
    from tests.helpers import close_connections
    from tests.services import Memcached

    server = Memcached().start()
    settings.CACHES = {
        **settings.CACHES,
        "own": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": server.address,
        },
    }
    settings.TASKLOCK = {"CACHE": "own", "LOCK_EXPIRE": 60, "RESTART_GRACE": 30}
    yield server
    close_connections()
    server.stop()
