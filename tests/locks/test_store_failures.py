"""A store that is down at acquire or at release, and one that comes back."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError, memcache_lock
from django_tasklock.backends import (
    backend_for,
    close_thread_connections,
    thread_connections,
)
from tests.helpers import LONGER, use_memcached
from tests.services import Memcached, Redis, free_port

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
REDIS = "django.core.cache.backends.redis.RedisCache"
DJANGO_REDIS = "django_redis.cache.RedisCache"


@pytest.fixture(params=["memcached", "redis", "django-redis"])
def flaky(request, settings):
    """A private server this test may stop and start, as TASKLOCK's cache."""
    if request.param == "memcached":
        server = Memcached().start()
        config = {"BACKEND": MEMCACHED, "LOCATION": server.address}
    elif request.param == "redis":
        server = Redis().start()
        config = {
            "BACKEND": REDIS,
            "LOCATION": server.url,
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        }
    else:
        server = Redis().start()
        config = {
            "BACKEND": DJANGO_REDIS,
            "LOCATION": server.url,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
        }
    settings.CACHES = {**settings.CACHES, "flaky": config}
    settings.TASKLOCK = {"CACHE": "flaky"}
    yield server
    server.stop()
    from tests.helpers import close_connections

    close_connections()


@pytest.fixture(params=["memcached", "redis", "django-redis"])
def nowhere(request, settings):
    """TASKLOCK's cache points at a port nothing listens on."""
    port = free_port()
    if request.param == "memcached":
        config = {"BACKEND": MEMCACHED, "LOCATION": f"127.0.0.1:{port}"}
    else:
        backend = REDIS if request.param == "redis" else DJANGO_REDIS
        config = {"BACKEND": backend, "LOCATION": f"redis://127.0.0.1:{port}/0"}
    settings.CACHES = {**settings.CACHES, "nowhere": config}
    settings.TASKLOCK = {"CACHE": "nowhere"}
    return port


def test_store_down_at_acquire_raises_and_body_never_runs(nowhere):
    ran = []
    with pytest.raises(LockBackendError) as info:
        with memcache_lock("feeds-lock-1") as acquired:
            ran.append(acquired)
    assert ran == []
    message = str(info.value)
    assert "Could not take the lock" in message
    assert "'feeds-lock-1'" in message
    assert f"127.0.0.1:{nowhere}" in message
    assert "'nowhere'" in message
    assert info.value.lock_id == "feeds-lock-1"


def test_store_down_at_acquire_lock_api(nowhere):
    lock = Lock("x")
    with pytest.raises(LockBackendError):
        lock.acquire()
    with pytest.raises(LockBackendError):
        lock.locked()
    with pytest.raises(LockBackendError):
        lock.ttl()
    with pytest.raises(LockBackendError), lock:
        pytest.fail("body ran without a lock")


def test_store_down_at_release_keeps_result(flaky, caplog):
    with caplog.at_level(logging.ERROR, logger="django_tasklock.locks"):
        with memcache_lock("job") as acquired:
            assert acquired
            flaky.stop()
            result = "imported"
    assert result == "imported"
    assert "Could not release lock 'job'" in caplog.text


def test_store_down_at_release_keeps_body_exception(flaky):
    with pytest.raises(KeyError, match="the task's own error"):
        with memcache_lock("job") as acquired:
            assert acquired
            flaky.stop()
            raise KeyError("the task's own error")


def test_store_down_at_release_explicit_release_says_what_became_of_it(flaky):
    lock = Lock("job")
    lock.acquire()
    flaky.stop()
    with pytest.raises(LockBackendError) as info:
        lock.release()
    if isinstance(flaky, Memcached):
        # A memcached that stopped kept nothing: the lock is gone, not waiting.
        assert "the server is not running, and the lock went with it" in str(info.value)
    else:
        # Redis may come back with its data: removed then, or expires by itself.
        assert "removed in the background as soon as the store answers" in str(
            info.value
        )
        expire = Lock("job").expire
        within = re.search(r"expires by itself within (\d+)s", str(info.value))
        assert within and expire - 1 <= int(within.group(1)) <= expire + 1


def test_store_back_locking_resumes_without_restart(flaky, settings):
    # Without a liveness record: with one, this process's record thread puts
    # the live holder's lock back on the restarted server (test_recovery.py),
    # and the next caller is rightly refused.
    settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": None}
    holder = Lock("job")
    assert holder.acquire()
    flaky.stop()
    with pytest.raises(LockBackendError):
        Lock("job").acquire()
    # Other cache traffic meanwhile makes Django's client mark the node failed;
    # the lock still reports the outage instead of looking like contention.
    for _ in range(3):
        with contextlib.suppress(Exception):
            caches["flaky"].add("other", "value", 60)
        with pytest.raises(LockBackendError):
            Lock("job").acquire()
    flaky.start()
    if settings.CACHES["flaky"]["BACKEND"] == MEMCACHED:
        # memcached came back empty while the holder may still run: new locks
        # on it wait out RESTART_GRACE
        # (tests/backends/memcached/test_pool_restart.py), here cut to 0.
        with pytest.raises(LockBackendError, match="RESTART_GRACE"):
            Lock("job").acquire()
        settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 0}
    # The restarted store lost every lock: the next caller takes it.
    again = Lock("job")
    assert again.acquire()
    assert Lock("job").acquire() is False
    assert holder.release() is False
    assert again.owned()
    assert again.release()


