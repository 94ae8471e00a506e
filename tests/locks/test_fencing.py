"""Fencing tokens: every acquisition's, drawn when read, is larger than every
earlier one's, even after the counter is flushed, evicted, deleted or lost in a
restart; a lock whose fence is never read leaves no counter."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import TYPE_CHECKING

import pytest
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError, LockLost
from django_tasklock.keys import fence_id
from django_tasklock.locks import fencing
from django_tasklock.tokens import fence_counter
from tests.helpers import LONGER, drop, in_thread, store_item, stored, use_memcached
from tests.services import Memcached
from tests.workers import fenced_holds, storm

if TYPE_CHECKING:
    from django_tasklock.values import FenceCounter


def take(lock_id: str = "fenced") -> int:
    lock = Lock(lock_id)
    assert lock.acquire()
    fence = lock.fence  # drawn now, while held
    assert lock.release()
    assert fence is not None and lock.fence == fence  # kept after the release
    return fence


def test_a_fence_never_read_leaves_no_counter(any_store):
    lock = Lock("unfenced")
    assert lock.acquire()
    assert lock.release()
    assert lock.fence is None
    assert stored(any_store.alias, fence_id("unfenced")) is None
    assert take("unfenced") > 0
    assert stored(any_store.alias, fence_id("unfenced")) is not None


def test_a_fence_read_after_the_lock_was_lost_raises(any_store):
    lock = Lock("lost-before-read")
    assert lock.acquire()
    drop(any_store.alias, "lost-before-read")
    thief = Lock("lost-before-read")
    assert thief.acquire()
    with pytest.raises(LockLost):
        lock.fence  # noqa: B018 - reading it is the test
    assert lock.lost
    with pytest.raises(LockLost):
        lock.fence  # noqa: B018 - still lost, still no unfenced write
    assert thief.fence is not None and thief.release()


def test_fences_strictly_increase(any_store):
    fences = [take() for _ in range(30)]
    assert all(later > earlier for earlier, later in pairwise(fences))
    # The counter counts: no gaps without a reason.
    assert fences[-1] - fences[0] == 29


def test_fences_are_per_lock_id(any_store):
    first = take("a")
    others = [take("b") for _ in range(5)]
    second = take("a")
    # Five acquisitions of "b" in between did not move "a"'s counter...
    assert second == first + 1
    # ...and "b" counts on its own counter, from its own start.
    assert others == list(range(others[0], others[0] + 5))
    assert stored(any_store.alias, fence_id("a")) != stored(
        any_store.alias, fence_id("b")
    )


def test_fence_starts_from_the_clock(any_store):
    before = time.time_ns() // 1000
    fence = take("fresh")
    assert before <= fence <= time.time_ns() // 1000


def test_failed_attempts_never_lower_a_later_fence(store):
    holder = Lock("contended")
    assert holder.acquire()
    first = holder.fence
    for _ in range(5):
        assert in_thread(lambda: Lock("contended").acquire()) is False
    assert holder.release()
    assert first is not None and take("contended") == first + 1


def test_fences_increase_across_flush_and_restart(settings, own_memcached):
    use_memcached(settings, own_memcached.address, "meta")
    # No liveness record: its write would leave this thread a Django connection
    # to the server, which the restart below breaks before the delete uses it.
    settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 0, "LIVENESS": None}
    fences = [take()]
    own_memcached.flush_all()
    fences.append(take())
    own_memcached.restart()
    fences.append(take())
    # The counter evicted (or deleted by hand) between two holders.
    caches["own"].delete(fence_id("fenced"))
    fences.append(take())
    fences.append(take())
    assert all(later > earlier for earlier, later in pairwise(fences)), fences


@pytest.fixture
def own_memcached():
    server = Memcached().start()
    yield server
    server.stop()


def test_fences_increase_across_redis_flush(settings, redis_server):
    settings.TASKLOCK = {"CACHE": "redis"}
    before = take()
    caches["redis"]._cache.get_client(write=True).flushdb()
    assert take() > before


def test_a_stale_clock_reading_cannot_restart_a_redis_counter_lower(
    settings, redis_server, monkeypatch
):
    """A holder paused between reading its clock for the counter's floor and
    sending the draw: the counter was lost meanwhile, and a fence drawn from a
    later reading came first. The server's own clock bounds the floor (the
    checker's find: seed 8, sentinel, two holds across a flush and a kill)."""
    settings.TASKLOCK = {"CACHE": "redis"}
    before = take()
    caches["redis"]._cache.get_client(write=True).flushdb()

    def read_ten_seconds_ago(key: str, expire: float) -> FenceCounter:
        counter = fence_counter(key, expire)
        return counter._replace(floor=counter.floor - 10_000_000)

    monkeypatch.setattr(fencing, "fence_counter", read_ten_seconds_ago)
    assert take() > before


def test_classic_protocol_fences_across_restart(settings, own_memcached):
    use_memcached(settings, own_memcached.address, "classic")
    settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 0}
    first = take()
    assert take() == first + 1
    own_memcached.restart()
    assert take() > first + 1


def test_corrupt_counter_is_a_clear_error_and_draws_no_fence(any_store):
    alias = any_store.alias
    store_item(alias, fence_id("corrupt"), "not a number")
    lock = Lock("corrupt")
    assert lock.acquire()
    with pytest.raises(LockBackendError, match="fencing counter") as caught:
        lock.fence  # noqa: B018 - reading it draws
    assert "Delete it" in str(caught.value)
    assert "no fence was drawn" in str(caught.value)
    assert stored(alias, fence_id("corrupt")) == "not a number"
    assert lock.owned() and lock.release()  # still held, released as usual
    drop(alias, fence_id("corrupt"))
    assert take("corrupt") > 0


def test_pooled_memcached_client_locks_and_fences(settings, memcached):
    config = {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": memcached.address,
        "OPTIONS": {"use_pooling": True, "max_pool_size": 2},
    }
    settings.CACHES = {**settings.CACHES, "pooled": config}
    settings.TASKLOCK = {"CACHE": "pooled"}
    first = Lock("pooled")
    assert first.acquire()
    assert Lock("pooled").acquire() is False
    assert first.extend(30)
    ttl = first.ttl()
    assert ttl is not None and 25 <= ttl <= 30 + LONGER
    fence = first.fence  # drawn over a pooled client, after the extend
    assert first.release()
    # A refused attempt draws nothing.
    assert take("pooled") == fence + 1  # type: ignore[operator]


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["default", "redis"])
def test_fences_follow_hold_order_under_contention(alias):
    """Many processes, one lock: sorted by when they held it, the fences rise."""
    processes = 6
    results = storm(fenced_holds, processes, 300, ({"CACHE": alias}, "fenced-storm"))
    holds = sorted(hold for process_holds in results for hold in process_holds)
    assert len(holds) >= 300, f"only {len(holds)} holds"
    assert sum(1 for process_holds in results if process_holds) >= processes // 2
    fences = [fence for _, _, fence in holds]
    assert len(set(fences)) == len(fences), "two holds shared a fence"
    assert fences == sorted(fences), "a later hold drew a smaller fence"
