"""Locks through twemproxy (Debian's ``nutcracker``) in front of real memcached.

twemproxy speaks the classic protocol only and closes the connection on a meta
command (no ``ERROR``) and on a ``cas`` with a negative expiry. Locks through it
must still be taken once, released only by their owner, and released at all.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
from django.core.cache import caches
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import memcached as memcached_backend
from tests.helpers import close_connections
from tests.services import Memcached, Nutcracker
from tests.workers import hammer, overlaps, storm


@pytest.fixture(scope="module")
def twemproxy(memcached_pair):
    proxy = Nutcracker(servers=list(memcached_pair)).start()
    os.environ["TASKLOCK_TEST_TWEMPROXY"] = proxy.address  # for spawned processes
    yield proxy
    proxy.stop()


@pytest.fixture
def through_proxy(settings, twemproxy):
    settings.CACHES = {
        **settings.CACHES,
        "twemproxy": {**settings.CACHES["twemproxy"], "LOCATION": twemproxy.address},
    }
    settings.TASKLOCK = {"CACHE": "twemproxy", "LOCK_EXPIRE": 60}
    yield twemproxy
    close_connections()
    memcached_backend._classic_servers.discard(("127.0.0.1", twemproxy.port))


def stored_on(servers: list[Memcached], key: str) -> list[bool]:
    return [server.raw(b"get " + key.encode()) != b"END" for server in servers]


def test_auto_detects_the_proxy_and_locks_through_it(
    through_proxy, memcached_pair, caplog
):
    caplog.set_level(logging.WARNING, "django_tasklock.backends.memcached")
    holder = Lock("proxied")
    assert holder.acquire()
    detected = [r for r in caplog.records if "twemproxy" in r.getMessage()]
    assert len(detected) == 1, caplog.text
    assert "MEMCACHED_PROTOCOL" in detected[0].getMessage()
    assert Lock("proxied").acquire() is False
    assert caches["twemproxy"].add("proxied", "true", 60) is False
    assert holder.owned()
    assert holder.extend(120)
    assert holder.fence is not None
    assert sum(stored_on(list(memcached_pair), ":1:proxied")) == 1
    assert holder.release() is True
    # Released on the server itself, not just in the client's view.
    assert stored_on(list(memcached_pair), ":1:proxied") == [False, False]
    assert Lock("proxied").acquire()
    # Detected once per server: no second warning.
    assert len([r for r in caplog.records if "twemproxy" in r.getMessage()]) == 1


def test_renewal_through_the_proxy(through_proxy):
    # 3 s, renewed every 2/3 s: memcached may drop a 3 s item after 2 s (whole
    # seconds), so only a 2 s stall of the heartbeat could lose it.
    with Lock("renewed-through-proxy", expire=3, renew=True) as lock:
        started = time.monotonic()
        while time.monotonic() - started < 4.5:  # past one expiry, twice its life
            assert not lock.lost
            time.sleep(0.1)
        assert lock.owned()
    assert not lock.lost
    assert not Lock("renewed-through-proxy").locked()


def test_through_the_proxy_only_the_owner_releases(through_proxy):
    first = Lock("owner-only")
    assert first.acquire()
    caches["twemproxy"].delete("owner-only")  # expired, evicted or deleted by hand
    second = Lock("owner-only")
    assert second.acquire()
    assert first.release() is False
    assert first.extend(60) is False
    assert second.owned()
    assert second.release() is True


def test_server_restarted_behind_the_proxy_is_not_released_by_the_old_holder(
    through_proxy, memcached_pair, settings
):
    """The client's socket to the proxy survives a restart of the server behind
    it, and the restarted server hands out the same CAS ids again: only the
    stored token tells the old holder's item from the new one."""
    # No liveness records: a record's beat written to the restarted server
    # between the two acquires took its first CAS id (CI met it), and the case
    # did not happen.
    settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": None}

    def take(lock):
        deadline = time.monotonic() + 30
        while True:  # the proxy reconnects to a restarted server on a later request
            try:
                if lock.acquire():
                    return
            except LockBackendError:
                pass
            assert time.monotonic() < deadline, "never reached the restarted server"
            time.sleep(0.05)

    old = Lock("restarted")
    assert old.acquire()
    server = next(s for s in memcached_pair if stored_on([s], ":1:restarted")[0])
    assert old.release()
    # A restart first, so the old holder's item is the server's first (CAS id 1),
    # and another, so the new holder's is too.
    server.restart()
    take(old)
    server.restart()
    new = Lock("restarted")
    take(new)
    assert new.acquisition.hold.cas == old.acquisition.hold.cas, (
        "the case needs equal CAS ids"
    )
    assert old.release() is False
    assert new.owned()
    assert new.release() is True


