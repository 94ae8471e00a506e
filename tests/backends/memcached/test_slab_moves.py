"""memcached's slab rebalancer moves items between pages (``slab_automove``, on
by default) and gives each item it moves a new CAS id, its value unchanged. A
held lock moved so is still its holder's: release, extend, renewal and fencing
go on, told by the token (unique per acquisition), where a CAS id alone would
report the lock lost. Found by the console benchmark (500 locks of 100,000
"lost" at release once memory churned); forced here with ``slabs reassign``.
A lock may move again between the read of its value and the owner-checked
write that follows (one of 100,000 in a later run): the write is made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from django.core.cache import caches

from django_tasklock import Lock
from tests.helpers import LONGER, close_connections
from tests.services import Memcached


def item_classes(memcached) -> dict[int, int]:
    """Slab class: items in it."""
    return {
        int(name.split(":")[1]): int(value)
        for name, value in memcached.stats("items").items()
        if name.endswith(":number")
    }


def moved_since_now(locks, client):
    """A function listing the locks that, since this call, have a new CAS id
    and still their holder's token: moved, not evicted."""
    before = {lock.lock_id: client.gets(lock.acquisition.key)[1] for lock in locks}

    def moved():
        now = {lock.lock_id: client.gets(lock.acquisition.key) for lock in locks}
        return [
            lock
            for lock in locks
            if now[lock.lock_id][0] == lock.token
            and now[lock.lock_id][1] != before[lock.lock_id]
        ]

    return moved


def slab_stat(memcached, cls: int, name: str) -> int:
    return int(memcached.stats("slabs").get(f"{cls}:{name}", 0))


def move_pages(memcached, locks, cls, moved, client=None) -> None:
    """Move pages of the locks' slab class ``cls`` to the global pool until
    ``moved()`` (some lock has a new CAS id). memcached always moves the
    class's first page, rescuing its items into free chunks of its other
    pages (under new CAS ids), and keeps a class's last page. Filler items,
    written and deleted, add a page of free chunks behind the locks whenever
    the class is down to one page or has too few free chunks left, through
    ``client`` (pymemcache's, this thread's default alias's if not given)."""
    cache = client or caches["default"]._cache
    token = locks[0].token
    key_length = len(locks[0].acquisition.key)
    spare = True
    for _ in range(40):
        per_page = slab_stat(memcached, cls, "chunks_per_page")
        if (
            not spare
            or slab_stat(memcached, cls, "total_pages") < 2
            or slab_stat(memcached, cls, "free_chunks") < 2 * len(locks)
        ):
            filler = {
                f"f{n:0{key_length - 1}d}"[:key_length]: token
                for n in range(per_page + 2 * len(locks))
            }
            cache.set_many(filler, expire=600)
            cache.delete_many(list(filler), noreply=False)
        # Room to rescue every lock into, or the move evicts them instead.
        free = slab_stat(memcached, cls, "free_chunks")
        assert free >= 2 * len(locks), "no room to rescue"
        reply = memcached.raw(f"slabs reassign {cls} 0".encode())
        assert reply.startswith((b"OK", b"BUSY", b"NOSPARE")), reply
        # NOSPARE: the class had one page when the move was asked for,
        # whatever the stats read above said (seen once in a full run):
        # filled again first.
        spare = not reply.startswith(b"NOSPARE")
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
    changed = moved_since_now(locks, client)
    move_pages(memcached, locks, cls, changed)
    moved = changed()
    assert moved, "no lock was moved: the test proves nothing"
    # A page moved with no free chunk to rescue its items into evicts them:
    # those locks are gone, and rightly found lost.
    gone = [lock for lock in locks if client.get(lock.acquisition.key) is None]
    kept = [lock for lock in locks if lock not in gone]
    for lock in kept:
        assert lock.owned() is True, lock  # (the store agrees it is the holder's)
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


def _moved_twice_setup(memcached, locks, client):
    """Move pages until some locks have a new CAS id; the moved ones, and a
    ``move_again(lock)`` that moves pages until that lock's id changes once
    more."""
    cls = max(item_classes(memcached).items(), key=lambda item: item[1])[0]
    moved_locks = moved_since_now(locks, client)
    move_pages(memcached, locks, cls, moved_locks)

    def move_again(lock):
        cas = client.gets(lock.acquisition.key)[1]
        # (Through this thread's client: an async lock's extend runs on
        # another thread, whose own connection would outlive the test.)
        move_pages(
            memcached,
            locks,
            cls,
            lambda: client.gets(lock.acquisition.key)[1] != cas,
            client,
        )
        assert client.gets(lock.acquisition.key)[0] == lock.token, "evicted"

    return moved_locks(), move_again


def _after_each_read(monkeypatch, hooks, targets, move_again):
    """After a backend's read of a target lock's value (each ``owner.name`` of
    ``hooks``), the lock's page is moved once more: the write that follows
    finds yet another CAS id (what a busy rebalancer did in the console
    benchmark). The targets whose read has not come yet."""
    pending = {lock.acquisition.key: lock for lock in targets}

    def after(key):
        for made, lock in list(pending.items()):
            if key.endswith(made):
                del pending[made]
                move_again(lock)

    for owner, name in hooks:
        hook = _hooked(getattr(owner, name), f"{owner.__name__}.{name}", after)
        monkeypatch.setattr(owner, name, hook)
    return pending


