"""Signals for every lock event, so that a project can count, time and alert.

Each is sent once per event with ``sender=Lock`` (the class, also for locks taken
by ``memcache_lock`` and ``@single_instance``) and these keyword arguments:

``lock_acquired``
    ``lock``, ``lock_id``, ``owner`` (the token stored for this holder), ``fence``
    (None: a fencing token is drawn when ``lock.fence`` is first read), ``waited``
    (seconds the ``acquire()`` call took). In the other signals ``fence`` is the
    token drawn, or None if it was never read.
``lock_contended``
    ``lock``, ``lock_id``, ``owner`` (the token of the holder that kept the lock,
    or None if it was gone by the time it was read), ``waited`` (seconds spent,
    a blocking acquire's whole wait). Sent once per ``acquire()`` that returns
    False, never for the intermediate tries of a blocking one.
``lock_released``
    ``lock``, ``lock_id``, ``owner``, ``fence``, ``held`` (seconds since it was
    taken).
``lock_lost``
    ``lock``, ``lock_id``, ``owner``, ``fence``, ``held``, ``during``: what
    found it lost, ``"renew"`` (the heartbeat), ``"extend"``, ``"release"`` or
    ``"check"`` (``check()`` or ``lost`` judging by the clock that the lock's
    life ran out with no extension), and ``reason``: what was found.

``lock_store_failed``
    Sent when a store call of a lock or of a call's mark fails and
    ``LockBackendError`` is raised: ``lock`` (None for a call's mark),
    ``lock_id``, ``doing`` (what failed, "take the lock", "release the
    lock", ...) and ``error`` (the ``LockBackendError``).

``call_deduplicated``
    Sent with ``sender`` the Celery task (or Django task) when a call is not
    published because an identical one is pending or running (see the docs,
    Stopping duplicates at ``.delay()``): ``lock_id``, ``task_id`` (the call
    that is pending or running), ``new_id`` (the id this call would have had),
    ``mode`` and ``action``: ``"joined"`` (the caller got the existing call's
    result), ``"raised"`` (``AlreadyQueued``) or ``"replaced"`` (the pending
    call was revoked and this one published in its place).

``call_parked``
    Sent with ``sender`` None by ``on_contention="park"`` (see the docs,
    Parking calls) for each step of a parked call: ``lock_id``, ``task_id``
    and ``action``: ``"parked"`` (it joined the end of its lock's line;
    ``ticket`` is its place in arrival order, 1, 2, ...), ``"promoted"``
    (sent again to run), ``"returned"`` (promoted, it found no free slot
    and went back to the head), ``"refused"`` (the line was full: its
    result is ``ParkFull``) or ``"dropped"`` (a newer call took its place:
    its result is ``ParkedCallDropped``; ``by`` names that call, else ``by``
    is ""). ``ticket`` is 0 but for ``"parked"``.

``rate_limit_refused``
    Sent with ``sender=RateLimiter`` when an admission is refused: ``limiter``,
    ``limit_id``, ``retry_after`` (seconds until one could be admitted) and
    ``paused`` (True if a pause refused it).
``rate_limit_paused``
    Sent with ``sender=RateLimiter`` by ``RateLimiter.pause()``: ``limiter``,
    ``limit_id`` and ``seconds`` (until admissions resume).

The signals are sent with ``send_robust``: a receiver that raises is logged by
Django and never breaks a lock (a metrics exporter that is down must not leave a
lock held). ``lock_lost`` from the heartbeat is sent in the heartbeat's thread, from
``check()`` in the caller's.
``lock_contended`` reads the holder's token only when it has receivers.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = [
    "call_deduplicated",
    "call_parked",
    "lock_acquired",
    "lock_contended",
    "lock_lost",
    "lock_released",
    "lock_store_failed",
    "rate_limit_paused",
    "rate_limit_refused",
]

lock_acquired = Signal()
lock_contended = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_store_failed = Signal()
call_deduplicated = Signal()
call_parked = Signal()
rate_limit_refused = Signal()
rate_limit_paused = Signal()
