"""memcached's slab rebalancer moves items between pages (``slab_automove``, on
by default) and gives each item it moves a new CAS id, its value unchanged. A
held lock moved so is still its holder's: release, extend, renewal and fencing
go on, told by the token (unique per acquisition), where a CAS id alone would
report the lock lost. Found by the console benchmark (500 locks of 100,000
"lost" at release once memory churned); forced here with ``slabs reassign``.
"""

from __future__ import annotations

import time

import pytest
from django.core.cache import caches

from django_tasklock import Lock
from tests.helpers import close_connections
from tests.services import Memcached


def item_classes(memcached) -> dict[int, int]:
    """Slab class: items in it."""
    return {
        int(name.split(":")[1]): int(value)
        for name, value in memcached.stats("items").items()
        if name.endswith(":number")
    }


def free_chunks(memcached, cls: int) -> int:
    return int(memcached.stats("slabs").get(f"{cls}:free_chunks", 0))


def move_pages(memcached, locks, cls, moved) -> None:
    """Move pages of the locks' slab class ``cls`` to the global pool until
    ``moved()`` (some lock has a new CAS id): before each move, filler items
    fill the class behind the locks and are deleted, so that memcached has
    free chunks to rescue the locks into (under new CAS ids)."""
    cache = caches["default"]
    token = locks[0].token
    key_length = len(locks[0].lock_id)
    filler = {f"f{n:0{key_length - 1}d}"[:key_length]: token for n in range(24_000)}
    for _ in range(20):
        cache.set_many(filler, timeout=600)
        cache.delete_many(list(filler))
        # Room to rescue every lock into, or the move evicts them instead.
        assert free_chunks(memcached, cls) >= 2 * len(locks), "no room to rescue"
        reply = memcached.raw(f"slabs reassign {cls} 0".encode())
        assert reply.startswith((b"OK", b"NOSPARE", b"BUSY")), reply
        deadline = time.monotonic() + 10
        while memcached.stat("slab_reassign_running"):
            assert time.monotonic() < deadline
        if moved():
            return
    pytest.fail("memcached never moved a page holding a lock")


@pytest.fixture
def own_memcached(settings):
    """A memcached of this test's own (its slab classes start empty), as the
    default and pylibmc aliases."""
    # Its own automover off: this test moves the pages itself (the same move
    # the automover makes), and a page the automover took away meanwhile would
    # leave no free chunk to rescue the locks into (they would be evicted).
    server = Memcached(args=["-o", "slab_automove=0"]).start()
    settings.CACHES = {
        **settings.CACHES,
        "default": {**settings.CACHES["default"], "LOCATION": server.address},
        "pylibmc": {**settings.CACHES["pylibmc"], "LOCATION": server.address},
    }
    yield server
    close_connections()
    server.stop()


@pytest.mark.parametrize(
    "tasklock",
    [
        {"CACHE": "default", "MEMCACHED_PROTOCOL": "meta"},
        {"CACHE": "default", "MEMCACHED_PROTOCOL": "classic"},
        {"CACHE": "pylibmc"},
    ],
    ids=["meta", "classic", "pylibmc"],
)
def test_locks_moved_by_the_slab_rebalancer_stay_their_holders(
    settings, own_memcached, tasklock
):
    memcached = own_memcached
    settings.TASKLOCK = {**tasklock, "LIVENESS": None, "LOCK_EXPIRE": 600}
    locks = [Lock(f"moved-lock-{n:04d}") for n in range(200)]
    empty = item_classes(memcached)
    for lock in locks:
        assert lock.acquire()
    full = item_classes(memcached)
    grew = {c: full[c] - empty.get(c, 0) for c in full}
    # (Items of earlier tests, flushed, are counted until their chunks are
    # reused: the locks' class is the one that grew.)
    cls = max(grew, key=lambda c: grew[c])
    client = caches["default"]._cache
    before = {lock.lock_id: client.gets(lock.acquisition.key)[1] for lock in locks}

    def changed():
        """The locks still held under a new CAS id: moved, not evicted."""
        now = {lock.lock_id: client.gets(lock.acquisition.key) for lock in locks}
        return [
            lock
            for lock in locks
            if now[lock.lock_id][0] is not None
            and now[lock.lock_id][1] != before[lock.lock_id]
        ]

    move_pages(memcached, locks, cls, changed)
    moved = changed()
    assert moved, "no lock was moved: the test proves nothing"
    # A page moved with no free chunk to rescue its items into evicts them:
    # those locks are gone, and rightly found lost.
    gone = [lock for lock in locks if client.get(lock.acquisition.key) is None]
    kept = [lock for lock in locks if lock not in gone]
    thirds = len(moved) // 3
    for lock in moved[:thirds]:
        assert lock.extend() is True and not lock.lost
    for lock in moved[thirds : 2 * thirds]:
        assert lock.fence is not None and not lock.lost
    for lock in kept:
        assert lock.release() is True and not lock.lost
    for lock in gone:
        assert lock.release() is False and lock.lost


def test_another_owners_item_with_the_same_value_is_still_told_apart(
    settings, memcached
):
    """Only unique values are trusted over a changed CAS id: a lock whose item
    other code replaced with the same non-token value is not released."""
    from django_tasklock.status import lock_status, remove

    settings.TASKLOCK = {"CACHE": "default", "LIVENESS": None}
    cache = caches["default"]
    cache.set("plain-lock", "1", timeout=600)
    status = lock_status("plain-lock")
    cache.set("plain-lock", "1", timeout=600)  # another owner, the same value
    assert remove(status) is False
    assert cache.get("plain-lock") == "1"
    close_connections()
