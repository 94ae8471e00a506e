"""Fault cases of the lock lifecycle: a renewing holder killed, and one paused
past its expiry. Run by ``reliability/faults.py`` (rows 8 and 9)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reliability.faults import Row
    from tests.services import Memcached

#: A short expiry: what renewal makes safe for long tasks.
EXPIRE = 2
#: How many expiries a holder keeps its lock by renewal before the fault.
PERIODS = 3


def _renewing_holder(memcached: str, lock_id: str, queue: Any) -> None:
    """Take ``lock_id`` renewing, report its fence, and run; report a loss."""
    from reliability.faults import setup_django

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
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    holder = context.Process(
        target=_renewing_holder, args=(memcached.address, lock_id, queue)
    )
    holder.start()
    _, acquired_at, fence = queue.get(timeout=60)
    return holder, queue, acquired_at, fence


def _kept_while_renewing(lock_id: str, acquired_at: float) -> bool:
    """Another owner tries every 0.1 s for PERIODS expiries; True if it never won."""
    from django_tasklock import Lock

    while time.monotonic() - acquired_at < PERIODS * EXPIRE:
        other = Lock(lock_id, expire=60)
        if other.acquire():
            other.release()
            return False
        time.sleep(0.1)
    return True


def _take_when_free(lock_id: str, since: float, limit: float = 30) -> tuple[Any, float]:
    from django_tasklock import Lock

    while True:
        lock = Lock(lock_id, expire=60)
        if lock.acquire():
            return lock, time.monotonic() - since
        if time.monotonic() - since > limit:
            raise AssertionError(f"{lock_id} still held {limit}s after the fault")
        time.sleep(0.02)


def renewing_killed(memcached: Memcached, tries: int, row: type[Row]) -> Row:
    """A holder renews a 2 s lock for three expiries, then is SIGKILLed: how soon
    can the next holder take it?"""
    lost = 0
    frees: list[float] = []
    for attempt in range(tries):
        lock_id = f"fault-renew-kill-{attempt}"
        holder, _queue, acquired_at, _fence = _start(memcached, lock_id)
        try:
            lost += not _kept_while_renewing(lock_id, acquired_at)
            os.kill(holder.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            successor, freed = _take_when_free(lock_id, killed_at)
            frees.append(freed)
            successor.release()
        finally:
            holder.kill()
            holder.join()
    result = row(f"8. renewing holder SIGKILLed (expire {EXPIRE}s)", tries, lost=lost)
    result.recovery = (
        f"kept {PERIODS} expiries by renewal; lock free "
        f"{min(frees):.1f}-{max(frees):.1f}s after the kill"
    )
    return result


def renewing_paused(memcached: Memcached, tries: int, row: type[Row]) -> Row:
    """A renewing holder is SIGSTOPped past its expiry (its heartbeat stops too),
    another takes the lock, then it is resumed: does it learn, and is its fence
    older than the new holder's?"""
    stale = 0
    retaken: list[float] = []
    told: list[float] = []
    for attempt in range(tries):
        lock_id = f"fault-renew-pause-{attempt}"
        holder, queue, _acquired_at, fence = _start(memcached, lock_id)
        try:
            time.sleep(EXPIRE)  # renewed meanwhile
            os.kill(holder.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            successor, waited = _take_when_free(lock_id, stopped_at)
            retaken.append(waited)
            stale += not successor.fence > fence
            os.kill(holder.pid, signal.SIGCONT)
            resumed_at = time.monotonic()
            event, lost_at, _ = queue.get(timeout=30)
            assert event == "lost"
            told.append(lost_at - resumed_at)
            if not successor.owned():
                stale += 1  # the resumed holder touched the new holder's lock
            successor.release()
        finally:
            holder.kill()
            holder.join()
    result = row("9. renewing holder paused past expiry", tries, lost=stale)
    result.recovery = (
        f"retaken {min(retaken):.1f}-{max(retaken):.1f}s after SIGSTOP; holder told "
        f"{min(told):.2f}-{max(told):.2f}s after SIGCONT; older fence every time"
    )
    return result
