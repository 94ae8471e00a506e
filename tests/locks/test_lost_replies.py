"""Calls whose outcome the caller never learns: a reply lost after the store acted,
and a store paused (SIGSTOP) until the caller timed out, then resumed (SIGCONT).

A token the store took for a caller that was told "failed" has no holder: it must
be recognised as the caller's own, or removed, owner-checked, soon after the store
answers again; never left to make the caller's own retry look like a duplicate.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError, orphans
from django_tasklock.backends.redis.scripts import ACQUIRE, RELEASE
from tests.faultproxy import FaultProxy
from tests.helpers import wait_until
from tests.services import Memcached, Redis, stop_and_wait

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
REDIS = "django.core.cache.backends.redis.RedisCache"


def use_cache(settings, config, alias="lossy", **tasklock):
    settings.CACHES = {**settings.CACHES, alias: config}
    settings.TASKLOCK = {"CACHE": alias, "LOCK_EXPIRE": 60, **tasklock}


def watch_state() -> str:
    """The background watch as a failed wait shows it: its thread, what it
    watches, and where the thread is."""
    import sys
    import traceback

    threads = list(orphans._thread)
    frames = sys._current_frames()
    where = [
        "".join(traceback.format_stack(frames[t.ident])[-6:])
        for t in threads
        if t.ident in frames
    ]
    return (
        f"thread {threads} alive {[t.is_alive() for t in threads]}, "
        f"{orphans.watched_count()} watched {orphans.failing()}, "
        f"{orphans.removed_count()} removed, "
        f"last look {time.monotonic() - orphans._progress[0]:.1f}s ago; at {where}"
    )


def wait_for_pending_watch(before: int) -> None:
    """Until the background watch has dealt with every token handed to it."""
    wait_until(lambda: orphans.watched_count() == 0, about=watch_state)
    assert orphans.removed_count() >= before


@pytest.fixture
def own_redis():
    server = Redis().start()
    yield server
    server.stop()


@pytest.fixture
def proxy(own_redis):
    fault = FaultProxy(own_redis.port)
    yield fault
    fault.close()
    from tests.helpers import close_connections

    close_connections()


def direct(own_redis):
    return redis.Redis(port=own_redis.port)


def test_redis_reply_lost_after_the_acquire_ran_is_still_ours(
    settings, own_redis, proxy
):
    use_cache(settings, {"BACKEND": REDIS, "LOCATION": f"redis://{proxy.address}/0"})
    warm = Lock("warm-up")  # loads the scripts, so the next call runs one at once
    assert warm.acquire() and warm.release()
    proxy.drop_replies(b"lost-reply")
    lock = Lock("lost-reply")
    assert lock.acquire(), "its own lock, taken before the reply was lost, refused it"
    assert proxy.dropped == 1, "the fault did not happen"
    assert lock.fence is not None
    assert Lock("lost-reply").acquire() is False  # held, and by this holder:
    assert lock.owned()
    assert lock.release()
    assert direct(own_redis).exists(":1:lost-reply") == 0


@pytest.fixture
def proxied(settings, proxy):
    """TASKLOCK's cache is Redis through the proxy, with a socket timeout."""
    config = {
        "LOCATION": f"redis://{proxy.address}/0",
        "OPTIONS": {"socket_timeout": 2},
    }
    use_cache(settings, {"BACKEND": REDIS, **config})
    return proxy


