"""Testing projects that use django_tasklock: each test in a key space of its
own on the real configured store, what happened in it, and one-line
assertions.

``Isolation`` does the work; the pytest plugin (``testing.pytest_plugin``, the
``tasklock`` fixture) and ``TaskLockTestMixin`` (for ``manage.py test``) wrap it.

- **Isolation**: the lock caches (``TASKLOCK['CACHE']`` and every alias a
  ``@single_instance(cache=...)`` names) get a key prefix of the test's own for
  its length, so the locks, queued marks, semaphore slots, rate-limit states
  and liveness records it writes are invisible to every other test, on the
  same servers, and nothing is flushed. (Processes the test does not start
  with these settings, a Celery worker started before it, do not see the
  prefix: run such tests against the worker's own settings.)
- **Held locks**: a lock the test took and did not release fails the test at
  its end (and is released), unless the test said it may (``allow_held()``).
- **What happened**: the signals of the test's locks, calls and limits, kept in
  order (``events``), and the assertions that read them.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, cast

from ..exceptions import InvalidArgument

__all__ = ["Event", "Isolation", "TaskLockTestMixin"]


@dataclass(frozen=True)
class Event:
    """One signal a test's code sent: its name (``lock_acquired``,
    ``call_deduplicated``, ``rate_limit_refused``, ...) and its arguments."""

    name: str
    details: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.details[key]


_SIGNALS = (
    "lock_acquired",
    "lock_contended",
    "lock_released",
    "lock_lost",
    "lock_store_failed",
    "call_deduplicated",
    "rate_limit_refused",
    "rate_limit_paused",
)


class Isolation:
    """One test's view of django_tasklock (see the module's docstring):
    ``start()`` before the test, ``stop()`` after it."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.prefix = ""
        self._allowed: set[str] | None = set()
        self._held: dict[int, Any] = {}
        self._guard = threading.Lock()
        self._settings: Any = None
        self._receivers: list[tuple[Any, Any]] = []
        self._shift_before: int | None = None
        self._counted = False

    # -- set-up and tear-down -------------------------------------------------

    def start(self) -> None:
        """Give the lock caches this test's key prefix, and record signals;
        a store each process has its own of (LocMemCache) is allowed to
        workers, beats and leaderships started meanwhile."""
        from ..backends import per_process_tests

        self._isolate()
        self._listen()
        per_process_tests[0] += 1
        self._counted = True

    def _isolate(self) -> None:
        from django.conf import settings
        from django.test import override_settings

        from ..conf import settings as tasklock_settings
        from ..declared import named_aliases

        self.prefix = f"tasklock-test-{secrets.token_hex(6)}"
        aliases = {tasklock_settings.CACHE, *named_aliases()}
        configured = cast("dict[str, dict[str, Any]]", settings.CACHES)
        caches = {alias: dict(config) for alias, config in configured.items()}
        for alias in aliases & set(caches):
            before = caches[alias].get("KEY_PREFIX", "")
            caches[alias]["KEY_PREFIX"] = (
                f"{before}:{self.prefix}" if before else self.prefix
            )
        self._settings = override_settings(CACHES=caches)
        self._settings.enable()

    def _listen(self) -> None:
        from .. import signals

        for name in _SIGNALS:
            signal = getattr(signals, name)

            def receiver(sender: Any, _name: str = name, **details: Any) -> None:
                self._record(_name, {"sender": sender, **details})

            signal.connect(receiver, weak=False)
            self._receivers.append((signal, receiver))

    def stop(self) -> None:
        """Stop recording, put the settings back; then fail if a lock the test
        took is still held (released first, so that nothing leaks)."""
        from ..backends import close_thread_connections, per_process_tests

        if self._counted:
            per_process_tests[0] -= 1
            self._counted = False
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)
        self._receivers.clear()
        left = self._release_leftovers()
        close_thread_connections()
        if self._shift_before is not None:
            from ..limits import store

            store.shift_ms, self._shift_before = self._shift_before, None
        if self._settings is not None:
            self._settings.disable()
            self._settings = None
        if left:
            raise AssertionError(
                f"The test left {len(left)} lock(s) held: {', '.join(left)}. "
                "Release them (a with block does), or say the test may leave them "
                "with allow_held(); they were released now."
            )

    def allow_held(self, *lock_ids: str) -> None:
        """Let the test end holding ``lock_ids`` (all, if none are named)."""
        if not lock_ids:
            self._allowed = None
        elif self._allowed is not None:
            self._allowed.update(lock_ids)

    # -- time -------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move every rate limit's clock ``seconds`` forward, for this test:
        the client's, which judges limits on memcached, pylibmc and LocMem,
        and Redis's own, which the limits' Lua scripts read (they add the
        step). Admissions, ``retry_after`` and pauses see the time moved; no
        test sleeps. Locks' expiries are counted by the store itself, which
        no client can move: ``expire()`` ends a lock as its expiry would."""
        from ..limits import store

        if seconds < 0:
            raise InvalidArgument(f"the clock only moves forward, not by {seconds}s")
        if self._shift_before is None:
            self._shift_before = store.shift_ms
        store.shift_ms += round(seconds * 1000)

    def expire(self, lock_id: str, *, cache: str | None = None) -> None:
        """End ``lock_id`` in the store now, as its expiry would: whoever
        holds it is not told, and finds it lost at its next check, renewal or
        release, as after a real expiry. Fails if nobody holds it."""
        from ..calls import store

        backend, _alias = store(cache)
        key = backend.keys_for(lock_id)[0]
        peek = backend.peek(key)
        assert peek is not None, f"lock {lock_id!r} is not held: nothing to expire"
        assert backend.release(key, peek.hold, peek.value), (
            f"lock {lock_id!r} changed hands while it was being expired"
        )

    def _record(self, name: str, details: dict[str, Any]) -> None:
        lock = details.get("lock")
        with self._guard:
            self.events.append(Event(name, dict(details)))
            if lock is None:
                return
            if name == "lock_acquired":
                self._held[id(lock)] = lock
            elif name in ("lock_released", "lock_lost"):
                self._held.pop(id(lock), None)

    def _release_leftovers(self) -> list[str]:
        with self._guard:
            held = list(self._held.values())
            self._held.clear()
        left = []
        for lock in held:
            if not lock.owned():
                continue
            allowed = self._allowed is None or lock.lock_id in self._allowed
            lock.release_quietly()
            if not allowed:
                left.append(repr(lock.lock_id))
        return left

    # -- what happened --------------------------------------------------------

    def named(self, name: str, **matching: Any) -> list[Event]:
        """The events called ``name`` whose arguments match ``matching``."""
        with self._guard:
            events = list(self.events)
        return [
            event
            for event in events
            if event.name == name
            and all(event.details.get(k) == v for k, v in matching.items())
        ]

    # -- assertions -----------------------------------------------------------

    def assert_held(
        self, lock_id: str, *, by: Any = None, cache: str | None = None
    ) -> None:
        """The store holds ``lock_id`` now (``by``: for that ``Lock``, or for a
        token containing that str, a task id or an oid)."""
        from ..status import lock_status

        status = lock_status(lock_id, cache=cache)
        assert status.held, f"lock {lock_id!r} is free"
        if by is None:
            return
        token = str(getattr(by, "token", by))
        held_by = str(status.value)
        assert token in held_by, (
            f"lock {lock_id!r} is held by {held_by!r}, not {token!r}"
        )

    def assert_free(self, lock_id: str, *, cache: str | None = None) -> None:
        """Nobody holds ``lock_id`` now."""
        from ..status import lock_status

        status = lock_status(lock_id, cache=cache)
        assert not status.held, f"lock {lock_id!r} is held by {status.value!r}"

    def assert_deduplicated(
        self, task: Any = None, *, action: str | None = None, times: int | None = None
    ) -> list[Event]:
        """A call of ``task`` (any, if None) was not published because an
        identical one was pending or running (``call_deduplicated``):
        ``action`` ``"joined"``, ``"raised"`` or ``"replaced"``; ``times``: how
        many such calls exactly. Returns their events."""
        found = [
            event
            for event in self.named("call_deduplicated", **_only(action=action))
            if task is None or _name_of(event.details.get("sender")) == _name_of(task)
        ]
        _assert_count(
            found, times, f"calls of {_name_of(task) or 'any task'} deduplicated"
        )
        return found

    def assert_refused(
        self, lock_id: str | None = None, *, times: int | None = None
    ) -> list[Event]:
        """An acquire of ``lock_id`` (any, if None) was refused: it was held
        (``lock_contended``; a ``@single_instance`` run skipped, retried or
        raised on it). Returns the events."""
        found = self.named("lock_contended", **_only(lock_id=lock_id))
        _assert_count(found, times, f"acquires of {lock_id or 'any lock'} refused")
        return found

    def assert_rate_limited(
        self,
        limit_id: str | None = None,
        *,
        retry_after: float | None = None,
        within: float = 1.0,
        times: int | None = None,
    ) -> list[Event]:
        """An admission of ``limit_id`` (any, if None) was refused
        (``rate_limit_refused``); ``retry_after``: the last refusal said to try
        again in that many seconds, give or take ``within``."""
        found = self.named("rate_limit_refused", **_only(limit_id=limit_id))
        _assert_count(found, times, f"admissions of {limit_id or 'any limit'} refused")
        if retry_after is not None:
            said = float(found[-1].details["retry_after"])
            assert abs(said - retry_after) <= within, (
                f"the refusal said retry after {said:.2f}s, not {retry_after}s"
            )
        return found


def _only(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def _name_of(task: Any) -> str | None:
    return None if task is None else str(getattr(task, "name", task))


def _assert_count(found: list[Event], times: int | None, what: str) -> None:
    if times is None:
        assert found, f"no {what}"
    else:
        assert len(found) == times, f"{len(found)} {what}, not {times}"


class TaskLockTestMixin:
    """For ``unittest``/Django ``TestCase`` classes: each test isolated as the
    pytest fixture isolates it; ``self.tasklock`` is its ``Isolation``, whose
    assertions the test calls (``self.tasklock.assert_held(...)``)."""

    tasklock: Isolation

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.tasklock = Isolation()
        self.tasklock.start()
        self.addCleanup(self.tasklock.stop)  # type: ignore[attr-defined]
