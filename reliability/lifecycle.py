"""Fault cases of the lock lifecycle (rows 8 to 11): a renewing holder
killed, one paused past its expiry, one whose store stays away longer than the
lock lives, and how far a lock capped by max_hold outlives it on memcached."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from reliability.faults import Row, setup_django, use_cache
from tests.processes import process_context
from tests.services import stop_and_wait

if TYPE_CHECKING:
    from tests.services import Memcached, Redis

#: A short expiry: what renewal makes safe for long tasks.
EXPIRE = 3
#: How many expiries a holder keeps its lock by renewal before the fault.
PERIODS = 3


def _renewing_holder(memcached: str, lock_id: str, queue: Any) -> None:
    """Take ``lock_id`` renewing, report its fence, and run; report a loss."""
    setup_django(memcached)
    from django_tasklock import Lock

    lock = Lock(lock_id, expire=EXPIRE, renew=True)
    assert lock.acquire()
    queue.put(("acquired", time.monotonic(), lock.fence))
    while not lock.lost:
        time.sleep(0.02)
    queue.put(("lost", time.monotonic(), lock.fence))
    while True:
        time.sleep(1)


def _start(memcached: Memcached, lock_id: str) -> tuple[Any, Any, float, int]:
    context = process_context()
    queue = context.Queue()
    holder = context.Process(
        target=_renewing_holder, args=(memcached.address, lock_id, queue)
    )
    holder.start()
    _, acquired_at, fence = queue.get(timeout=60)
    return holder, queue, acquired_at, fence


def _rivals_refused(lock_id: str, acquired_at: float) -> tuple[int, int]:
    """Another owner tries every 0.1 s for PERIODS expiries: (tries, successes)."""
    from django_tasklock import Lock

    tries = won = 0
    while time.monotonic() - acquired_at < PERIODS * EXPIRE:
        tries += 1
        other = Lock(lock_id, expire=60)
        if other.acquire():
            won += 1
            other.release()
        time.sleep(0.1)
    return tries, won


def _take_when_free(lock_id: str, since: float, limit: float = 30) -> tuple[Any, float]:
    from django_tasklock import Lock

    while True:
        lock = Lock(lock_id, expire=60)
        if lock.acquire():
            return lock, time.monotonic() - since
        if time.monotonic() - since > limit:
            raise AssertionError(f"{lock_id} still held {limit}s after the fault")
        time.sleep(0.02)


def renewing_killed(memcached: Memcached, tries: int) -> Row:
    """A holder renews a 2 s lock for three expiries, then is SIGKILLed: how soon
    can the next holder take it?"""
    attempts = won = rival_tries = 0
    frees: list[float] = []
    for attempt in range(tries):
        attempts += 1
        lock_id = f"fault-renew-kill-{attempt}"
        holder, _queue, acquired_at, _fence = _start(memcached, lock_id)
        try:
            tried, taken = _rivals_refused(lock_id, acquired_at)
            rival_tries, won = rival_tries + tried, won + taken
            os.kill(holder.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            successor, freed = _take_when_free(lock_id, killed_at)
            frees.append(freed)
            successor.release()
        finally:
            holder.kill()
            holder.join()
    late = sum(freed > EXPIRE + 0.5 for freed in frees)
    row = Row(f"8. renewing holder SIGKILLed (expire {EXPIRE}s)", attempts, won, late)
    row.figures.append(
        f"rivals refused {rival_tries - won}/{rival_tries} over {PERIODS} expiries "
        f"of renewal; lock free {min(frees):.1f}-{max(frees):.1f}s after the kill"
    )
    return row


def renewing_paused(memcached: Memcached, tries: int) -> Row:
    """A renewing holder is SIGSTOPped past its expiry (its heartbeat stops too),
    another takes the lock, then it is resumed: is it told, is its fence older,
    does it leave the new holder's lock alone?"""
    attempts = overlapping = wrong = newer = told_count = 0
    retaken: list[float] = []
    told: list[float] = []
    for attempt in range(tries):
        attempts += 1
        lock_id = f"fault-renew-pause-{attempt}"
        holder, queue, _acquired_at, fence = _start(memcached, lock_id)
        try:
            time.sleep(EXPIRE)  # renewed meanwhile
            stop_and_wait(holder.pid)
            stopped_at = time.monotonic()
            successor, waited = _take_when_free(lock_id, stopped_at)
            taken_at = time.monotonic()
            retaken.append(waited)
            newer += successor.fence > fence
            resumed_at = time.monotonic()  # before the signal: the holder may be
            os.kill(holder.pid, signal.SIGCONT)  # told before kill() returns here
            event, lost_at, _ = queue.get(timeout=30)
            told_count += event == "lost"
            told.append(lost_at - resumed_at)
            # The paused holder believed it held the lock until it was told.
            overlapping += taken_at < lost_at
            wrong += not successor.owned() or event != "lost"
            wrong += not successor.fence > fence
            successor.release()
        finally:
            holder.kill()
            holder.join()
    row = Row(
        "9. renewing holder paused past expiry", attempts, overlapping, wrong, True
    )
    row.figures.append(
        f"retaken {min(retaken):.1f}-{max(retaken):.1f}s after SIGSTOP; holder told "
        f"{told_count}/{attempts}, {min(told) * 1000:.0f}-{max(told) * 1000:.0f} ms after SIGCONT; "
        f"newer fence {newer}/{attempts}"
    )
    return row