def test_redis_replies_lost_until_the_caller_fails_leave_no_lock(own_redis, proxied):
    proxy = proxied
    warm = Lock("warm-up")
    assert warm.acquire() and warm.release()
    removed = orphans.removed_count()
    # Every acquire runs and loses its reply; every owner-checked removal is kept
    # from the store, so the orphan stays in place until the network heals.
    proxy.drop_replies(ACQUIRE.sha.encode(), times=1000)
    proxy.refuse(RELEASE.sha.encode())
    with pytest.raises(LockBackendError):
        Lock("unknown-fate").acquire()
    assert proxy.dropped >= 2
    store = direct(own_redis)
    assert store.exists(":1:unknown-fate") == 1, "the store never acted: no orphan"
    # The watch tried, and was cut off.
    wait_until(lambda: proxy.refused >= 1, about=watch_state)
    assert store.exists(":1:unknown-fate") == 1
    proxy.heal()
    gone_after = wait_until(lambda: store.exists(":1:unknown-fate") == 0)
    wait_for_pending_watch(removed + 1)
    assert gone_after < 5
    # The caller's next try is never refused as a duplicate of itself.
    assert Lock("unknown-fate").acquire()


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_acquire_timed_out_on_a_paused_store_leaves_no_orphan(settings, kind):
    server = Memcached().start() if kind == "memcached" else Redis().start()
    if kind == "memcached":
        config = {
            "BACKEND": MEMCACHED,
            "LOCATION": server.address,
            "OPTIONS": {"timeout": 0.5, "connect_timeout": 0.5},
        }
    else:
        config = {
            "BACKEND": REDIS,
            "LOCATION": server.url,
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        }
    use_cache(settings, config, alias="paused")
    try:
        assert Lock("warm-up").acquire()  # connected, scripts loaded
        removed = orphans.removed_count()
        stop_and_wait(server.process.pid)
        try:
            with pytest.raises(LockBackendError):
                Lock("paused-lock").acquire()
        finally:
            server.process.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        key = caches["paused"].make_key("paused-lock")
        # The resumed store takes the lock for nobody; the watch removes it.
        wait_until(
            lambda: orphans.removed_count() > removed, limit=10, about=watch_state
        )
        assert time.monotonic() - resumed < 10
        wait_for_pending_watch(removed + 1)
        assert not _exists(kind, server, key)
        again = Lock("paused-lock")
        assert again.acquire() and again.release()
    finally:
        server.stop()
        from tests.helpers import close_connections

        close_connections()


def _exists(kind: str, server, key: str) -> bool:
    if kind == "memcached":
        return server.raw(b"mg " + key.encode() + b" v").startswith(b"VA")
    with redis.Redis(port=server.port) as client:
        return bool(client.exists(key))


def test_release_whose_reply_was_lost_is_finished_in_the_background(
    settings, own_redis, proxied
):
    proxy = proxied
    lock = Lock("release-lost")
    assert lock.acquire()
    proxy.close()  # the store is unreachable at release
    with pytest.raises(LockBackendError, match="removed in the background"):
        lock.release()
    assert direct(own_redis).exists(":1:release-lost") == 1
    # Reachable again (directly, as after a failover of the proxy): removed.
    use_cache(settings, {"BACKEND": REDIS, "LOCATION": own_redis.url})
    gone = wait_until(
        lambda: direct(own_redis).exists(":1:release-lost") == 0, about=watch_state
    )
    assert gone < 5


def test_a_store_that_never_answers_holds_back_no_other_removal(
    settings, own_redis, monkeypatch
):
    """A look at a store that never answers (no socket timeout, a peer gone
    without a reset) would keep every other token waiting behind it: after
    ``STUCK`` seconds a new token gets a thread of its own."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing ever answers
    monkeypatch.setattr(orphans, "STUCK", 1.0)
    settings.CACHES = {
        **settings.CACHES,
        "silent": {
            "BACKEND": REDIS,
            "LOCATION": f"redis://127.0.0.1:{silent.getsockname()[1]}/0",
        },
    }
    # Our reply timeout, 2 s by default, would end the silent look before a
    # loaded machine got to the next token (its thread then took that token
    # itself): ten minutes, "never" for this test.
    use_cache(
        settings, {"BACKEND": REDIS, "LOCATION": own_redis.url}, SOCKET_TIMEOUT=600
    )
    try:
        orphans.watch("lost-there", "silent", "auto", ":1:lost-there", "a-token")
        stuck = orphans._thread[0]
        # The look waits on the silent store's reply: nothing moves.
        time_stuck = wait_until(lambda: time.monotonic() - orphans._progress[0] > 1)
        assert stuck.is_alive() and orphans.watched_count() == 1, time_stuck
        orphan = Lock("orphan")  # a token of unknown fate on a store that answers
        assert orphan.acquire()
        removed = orphans.removed_count()
        orphans.watch("orphan", "lossy", "auto", ":1:orphan", orphan.token or "")
        # Gone from the store, and counted (just after the removal returns).
        wait_until(
            lambda: (
                direct(own_redis).exists(":1:orphan") == 0
                and orphans.removed_count() > removed
            ),
            limit=10,
            about=watch_state,
        )
        assert orphans.removed_count() == removed + 1
        assert orphans._thread[0] is not stuck
    finally:
        silent.close()  # the stuck look fails, and its thread ends
        orphans.forget()
