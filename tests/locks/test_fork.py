"""A process forked while it holds a lock: its own connections, and no ownership.

These fork for real (``os.fork()``), as a prefork pool, a ``multiprocessing`` fork
or a management command that spawns helpers does.
"""

from __future__ import annotations

import json
import os

import pytest

from django_tasklock import Lock, LockUsageError
from django_tasklock.backends import backend_for
from tests.helpers import LONGER
from tests.workers import fork

ROUNDS = 300


@pytest.fixture
def timed_store(store, settings):
    """``store`` with socket timeouts, so that connections crossed between parent
    and child fail the test instead of hanging it."""
    config = dict(settings.CACHES[store.alias])
    timeouts = {
        "redis": {"socket_timeout": 5},
        "django-redis": {"SOCKET_TIMEOUT": 5},
        # libmemcached: milliseconds to connect, microseconds to send and receive
        "pylibmc": {
            "behaviors": {
                "connect_timeout": 5000,
                "send_timeout": 5_000_000,
                "receive_timeout": 5_000_000,
            }
        },
    }
    config["OPTIONS"] = {
        **config.get("OPTIONS", {}),
        **timeouts.get(store.name, {"timeout": 5}),
    }
    settings.CACHES = {**settings.CACHES, "timed": config}
    settings.TASKLOCK = {**store.tasklock, "CACHE": "timed"}
    return store


def collect(pid: int, read_fd: int) -> dict[str, object]:
    with os.fdopen(read_fd) as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    result: dict[str, object] = json.loads(data)
    return result


def test_forked_child_talks_over_its_own_connection(timed_store):
    lock = Lock("forked", expire=60)
    assert lock.acquire()
    parent_backend, _key = lock._backend()

    def child(write_fd: int) -> None:
        ttls = [lock.ttl() for _ in range(ROUNDS)]
        owned = [lock.owned() for _ in range(ROUNDS)]
        backend, _ = lock._backend()
        with os.fdopen(write_fd, "w") as pipe:
            json.dump(
                {
                    "ttls": [
                        t for t in ttls if t is None or not 55 <= t <= 60 + LONGER
                    ],
                    "owned": owned.count(True),
                    "same_backend": backend is parent_backend,
                },
                pipe,
            )

    pid, read_fd = fork(child)
    # The parent uses its connection at the same time: shared, the two would read
    # each other's replies (wrong TTLs, a reply eaten, a timeout).
    parent_ttls = [lock.ttl() for _ in range(ROUNDS)]
    parent_owned = [lock.owned() for _ in range(ROUNDS)]
    result = collect(pid, read_fd)
    assert result == {"ttls": [], "owned": ROUNDS, "same_backend": False}
    assert all(55 <= t <= 60 + LONGER for t in parent_ttls if t is not None), (
        parent_ttls
    )
    assert None not in parent_ttls and all(parent_owned)
    assert lock.release()


def test_forked_child_may_not_release_or_extend_the_parents_lock(store):
    lock = Lock("forked-owner", expire=60)
    assert lock.acquire()

    def child(write_fd: int) -> None:
        outcome = {}
        for name, call in (("release", lock.release), ("extend", lock.extend)):
            try:
                call()
                outcome[name] = "done"
            except LockUsageError as exc:
                outcome[name] = str(exc)
        # A with-block unwinding in the child leaves the lock to the parent.
        with Lock("child-own", expire=60) as own:
            lock.__exit__(None, None, None)
            outcome["own_lock_fence"] = own.fence is not None
        outcome["owned_after_unwinding"] = lock.owned()
        with os.fdopen(write_fd, "w") as pipe:
            json.dump(outcome, pipe)

    result = collect(*fork(child))
    for name in ("release", "extend"):
        message = result[name]
        assert isinstance(message, str) and "forked child is not the lock's owner" in (
            message
        ), message
        assert f"a fork of process {os.getpid()}" in message
    assert result["own_lock_fence"] is True
    assert result["owned_after_unwinding"] is True
    # The parent still owns it, over its own connection, after the child left.
    assert lock.owned()
    assert lock.extend()
    assert lock.release()
    assert not Lock("forked-owner").locked()


def test_forked_child_gets_fresh_backends_from_the_forking_thread(store):
    alias = store.alias
    parent = backend_for(alias)

    def child(write_fd: int) -> None:
        with os.fdopen(write_fd, "w") as pipe:
            fresh = backend_for(alias)
            lock = Lock("child-lock", expire=60)
            json.dump(
                {"fresh": fresh is not parent, "took": lock.acquire(), "gone": None},
                pipe,
            )
            lock.release()

    result = collect(*fork(child))
    assert result["fresh"] is True and result["took"] is True
    # The parent's connection still answers in step after the child closed its copy.
    lock = Lock("parent-lock", expire=60)
    assert lock.acquire() and lock.ttl() is not None and lock.release()


@pytest.mark.parametrize("calls", [0, 3])
def test_close_thread_connections_before_or_between_locks(store, calls):
    from django_tasklock.backends import close_thread_connections
    from tests.helpers import in_thread

    def job() -> list[bool]:
        results = []
        for _ in range(calls):  # a pool closing between jobs on a reused thread
            close_thread_connections()
            lock = Lock("pooled")
            results += [lock.acquire(), lock.release()]
        close_thread_connections()  # before this thread's (next) first lock
        lock = Lock("pooled")
        results += [lock.acquire(), lock.owned(), lock.release()]
        close_thread_connections()
        close_thread_connections()
        return results

    assert in_thread(job) == [True] * (2 * calls + 3)
