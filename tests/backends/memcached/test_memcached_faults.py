"""memcached fault paths, each against a private server: a lost reply after an
extend reached the store, a server over its connection limit, and values with
CR LF in them (an oid)."""

from __future__ import annotations

import logging
import signal
import socket

import pytest

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import memcached as memcached_backend
from django_tasklock.checks import check_settings
from tests.faultproxy import FaultProxy
from tests.helpers import LONGER, close_connections, wait_until
from tests.services import Memcached

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"


def use_cache(settings, location, alias="faulty", options=None, **tasklock):
    config = {"BACKEND": MEMCACHED, "LOCATION": location}
    if options:
        config["OPTIONS"] = options
    settings.CACHES = {**settings.CACHES, alias: config}
    settings.TASKLOCK = {"CACHE": alias, "LOCK_EXPIRE": 60, **tasklock}


@pytest.fixture
def server():
    own = Memcached().start()
    yield own
    close_connections()
    own.stop()


# -- 11: a lost reply after an extend reached the store -------------------------------


@pytest.mark.parametrize("protocol", ["meta", "classic"])
def test_extend_whose_reply_was_lost_is_recognised_as_our_own(
    settings, server, caplog, protocol
):
    proxy = FaultProxy(server.port)
    try:
        use_cache(settings, proxy.address, MEMCACHED_PROTOCOL=protocol)
        lost = []
        lock = Lock("extend-lost")
        assert lock.acquire()
        caplog.set_level(logging.WARNING)
        verb = b"ms :1:extend-lost" if protocol == "meta" else b"cas :1:extend-lost"
        proxy.drop_replies(verb)
        from django_tasklock.signals import lock_lost

        def receiver(sender, **details):
            lost.append(details)

        lock_lost.connect(receiver)
        try:
            assert lock.extend(30) is True
        finally:
            lock_lost.disconnect(receiver)
        assert proxy.dropped == 1, "the fault did not happen"
        assert lock.lost is False
        assert lost == []
        assert not [r for r in caplog.records if "no longer held" in r.getMessage()]
        # The store has the extended lock, and it is still this holder's.
        assert 28 <= server_ttl(server, "extend-lost") <= 30 + LONGER
        assert lock.owned()
        assert Lock("extend-lost").acquire() is False
        assert lock.release()
        assert server.raw(b"mg :1:extend-lost v") == b"EN"
    finally:
        proxy.close()


def server_ttl(server, lock_id):
    reply = server.raw(b"mg :1:" + lock_id.encode() + b" t")
    assert reply.startswith(b"HD"), reply
    return int(reply.split(b" t")[1])


# -- 12: ERROR Too many open connections ----------------------------------------------


@pytest.fixture
def limited():
    """A memcached with room for 4 connections (-c 20 less its reserve)."""
    own = Memcached(args=["-c", "20"]).start()
    yield own
    close_connections()
    own.stop()


def fill(server) -> list[socket.socket]:
    """Open connections until the server refuses one; keep them open."""
    held = []
    while True:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(b"mn\r\n")
        reply = sock.recv(100)
        if reply.startswith(b"ERROR Too many open connections"):
            sock.close()
            return held
        assert reply == b"MN\r\n", reply
        held.append(sock)
        assert len(held) < 50, "the connection limit never came"


@pytest.mark.parametrize("pooled", [False, True], ids=["client", "pooled"])
def test_connection_limit_is_a_transient_error_not_a_protocol_verdict(
    settings, limited, caplog, pooled
):
    use_cache(
        settings,
        limited.address,
        options={"use_pooling": True} if pooled else None,
        RESTART_GRACE=60,
    )
    server = ("127.0.0.1", limited.port)
    held = fill(limited)
    try:
        with pytest.raises(LockBackendError, match="Too many open connections"):
            Lock("over-the-limit").acquire()
        # The check's probe is refused the same way: no false W002 (nor
        # E012), only the server named as not answering (W008).
        assert [m.id for m in check_settings()] == ["django_tasklock.W008"]
    finally:
        for sock in held:
            sock.close()
    # The server frees the slots when it sees them closed.
    wait_until(limited.idle, 10)
    assert server not in memcached_backend._classic_servers
    assert server not in memcached_backend._unlearnable
    assert not [r for r in caplog.records if "needs 1.6+" in r.getMessage()]
    # Room again: meta commands, and restart detection still on.
    holder = Lock("over-the-limit")
    assert holder.acquire()
    assert limited.raw(b"mg :1:over-the-limit f").startswith(b"HD f16")
    if not pooled:  # a PooledClient's connections are never learnt
        assert server in memcached_backend._runs
        limited.stop(signal.SIGKILL)
        limited.start()
        with pytest.raises(LockBackendError, match="restarted"):
            Lock("over-the-limit").acquire()
    assert [m.id for m in check_settings()] == []


# -- 13: values with CR LF in them ----------------------------------------------------


@pytest.mark.parametrize("protocol", ["meta", "classic"])
def test_an_oid_with_cr_lf_is_read_back_whole(settings, server, protocol):
    use_cache(settings, server.address, MEMCACHED_PROTOCOL=protocol)
    lock = Lock("crlf", oid="worker\r\nVA 2 t\r\nxx")
    assert lock.acquire()
    assert lock.fence is not None  # the lock read back with its value, whole
    assert lock.check()
    assert lock.release() is True
    assert server.raw(b"mg :1:crlf v") == b"EN"


@pytest.mark.parametrize(
    ("oid", "why"),
    [
        ("app#1", "'#' separates the task id"),
        ("x" * 201, "longer than 200"),
        ("bad\udc80", "lone surrogate"),
    ],
)
def test_an_oid_that_cannot_be_stored_is_refused(oid, why):
    with pytest.raises(ValueError, match=why) as caught:
        Lock("any", oid=oid)
    assert "leave oid out" in str(caught.value)
