"""Every public exception survives a result backend: pickle, and Celery's
JSON result serializer, keep its type, its message and its attributes; and
every error the package raises at its callers is one of them."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from django_tasklock import exceptions
from django_tasklock.exceptions import (
    AlreadyQueued,
    InvalidArgument,
    InvalidArgumentType,
    InvalidLockExpire,
    LockBackendError,
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockUsageError,
    NoFence,
    ParkedCallDropped,
    ParkFull,
    RateLimited,
    StaleFence,
    TaskLockError,
)

#: One of each, with the attributes README documents.
EXAMPLES = [
    (TaskLockError("something went wrong"), {}),
    (LockNotAcquired("feeds-lock-abc"), {"lock_id": "feeds-lock-abc", "reason": ""}),
    (
        LockNotAcquired("feeds-lock-abc", "a call cannot wait for its own caller"),
        {
            "lock_id": "feeds-lock-abc",
            "reason": "a call cannot wait for its own caller",
        },
    ),
    (
        AlreadyQueued("5e0c-id", "feeds-lock-abc"),
        {"task_id": "5e0c-id", "lock_id": "feeds-lock-abc"},
    ),
    (AlreadyQueued(None, "feeds-lock-abc"), {"task_id": None}),
    (LockLost("feeds-lock-abc", 12.5), {"lock_id": "feeds-lock-abc", "held_for": 12.5}),
    (
        LockBackendError(
            "Could not take the lock: ConnectionRefusedError",
            lock_id="feeds-lock-abc",
            store="memcached cache 'default' at 127.0.0.1:11211",
        ),
        {
            "lock_id": "feeds-lock-abc",
            "store": "memcached cache 'default' at 127.0.0.1:11211",
            "message": "Could not take the lock: ConnectionRefusedError",
        },
    ),
    (LockConfigurationError("TASKLOCK must be a dict"), {}),
    (InvalidArgument("rate '10/x' is not a rate: write ..."), {}),
    (InvalidArgumentType("@single_instance must be under @shared_task"), {}),
    (InvalidLockExpire("expire must be ..."), {}),
    (LockUsageError("release() called on ..."), {}),
    (RateLimited("partner-api", 2.5), {"limit_id": "partner-api", "retry_after": 2.5}),
    (
        StaleFence("feeds.Feed pk=4", "fence", 12, 9),
        {"row": "feeds.Feed pk=4", "field": "fence", "stored": 12, "fence": 9},
    ),
    (NoFence("A fenced write to feeds.Feed found no lock held ..."), {}),
    (ParkFull("feeds-lock-abc", 50), {"lock_id": "feeds-lock-abc", "parked": 50}),
    (
        ParkedCallDropped("5e0c-id", "feeds-lock-abc", "7f1d-id"),
        {"task_id": "5e0c-id", "lock_id": "feeds-lock-abc", "by": "7f1d-id"},
    ),
]


def test_every_public_exception_has_an_example():
    public = {getattr(exceptions, name) for name in exceptions.__all__}
    assert public == {type(exc) for exc, _ in EXAMPLES}


def same(rebuilt: BaseException, original: BaseException, attributes: dict) -> None:
    assert type(rebuilt) is type(original)
    assert str(rebuilt) == str(original)
    for name, value in attributes.items():
        assert getattr(rebuilt, name) == value, name


@pytest.mark.parametrize(
    ("exc", "attributes"), EXAMPLES, ids=lambda e: type(e).__name__
)
def test_pickle_keeps_type_message_and_attributes(exc, attributes):
    same(pickle.loads(pickle.dumps(exc)), exc, attributes)


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize(
    ("exc", "attributes"), EXAMPLES, ids=lambda e: type(e).__name__
)
def test_celery_result_serializers_keep_type_message_and_attributes(
    exc, attributes, serializer
):
    """What a Celery result backend stores for a failed task, and what
    ``result.get()`` raises from it (Celery's own encode/decode)."""
    from celery import Celery

    app = Celery(set_as_current=False)
    app.conf.update(
        result_backend="cache+memory://",
        result_serializer=serializer,
        result_accept_content=[serializer],
    )
    backend = app.backend
    stored = backend.encode(backend.prepare_exception(exc))
    rebuilt = backend.exception_to_python(backend.decode(stored))
    same(rebuilt, exc, attributes)


#: Plain raises that never reach a caller: each is caught in the package
#: (a reply or a stored state that is not what was asked, read as "another
#: kind's" or "not this store's"), or marks a method a subclass must write.
INTERNAL = {
    ("backends/redis/failover.py", "ValueError"),
    ("backends/locmem/backend.py", "ValueError"),
    ("backends/memcached/meta.py", "ValueError"),
    ("limits/kinds.py", "ValueError"),
    ("backends/redis/failover.py", "RuntimeError"),
    ("backends/base.py", "NotImplementedError"),
    ("limits/kinds.py", "NotImplementedError"),
    ("backends/aio/pipeline.py", "NotImplementedError"),
    ("locks/reads.py", "NotImplementedError"),
    ("locks/holding.py", "NotImplementedError"),
}


def test_the_package_raises_its_own_errors_at_its_callers():
    """A wrong argument raises ``InvalidArgument`` or ``InvalidArgumentType``
    (still a ValueError or a TypeError), never Python's bare errors, so
    ``except TaskLockError`` catches every error of ours; the few plain raises
    left are caught inside the package (``INTERNAL``)."""
    package = Path(exceptions.__file__).parent
    plain = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in {
                "ValueError",
                "TypeError",
                "RuntimeError",
                "KeyError",
                "NotImplementedError",
            }:
                plain.add((path.relative_to(package).as_posix(), raised.id))
    assert plain <= INTERNAL, sorted(plain - INTERNAL)


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda: __import__("django_tasklock").Lock("x", expire=-1), InvalidLockExpire),
        (
            lambda: __import__("django_tasklock").RateLimiter("x", "10/x"),
            InvalidArgument,
        ),
        (lambda: __import__("django_tasklock").Lock(42), InvalidArgumentType),
    ],
    ids=["expire", "rate", "lock id"],
)
def test_a_wrong_argument_is_a_tasklock_error_and_the_builtin_one(call, kind):
    with pytest.raises(kind) as raised:
        call()
    assert isinstance(raised.value, TaskLockError)
    assert isinstance(raised.value, (ValueError, TypeError))