def _hooked(read, name, after):
    if name == "PyLibMCBackend._read_item":  # (key)

        def hooked(self, key):
            found = read(self, key)
            after(key)
            return found
    elif name == "AsyncMemcached._read_item":  # (server, wire)

        async def hooked(self, server, wire):
            found = await read(self, server, wire)
            after(wire.decode())
            return found
    elif name == "Wire.read_item":  # (client, key)

        def hooked(self, client, key):
            found = read(self, client, key)
            after(key)
            return found
    else:
        raise AssertionError(f"no hook for {name}")

    return hooked


@contextlib.contextmanager
def _acting(kind):
    """Take, extend (by 300 s) and release a lock: the sync API, or for
    ``async`` the async one, every step in one event loop (whose connections
    the holds keep), closed at the end."""
    if kind != "async":
        yield Lock.acquire, lambda lock: lock.extend(300), Lock.release
        return
    from django_tasklock.aio import close_loop_connections

    loop = asyncio.new_event_loop()
    try:
        yield (
            lambda lock: loop.run_until_complete(lock.aacquire()),
            lambda lock: loop.run_until_complete(lock.aextend(300)),
            lambda lock: loop.run_until_complete(lock.arelease()),
        )
    finally:
        loop.run_until_complete(close_loop_connections())
        loop.close()


# Slow (the main run only): a few seconds of page moves each, on this
# package's code, which the Python and Django versions do not change.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["meta", "classic", "pylibmc", "async"])
def test_a_lock_moved_again_between_its_check_and_its_write_stays_its_holders(
    settings, own_memcached, monkeypatch, kind
):
    """Moved once (the holder's CAS id is stale, so it reads the value), then
    moved again between that read and the owner-checked delete or rewrite:
    still its holder's, released and extended, nobody told it was lost."""
    from django_tasklock.backends.memcached.aio import AsyncMemcached
    from django_tasklock.backends.memcached.pylibmc import PyLibMCBackend
    from django_tasklock.backends.memcached.wire import Wire

    memcached = own_memcached
    tasklock = {
        "meta": {"MEMCACHED_PROTOCOL": "meta"},
        "classic": {"MEMCACHED_PROTOCOL": "classic"},
    }
    settings.TASKLOCK = {
        "CACHE": "pylibmc" if kind == "pylibmc" else "default",
        **tasklock.get(kind, {}),
        "LIVENESS": None,
        "LOCK_EXPIRE": 600,
    }
    client = caches["default"]._cache
    locks = [Lock(f"twice-lock-{n:04d}") for n in range(200)]
    # Where each reads the value before its write. (An async lock's release
    # is the loop's own; its extend runs the sync backend on a thread.)
    hooks = {
        "meta": [(Wire, "read_item")],
        "classic": [(Wire, "read_item")],
        "pylibmc": [(PyLibMCBackend, "_read_item")],
        "async": [(AsyncMemcached, "_read_item"), (Wire, "read_item")],
    }[kind]

    with _acting(kind) as (take, extend, release):
        for lock in locks:
            assert take(lock)
        moved, move_again = _moved_twice_setup(memcached, locks, client)
        assert len(moved) >= 2, "fewer than two locks moved: the test proves nothing"
        released, extended = moved[:2]
        pending = _after_each_read(monkeypatch, hooks, [released, extended], move_again)
        misses = memcached.stat("delete_misses") + memcached.stat("cas_badval")
        assert extend(extended) is True
        assert release(released) is True
    assert not pending, "a target's page was never moved in the window"
    # Both owner-checked writes found another CAS id at least once (EX, or
    # EXISTS on the classic protocol): the case under test happened.
    assert memcached.stat("delete_misses") + memcached.stat("cas_badval") >= misses + 2
    assert not released.lost and not extended.lost
    assert client.get(released.acquisition.key) is None
    assert client.get(extended.acquisition.key) == extended.token
    ttl = memcached.raw(b"mg %s t" % extended.acquisition.key.encode())
    assert ttl.startswith(b"HD t") and 250 < int(ttl[4:]) <= 300 + LONGER, ttl
    close_connections()


@pytest.mark.slow
def test_a_lock_that_keeps_moving_under_its_release_is_an_error_not_a_loss(
    settings, own_memcached, monkeypatch
):
    """Moved under every one of its release's writes: after five in a row the
    release gives up with a store error that says why, and nobody is told the
    lock was lost (it was not: it still holds the holder's token)."""
    from django_tasklock import LockBackendError
    from django_tasklock.backends.memcached.meta import MOVES_IN_A_ROW
    from django_tasklock.backends.memcached.wire import Wire

    memcached = own_memcached
    settings.TASKLOCK = {"CACHE": "default", "LIVENESS": None, "LOCK_EXPIRE": 600}
    client = caches["default"]._cache
    locks = [Lock(f"twice-lock-{n:04d}") for n in range(200)]
    for lock in locks:
        assert lock.acquire()
    moved, move_again = _moved_twice_setup(memcached, locks, client)
    target = moved[0]
    reads = []

    def every_read(lock):
        reads.append(lock)
        move_again(lock)
        pending[lock.acquisition.key] = lock  # and at the next read again

    pending = _after_each_read(monkeypatch, [(Wire, "read_item")], [target], every_read)
    with pytest.raises(LockBackendError, match="new CAS id 5 times in a row"):
        target.release()
    assert len(reads) == MOVES_IN_A_ROW == 5
    assert not target.lost
    assert client.get(target.acquisition.key) == target.token
    close_connections()
