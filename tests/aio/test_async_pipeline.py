"""The loop's pipelined connections (``aio.pipeline``) under what the lock
tests do not reach: a store paused past the client's timeout, replies that
come split across reads or hundreds in one, and a server too slow to read
what is written to it."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError, orphans
from django_tasklock.aio import async_backend_for, close_loop_connections
from tests.helpers import close_connections, wait_until
from tests.services import Memcached, Redis, stop_and_wait

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
REDIS = "django.core.cache.backends.redis.RedisCache"


def run(coroutine_function):
    async def main():
        try:
            return await coroutine_function()
        finally:
            await close_loop_connections()

    return asyncio.run(main())


@pytest.fixture
def own_memcached(settings):
    server = Memcached().start()
    settings.CACHES = {
        **settings.CACHES,
        "own": {"BACKEND": MEMCACHED, "LOCATION": server.address},
    }
    settings.TASKLOCK = {"CACHE": "own", "LOCK_EXPIRE": 60}
    yield server
    close_connections()
    server.stop()


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_an_async_take_timed_out_on_a_paused_store_leaves_no_orphan(settings, kind):
    """The store stops answering: the take fails once the client's timeout is
    up (memcached's ``timeout``, Redis's ``socket_timeout``), not later and
    never silently; the lock the resumed store then takes for nobody is
    removed, and the next take, on a new connection, succeeds."""
    server = Memcached().start() if kind == "memcached" else Redis().start()
    if kind == "memcached":
        options = {"timeout": 0.5, "connect_timeout": 0.5}
        config = {"BACKEND": MEMCACHED, "LOCATION": server.address}
    else:
        options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
        config = {"BACKEND": REDIS, "LOCATION": server.url}
    settings.CACHES = {**settings.CACHES, "paused": {**config, "OPTIONS": options}}
    settings.TASKLOCK = {"CACHE": "paused", "LOCK_EXPIRE": 60}
    key = caches["paused"].make_key("async-paused")

    async def scenario():
        warm = Lock("async-warm-up")
        assert await warm.aacquire() and await warm.arelease()
        removed = orphans.removed_count()
        stop_and_wait(server.process.pid)
        started = time.monotonic()
        try:
            with pytest.raises(LockBackendError):
                await Lock("async-paused").aacquire()
            failed_after = time.monotonic() - started
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert failed_after < 5, f"failed only after {failed_after:.1f}s"
        # The resumed store takes the lock for nobody; the watch removes it.
        await asyncio.to_thread(
            wait_until, lambda: orphans.removed_count() > removed, limit=10
        )
        assert not caches["paused"].get(key)
        again = Lock("async-paused")
        assert await again.aacquire() and await again.arelease()

    try:
        run(scenario)
    finally:
        close_connections()
        server.stop()


def test_replies_split_across_reads_and_many_at_once_reach_their_callers(
    own_memcached,
):
    """Three hundred reads pipelined at once (their replies come many to a
    read, and are handed out a few dozen per callback), one of them a value
    of 600 kB (its reply comes in many reads): each caller gets its own."""
    cache = caches["own"]
    values = {f"pipelined-{n}": f"value-{n}" * (n % 7 + 1) for n in range(300)}
    values["pipelined-big"] = "x" * 600_000
    cache.set_many(values, 60)

    async def scenario():
        store = async_backend_for("own", "auto")
        names = list(values)
        peeks = await asyncio.wait_for(
            asyncio.gather(*(store.peek(cache.make_key(n)) for n in names)), 30
        )
        got = {name: peek.value for name, peek in zip(names, peeks, strict=True)}
        assert got == values
        held = await store.held_many([cache.make_key(n) for n in [*names, "none"]])
        assert held == [True] * len(names) + [False]

    run(scenario)


def test_a_server_slow_to_read_makes_commands_wait_then_all_complete(own_memcached):
    """memcached paused while 12 MB of commands are written: past the
    transport's high-water mark a command waits for the buffer to drain
    (nothing piles up without bound); resumed, every command completes."""
    chunk = b"y" * (1 << 19)

    async def scenario():
        store = async_backend_for("own", "auto")
        server = store._server(":1:slow-0")
        conn = await server.connection("own", "auto")
        stop_and_wait(own_memcached.process.pid)
        try:
            sends = [
                asyncio.ensure_future(
                    conn.send(b"ms slow-%d %d T60\r\n%s\r\n" % (n, len(chunk), chunk))
                )
                for n in range(24)
            ]
            deadline = time.monotonic() + 30
            while conn._drain is None:  # the transport paused the writes
                assert time.monotonic() < deadline, "the writes never paused"
                await asyncio.sleep(0.01)
            assert not any(send.done() for send in sends)
        finally:
            own_memcached.process.send_signal(signal.SIGCONT)
        replies = await asyncio.wait_for(asyncio.gather(*sends), 60)
        assert all(reply.startswith(b"HD") for reply in replies), replies
        assert conn._drain is None and not conn.broken

    run(scenario)


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_a_take_cancelled_as_its_connection_fails_leaves_no_lock(settings, kind):
    """The take is written; the connection is lost, and its caller cancelled
    before it resumed (the loss and the cancel land in one turn of the loop).
    The take's fate is unknown, so its token is watched: the resumed store,
    which carries out the take for nobody, has it removed."""
    server = Memcached().start() if kind == "memcached" else Redis().start()
    if kind == "memcached":
        config = {"BACKEND": MEMCACHED, "LOCATION": server.address}
    else:
        config = {"BACKEND": REDIS, "LOCATION": server.url}
    settings.CACHES = {**settings.CACHES, "lossy": config}
    settings.TASKLOCK = {"CACHE": "lossy", "LOCK_EXPIRE": 60}
    key = caches["lossy"].make_key("async-lost")

    async def scenario():
        warm = Lock("async-warm-up")  # connected, scripts loaded
        assert await warm.aacquire() and await warm.arelease()
        store = async_backend_for("lossy", "auto")
        conn = store._pipe if kind == "redis" else store._server(key).conn
        watched = orphans.watched_count()
        stop_and_wait(server.process.pid)
        try:
            taking = asyncio.ensure_future(Lock("async-lost").aacquire())
            while not conn.pending:  # written
                await asyncio.sleep(0.001)
            conn._fail(ConnectionResetError("dropped"))
            taking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await taking
            assert orphans.watched_count() == watched + 1
        finally:
            server.process.send_signal(signal.SIGCONT)
        await asyncio.to_thread(
            wait_until, lambda: orphans.watched_count() == watched, limit=10
        )
        assert not caches["lossy"].get(key)

    try:
        run(scenario)
    finally:
        close_connections()
        server.stop()