def test_ids_spread_over_both_servers_and_are_all_released(
    through_proxy, memcached_pair
):
    locks = [Lock(f"spread-{n}") for n in range(60)]
    assert all(lock.acquire() for lock in locks)
    # Each lock on one server, both servers used (the items are counted by
    # key: this process's liveness record and roster slot live there too).
    where = [stored_on(list(memcached_pair), f":1:spread-{n}") for n in range(60)]
    assert all(sum(found) == 1 for found in where), where
    assert {found.index(True) for found in where} == {0, 1}, "not spread"
    assert all(lock.release() for lock in locks)
    # Gone from the servers: a classic release leaves an item expired at once,
    # which memcached may still count in curr_items until it reclaims it.
    for n in range(60):
        assert stored_on(list(memcached_pair), f":1:spread-{n}") == [False, False]


def test_one_server_behind_the_proxy(settings, memcached):
    """The same through a twemproxy in front of a single memcached."""
    proxy = Nutcracker(servers=[memcached]).start()
    try:
        settings.CACHES = {
            **settings.CACHES,
            "one": {**settings.CACHES["twemproxy"], "LOCATION": proxy.address},
        }
        settings.TASKLOCK = {"CACHE": "one", "LOCK_EXPIRE": 60}
        first = Lock("behind-one")
        assert first.acquire()
        assert Lock("behind-one").acquire() is False
        assert first.fence is not None and first.extend(90)
        assert memcached.raw(b"get :1:behind-one") != b"END"
        caches["one"].delete("behind-one")
        second = Lock("behind-one")
        assert second.acquire()
        assert first.release() is False
        assert second.release() is True
        assert memcached.raw(b"get :1:behind-one") == b"END"
    finally:
        close_connections()
        memcached_backend._classic_servers.discard(("127.0.0.1", proxy.port))
        proxy.stop()


def test_forcing_meta_through_the_proxy_says_what_to_set(settings, through_proxy):
    settings.TASKLOCK = {"CACHE": "twemproxy", "MEMCACHED_PROTOCOL": "meta"}
    with pytest.raises(LockBackendError) as error:
        Lock("forced-meta").acquire()
    message = str(error.value)
    assert "twemproxy" in message and "'classic'" in message
    assert caches["twemproxy"].get("forced-meta") is None


def test_check_reports_the_proxy(settings, through_proxy, capsys):
    call_command("check")  # auto: a warning naming the setting, not an error
    err = capsys.readouterr().err
    assert "django_tasklock.W002" in err and "twemproxy" in err, err
    settings.TASKLOCK = {"CACHE": "twemproxy", "MEMCACHED_PROTOCOL": "meta"}
    with pytest.raises(SystemCheckError, match=r"django_tasklock\.E012"):
        call_command("check")
    settings.TASKLOCK = {"CACHE": "twemproxy", "MEMCACHED_PROTOCOL": "classic"}
    call_command("check")
    assert "django_tasklock" not in capsys.readouterr().err


@pytest.mark.slow
def test_contention_through_the_proxy_no_overlaps(through_proxy):
    processes = 8
    tasklock = {"CACHE": "twemproxy", "LOCK_EXPIRE": 60}
    results = storm(hammer, processes, 200, (tasklock, "proxy-storm"), ("lock",))
    holds = [hold for process_holds, _ in results for hold in process_holds]
    refused = sum(refused for _, refused in results)
    assert overlaps(holds) == 0
    assert len(holds) >= 200, f"only {len(holds)} acquisitions"
    assert refused >= len(holds), "too little contention to prove anything"


@pytest.mark.parametrize("kind", ["window", "smooth"])
def test_rate_limits_through_the_proxy(through_proxy, kind):
    """twemproxy has no meta commands: admissions take the classic gets/cas path."""
    from django_tasklock import RateLimiter

    limiter = RateLimiter(f"proxied-{kind}", "3/20s", kind=kind)
    limiter.reset()
    assert [bool(limiter.admit()) for _ in range(4)] == [True, True, True, False]
    assert limiter.pause(5) > 4
    assert limiter.admit().paused
    assert limiter.reset()
