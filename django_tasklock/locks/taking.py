"""What an acquire and a release decide, written once for their two drivers.

``Lock.acquire``/``Lock.release`` make their round trips with blocking calls,
``Lock.aacquire``/``Lock.arelease`` await them. A driver does only the round
trips (a take, a look at a refused lock's holder, a late take's release, the
release itself) and the waits between tries; what it decides around them
(the settings of this acquire, whether a take is held, what a refusal leads
to, what a release that could not reach the store leaves) is here, so a fix lands in both.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from ..conf import settings
from ..signals import lock_acquired, lock_contended
from .heartbeat import Heartbeat
from .loss import release_failed, taken_too_late
from .validation import misuse
from .waiting import next_wait

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import LockBackend
    from ..conf import LockDefaults
    from ..exceptions import LockBackendError
    from .acquisition import Acquisition
    from .heartbeat import Heartbeat as HeartbeatType

__all__ = [
    "Taker",
    "after_refusal",
    "hold_taken",
    "release_error",
    "take_settings",
]


class Taker(Protocol):
    """What ``taking`` reads and sets of a lock (``Lock``, with its async
    methods)."""

    lock_id: str
    max_hold: float | None
    _acq: Acquisition | None
    _expire: float | None
    _cache: str | None
    _renew_option: bool | None
    _heartbeat: HeartbeatType | None

    @property
    def held(self) -> bool: ...

    def _send(self, signal: Signal, owner: object, **details: Any) -> None: ...

    def _send_contended(
        self, backend: LockBackend, key: str, waited: float
    ) -> None: ...

    def _store_error(
        self, backend: LockBackend, key: str, doing: str, exc: BaseException
    ) -> LockBackendError: ...


def take_settings(lock: Taker, blocking: bool, timeout: float | None) -> LockDefaults:
    """The settings an acquire of ``lock`` runs with: ``LOCK_EXPIRE`` (cut
    to ``max_hold``), ``CACHE``, ``MEMCACHED_PROTOCOL``, ``RENEW`` and
    ``LIVENESS``, the lock's own options in place of TASKLOCK's; a lock with
    none gets TASKLOCK's tuple itself. Raises ``LockUsageError`` for a lock
    this object already holds, or a ``timeout`` without ``blocking``."""
    if ((acq := lock._acq) is not None and acq.hold is not None) or (
        timeout is not None and not blocking
    ):
        raise misuse(lock.lock_id, lock.held)
    defaults = settings.lock_defaults()
    expire, cache, renew, max_hold = (
        lock._expire,
        lock._cache,
        lock._renew_option,
        lock.max_hold,
    )
    if expire is None and cache is None and renew is None and max_hold is None:
        return defaults
    if expire is None:
        expire = defaults[0]
    return (
        expire if max_hold is None else min(expire, max_hold),
        cache or defaults[1],
        defaults[2],
        defaults[3] if renew is None else renew,
        defaults[4],
    )


def hold_taken(
    lock: Taker, acq: Acquisition, beat: float | None, started: float
) -> bool:
    """``acq``, what a take got, held by ``lock`` (renewed every ``beat``
    seconds, None: not renewed; ``lock_acquired`` sent, the wait counted from
    ``started``): True. False if its reply came too late to be used: it is
    forgotten and logged, and the driver releases it if it is still its own
    and counts the try a refusal (at once again if it was the first)."""
    if acq.late and taken_too_late(acq):
        return False
    lock._acq = acq
    if beat is not None:
        lock._heartbeat = Heartbeat(acq, beat).start()
    if lock_acquired.receivers:
        waited = acq.acquired_at - started
        lock._send(lock_acquired, acq.token, fence=None, waited=waited)
    return True


def after_refusal(
    lock: Taker,
    backend: LockBackend,
    key: str,
    pause: float | None,
    deadline: float | None,
    started: float,
) -> tuple[float, float] | None:
    """After a refused try: how long to wait before the next one and the
    pause after it; None, and ``lock_contended`` sent if anybody listens,
    when there is no next try (``pause`` None: not blocking; or past
    ``deadline``)."""
    now = time.monotonic()
    wait = None if pause is None else next_wait(pause, deadline, now)
    if wait is None and lock_contended.receivers:
        lock._send_contended(backend, key, now - started)
    return wait


def release_error(
    lock: Taker, acq: Acquisition, backend: LockBackend, key: str, exc: BaseException
) -> LockBackendError:
    """The error a release of ``acq`` that could not reach the store raises;
    the hold is given up (the lock expires, or crash recovery frees it)."""
    acq.hold = None
    return lock._store_error(backend, key, release_failed(acq, backend, key, exc), exc)
