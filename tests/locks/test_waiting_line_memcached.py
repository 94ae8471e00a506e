"""Blocking acquires on memcached wait in the lock's ticket line
(``backends.memcached.line``): in the order they came, woken at once by a
release in their own process, by their own polls across processes, never
left hanging by a waiter that died, gave up or whose line was lost."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import backend_for
from django_tasklock.backends.memcached.line import TURN_POLL, _Names
from django_tasklock.locks.line import LONGEST, MARK
from tests.helpers import background
from tests.locks.lines import (
    after_a_killed_waiter,
    after_a_lost_line,
    gives_up_and_leaves,
    handoff_across_processes,
    joins_the_end,
    shared_in_turn,
    stopped_while_waiting,
    taken_in_order,
)

LOCK_ID = "memcached-line-test"


@pytest.fixture(autouse=True)
def _on_memcached(settings, memcached):
    settings.TASKLOCK = {"CACHE": "default", "LIVENESS": None}
    backend = backend_for("default")
    key = backend.keys_for(LOCK_ID)[0]
    names = _Names(key)
    client = backend._client(key)
    client.delete_many([names.head, names.tail, key])


def _counters() -> tuple[int, int]:
    """The test lock's line: (head, tail), the first ticket not served and
    the tickets handed out."""
    backend = backend_for("default")
    key = backend.keys_for(LOCK_ID)[0]
    names = _Names(key)
    got = backend._client(key).get_many([names.head, names.tail])
    return int(got.get(names.head, 0)), int(got.get(names.tail, 0))


def _in_line() -> int:
    head, tail = _counters()
    return max(tail - head, 0)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _waiter(took: list[float], timeout: float = 30):
    def wait() -> None:
        lock = Lock(LOCK_ID, expire=30)
        assert lock.acquire(blocking=True, timeout=timeout)
        took.append(time.monotonic())
        lock.release()

    return wait


def _joined(thread_and_outcome) -> None:
    thread, outcome = thread_and_outcome
    thread.join(60)
    assert not thread.is_alive(), "the thread did not end"
    if "error" in outcome:
        raise outcome["error"]


def _handoffs(settings, waiting: str, n: int) -> list[float]:
    """Seconds from a release to the next holder's start, ``n`` times: a
    thread of this process waits on a lock held for a second."""
    settings.TASKLOCK = {**settings.TASKLOCK, "WAITING": waiting}
    gaps = []
    for _ in range(n):
        holder = Lock(LOCK_ID, expire=30)
        assert holder.acquire()
        took: list[float] = []
        running = background(_waiter(took))
        time.sleep(1.0)  # a poll's pause grows to its longest meanwhile
        released_at = time.monotonic()
        holder.release()
        _joined(running)
        gaps.append(took[0] - released_at)
    return gaps


def test_a_release_wakes_a_waiter_of_its_own_process_at_once(settings):
    gaps = _handoffs(settings, "line", 5)
    print(f"line: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    assert statistics.median(gaps) < 0.05


def test_poll_is_a_choice_and_keeps_no_line(settings):
    gaps = _handoffs(settings, "poll", 3)  # (woken by the release here too)
    print(f"poll: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    assert _counters() == (0, 0)


def test_an_uncontended_blocking_acquire_takes_no_ticket():
    lock = Lock(LOCK_ID, expire=30)
    assert lock.acquire(blocking=True, timeout=5)
    assert lock.release()
    assert _counters() == (0, 0)


def test_waiters_take_the_lock_in_the_order_they_came():
    assert taken_in_order(LOCK_ID, _in_line) == [0, 1, 2, 3, 4]
    assert _in_line() == 0


def test_a_holder_taking_it_again_at_once_joins_the_end():
    joins_the_end(LOCK_ID, _in_line)


def test_a_waiter_that_gives_up_leaves_the_line():
    # Had it stayed, the next waiter would wait for its mark to expire.
    assert gives_up_and_leaves(LOCK_ID, _in_line) < MARK


@pytest.mark.slow
def test_a_waiter_killed_in_line_holds_it_up_no_longer_than_its_mark():
    waited = after_a_killed_waiter(LOCK_ID, "default", _in_line)
    # The dead waiter kept its turn until its mark expired (whole seconds
    # on memcached's clock: MARK rounded up, and one more), no longer.
    assert waited <= MARK + 2 + LONGEST + 1.0


def test_a_lost_line_costs_order_never_a_hang(memcached):
    backend = backend_for("default")
    key = backend.keys_for(LOCK_ID)[0]
    names = _Names(key)

    def lose() -> None:  # as a flush
        backend._client(key).delete_many([names.head, names.tail])

    assert after_a_lost_line(LOCK_ID, _in_line, lose) <= LONGEST + 0.5


@pytest.mark.slow
def test_processes_taking_the_lock_again_and_again_share_it_in_turn():
    shared_in_turn("memcached", 0.5)


def test_an_async_waiter_polls_and_stays_out_of_the_line():
    # The line's steps would each hold an executor thread (a thousand waiting
    # coroutines would starve the loop): async waiters on memcached poll.
    async def run() -> tuple[bool, int]:
        holder = Lock(LOCK_ID, expire=30)
        assert await holder.aacquire()
        waiter = Lock(LOCK_ID, expire=30)
        waiting = asyncio.ensure_future(waiter.aacquire(blocking=True, timeout=30))
        await asyncio.sleep(0.3)
        joined = await asyncio.to_thread(_in_line)
        await holder.arelease()
        taken = await waiting
        await waiter.arelease()
        return taken, joined

    taken, joined = asyncio.run(run())
    assert taken
    assert joined == 0


def test_a_waiter_at_its_turn_polls_at_the_turns_pace_across_processes():
    # Held by another process: no release here to wake the waiter, which
    # sees the free lock at its next poll (TURN_POLL), not a backoff's 0.5 s.
    gaps = [handoff_across_processes(LOCK_ID, "default", "line") for _ in range(3)]
    print(f"line: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    assert statistics.median(gaps) < TURN_POLL + 0.03
    polled = [handoff_across_processes(LOCK_ID, "default", "poll") for _ in range(3)]
    print(f"poll: handoffs {[round(g * 1000, 1) for g in polled]} ms")
    assert statistics.median(polled) > TURN_POLL + 0.03  # the control


def test_a_store_down_while_waiting_raises_the_lock_error(settings):
    from tests.services import Memcached

    server = Memcached().start()
    joined = threading.Event()
    try:
        errors = stopped_while_waiting(
            settings,
            "django.core.cache.backends.memcached.PyMemcacheCache",
            server.address,
            server,
            lambda: joined.wait(0.3) or True,  # (a try or two in line)
        )
    finally:
        server.stop()
    assert errors and isinstance(errors[0], LockBackendError), errors