@pytest.fixture
def own_memcached():
    server = Memcached().start()
    yield server
    server.stop()


def fill_until(server: Memcached, cas: int) -> None:
    """Store items until the server's last CAS id given out is ``cas``."""
    for n in range(100):
        reply = server.raw(b"ms tasklock-test-fill-%d 1 c\r\nx" % n)
        assert reply.startswith(b"HD c"), reply
        if int(reply[4:]) >= cas:
            assert int(reply[4:]) == cas, "CAS ids already past the one wanted"
            return
    raise AssertionError(f"CAS id {cas} not reached")


def test_a_backend_speaks_the_protocol_it_was_built_with(settings, own_memcached):
    """MEMCACHED_PROTOCOL is fixed when a thread's backend is built. A change
    gives the thread another backend and keeps the old one, on which a lock
    taken before the change is still released, owner-checked; both close
    with the thread's connections."""
    use_memcached(settings, own_memcached.address, "classic")
    settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": None}
    before = Lock("protocol-before", expire=60)
    assert before.acquire()
    first = before.acquisition.backend  # type: ignore[union-attr]
    client = first._client(first.keys_for("protocol-before")[0])
    assert (first.protocol, first.wire.meta(client)) == ("classic", False)
    assert backend_for("own") is first  # asked again: the same one

    settings.TASKLOCK = {**settings.TASKLOCK, "MEMCACHED_PROTOCOL": "meta"}
    after = Lock("protocol-after", expire=60)
    assert after.acquire()
    second = after.acquisition.backend  # type: ignore[union-attr]
    assert second is not first and second is backend_for("own")
    assert (second.protocol, first.protocol) == ("meta", "classic")
    assert backend_for("own", protocol="meta") is second
    assert thread_connections() == 2

    assert before.locked() and before.release()
    assert not before.locked() and after.owned() and after.release()
    assert own_memcached.keys() <= {"tasklock-run-mark"}
    assert backend_for("own", protocol="classic") is first  # found, not rebuilt

    close_thread_connections()
    assert thread_connections() == 0
    for backend in (first, second):
        assert all(c.sock is None for c in backend._hash_client.clients.values())


@pytest.mark.parametrize("protocol", ["meta", "classic"])
def test_restart_reusing_cas_id_spares_new_holder(settings, own_memcached, protocol):
    """A restarted memcached counts CAS ids from 1 again: the old holder's id can
    be the new holder's. The old holder must still not release or extend it."""
    use_memcached(settings, own_memcached.address, protocol)
    # No restart grace: the owner check is what this test is about; and no
    # liveness record, whose write would use up a CAS id.
    settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 0, "LIVENESS": None}
    fill_until(own_memcached, 8)
    old = Lock("restart", expire=60)
    assert old.acquire()
    own_memcached.restart()
    # The restart learnt first (the server's run mark takes CAS ids of its
    # own), then the new run's ids used up to the old holder's.
    backend = backend_for("own")
    key = backend.keys_for("restart")[0]
    assert not backend.locked(key)  # (a new connection, the old one dropped)
    backend.restarted_at(key)
    fill_until(own_memcached, old.acquisition.hold.cas - 1)
    new = Lock("restart", expire=60)
    assert new.acquire()
    assert new.acquisition.hold.cas == old.acquisition.hold.cas, (
        "the case this test exists for"
    )
    assert old.extend(600) is False
    assert old.release() is False
    assert new.owned()
    ttl = new.ttl()
    assert ttl is not None and ttl <= 60 + LONGER
    assert new.release() is True


def test_memcached_without_cas_refuses_to_lock(settings):
    server = Memcached(args=["-C"]).start()
    try:
        use_memcached(settings, server.address)
        with pytest.raises(LockBackendError, match="without CAS ids"):
            Lock("no-cas").acquire()
        assert caches["own"].get("no-cas") is None, "left a lock behind"
    finally:
        server.stop()


def test_server_without_meta_commands_falls_back_to_gets_cas(settings, own_memcached):
    from tests.services import PreMetaMemcached

    proxy = PreMetaMemcached(own_memcached)
    try:
        use_memcached(settings, proxy.address, "auto", alias="old")
        # No liveness record: its traffic is not what this fake server is for.
        settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": None}
        old_holder = Lock("fallback", expire=60)
        assert old_holder.acquire()
        assert proxy.meta_refused >= 1, "meta was not tried first"
        assert Lock("fallback").acquire() is False
        assert caches["old"].add("fallback", "true", 60) is False
        assert old_holder.extend(120)
        assert old_holder.owned()
        assert old_holder.release() is True
        # Lost-lock checks still hold on the classic path.
        first = Lock("fallback")
        assert first.acquire()
        caches["old"].delete("fallback")
        second = Lock("fallback")
        assert second.acquire()
        assert first.release() is False
        assert second.owned()
        assert second.release()
        with pytest.raises(LockBackendError, match="meta commands"):
            second.ttl()
        # Forcing meta on such a server is an error that says what to change.
        settings.TASKLOCK = {
            "CACHE": "old",
            "MEMCACHED_PROTOCOL": "meta",
            "LIVENESS": None,
        }
        with pytest.raises(LockBackendError, match="MEMCACHED_PROTOCOL"):
            Lock("fallback").acquire()
    finally:
        from django_tasklock.backends import memcached as memcached_backend

        memcached_backend._classic_servers.discard(("127.0.0.1", proxy.port))
        from tests.helpers import close_connections

        close_connections()
        proxy.stop()