def long_outage(redis: Redis, tries: int) -> Row:
    """Redis stops under a renewing holder for longer than the lock lives: the
    holder must be told once the lock may have expired (not when the store is
    back), before a rival can take the lock from the restarted store."""
    from django_tasklock import Lock
    from django_tasklock.signals import lock_lost

    attempts = overlapping = wrong = rival_after = 0
    delays: list[float] = []
    lives: list[float] = []
    told_at: dict[str, float] = {}

    def on_lost(sender: Any, *, lock_id: str, **kwargs: Any) -> None:
        told_at.setdefault(lock_id, time.monotonic())

    lock_lost.connect(on_lost)
    try:
        for attempt in range(tries):
            attempts += 1
            lock_id = f"fault-outage-{attempt}"
            with use_cache(redis.url, "redis", socket_connect_timeout=0.5):
                lock = Lock(lock_id, expire=EXPIRE, renew=True)
                assert lock.acquire()
                life = lock.acquisition.life
                lives.append(life)
                acquired_at = lock.acquired_at or 0.0
                redis.stop()
                stopped_at = time.monotonic()
                deadline = stopped_at + life + 10
                while lock_id not in told_at and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(max(0.0, stopped_at + life + 0.5 - time.monotonic()))
                # Until when the store was sure to keep it: from when its last
                # acquire or extension was sent (not answered: on a busy
                # machine the reply can come a tenth of a second later).
                valid_until = lock.acquisition.valid_until  # type: ignore[union-attr]
                redis.start()
                rival, _ = _take_when_free(lock_id, time.monotonic())
                rival_at = time.monotonic()
                rival.release()
                lock.release_quietly()
            if lock_id not in told_at:
                wrong += 1
                continue
            delays.append(told_at[lock_id] - acquired_at)
            overlapping += rival_at < told_at[lock_id]
            rival_after += rival_at >= told_at[lock_id]
            # Told neither before the lock could expire nor long after.
            wrong += not (valid_until - 0.05 <= told_at[lock_id] <= valid_until + 1.5)
    finally:
        lock_lost.disconnect(on_lost)
    row = Row(
        "10. Redis down longer than a renewing lock", attempts, overlapping, wrong
    )
    row.figures.append(
        f"holder told {len(delays)}/{attempts}, {min(delays, default=0):.2f}-"
        f"{max(delays, default=0):.2f}s after the lock was taken (it lives "
        f"{min(lives, default=0):.0f}s); a rival took it only after that "
        f"{rival_after}/{attempts}"
    )
    return row


def max_hold_overshoot(memcached: Memcached, tries: int) -> Row:
    """How long past ``max_hold`` a capped, renewing lock lives on memcached,
    which stores whole seconds (the last renewal's time left is rounded up)."""
    from django_tasklock import Lock

    max_hold = 3.3
    attempts = overlapping = wrong = told_first = 0
    past: list[float] = []
    for attempt in range(tries):
        attempts += 1
        lock_id = f"fault-max-hold-{attempt}"
        lock = Lock(lock_id, expire=EXPIRE, renew=True, max_hold=max_hold)
        assert lock.acquire()
        acquired_at = lock.acquired_at or 0.0
        key = lock.acquisition.key if lock.acquisition else ""
        while memcached.raw(b"mg " + key.encode() + b" v").startswith(b"VA"):
            time.sleep(0.005)
        gone = time.monotonic() - acquired_at
        past.append(gone - max_hold)
        rival = Lock(lock_id)
        told = lock.lost  # judged before the rival's try
        overlapping += rival.acquire() and not told
        told_first += told
        rival.release()
        lock.release_quietly()
        # Within a second past max_hold (rounding up); early by up to two
        # (whole seconds, on a clock that may tick late), never more.
        wrong += not -2.0 <= gone - max_hold <= 1.0 + 0.25
    row = Row("11. max_hold 3.3s on memcached", attempts, overlapping, wrong)
    row.figures.append(
        f"lock gone {min(past):+.2f} to {max(past):+.2f}s after max_hold (memcached "
        f"rounds to whole seconds); holder told before a rival took it "
        f"{told_first}/{attempts}"
    )
    return row


def run(main: Memcached, redis: Redis, quick: bool) -> list[Row]:
    return [
        renewing_killed(main, 1 if quick else 5),
        renewing_paused(main, 1 if quick else 5),
        long_outage(redis, 1 if quick else 3),
        max_hold_overshoot(main, 2 if quick else 5),
    ]
