"""The suite's helpers, one copy each: waits, threads, connections, stores,
Celery apps. Fixtures and hooks stay in conftest.py."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

from django.core.cache import caches, close_caches

#: Seconds past its expiry a memcached item may still be read: its end is a
#: time on the server's clock, read in whole seconds (see
#: ``django_tasklock.backends.memcached.wire.observe_clock``), later rather
#: than sooner.
LONGER = 3

#: The repository's root (the tests are in folders below ``tests/``).
ROOT = Path(__file__).resolve().parent.parent

#: The stores whose take and release are the event loop's own round trips.
NATIVE = {"memcached-meta", "redis", "django-redis", "postgres", "pgbouncer"}

#: Django's memcached backend of pymemcache.
MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"

__all__ = [
    "MEMCACHED",
    "NATIVE",
    "ROOT",
    "SHARED_STORES",
    "Store",
    "background",
    "close_connections",
    "close_result_backends",
    "counted_cache",
    "forget_backend",
    "in_thread",
    "intervals",
    "reset_publisher",
    "run",
    "send_storm",
    "use_memcached",
    "use_redis_broker",
    "wait_until",
    "waited_until",
]


def wait_until(
    condition, limit: float = 30.0, about=None, every: float = 0.005
) -> float:
    """Seconds until ``condition()`` held, polling every ``every`` seconds
    (longer for a condition that costs a round trip per key it reads);
    ``about()`` says what the failure message should show of the state then."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit:
            shown = f": {about()}" if about is not None else ""
            raise AssertionError(f"not within {limit}s{shown}")
        time.sleep(every)
    return time.monotonic() - started


def run(coroutine_function, *args, loop="asyncio"):
    """Run ``coroutine_function(*args)`` in a new event loop (asyncio's, or
    uvloop's), its connections closed at the end."""
    from django_tasklock.aio import close_loop_connections

    async def main():
        try:
            return await coroutine_function(*args)
        finally:
            await close_loop_connections()

    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


async def waited_until(condition, within: float = 30.0) -> None:
    """``wait_until`` on an event loop: ``condition()`` polled every 10 ms."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "never came"
        await asyncio.sleep(0.01)


def use_memcached(settings, address, protocol="auto", alias="own") -> None:
    """Locks on the memcached at ``address``, as the cache ``alias``."""
    config = {"BACKEND": MEMCACHED, "LOCATION": address}
    settings.CACHES = {**settings.CACHES, alias: config}
    settings.TASKLOCK = {"CACHE": alias, "MEMCACHED_PROTOCOL": protocol}


def send_storm(calls, producers: int = 4) -> list:
    """Send every (task, args, kwargs) from several producer threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    from django_tasklock.backends import close_thread_connections

    def send(call):
        task, args, kwargs = call
        try:
            return task.apply_async(args=args, kwargs=kwargs)
        finally:
            # A call with an enqueue-time mode talked to the lock store from
            # this producer thread, which ends without closing anything.
            close_thread_connections()

    with ThreadPoolExecutor(producers) as pool:
        return list(pool.map(send, calls))


def intervals(run_key) -> list[tuple[float, float]]:
    """The (start, end) of every run ``tests.tasks`` recorded under ``run_key``."""
    from tests import tasks

    return [(run["start"], run["end"]) for run in tasks.runs(run_key)]


def close_connections() -> None:
    """Close this thread's cache connections, Redis pools included.

    Django's RedisCache.close() leaves its connection pools open, so a thread that
    ends would drop them unclosed (a ResourceWarning, an error in this suite).
    """
    from django_tasklock.backends import close_thread_connections

    close_caches()
    close_thread_connections()
    for pool in getattr(caches["redis"]._cache, "_pools", {}).values():
        pool.disconnect()


@dataclass
class Store:
    """One way of storing locks, as the tests see it."""

    name: str
    alias: str
    protocol: str = "auto"

    @property
    def is_redis(self) -> bool:
        return self.alias in ("redis", "django_redis", "cluster")

    @property
    def is_postgres(self) -> bool:
        return self.alias in ("postgres", "pgbouncer")

    @property
    def precise(self) -> bool:
        """Whether expiries count milliseconds (memcached's whole seconds may
        end one early)."""
        return self.is_redis or self.is_postgres

    @property
    def tasklock(self) -> dict[str, object]:
        return {
            "LOCK_EXPIRE": 60,
            "CACHE": self.alias,
            "MEMCACHED_PROTOCOL": self.protocol,
        }


SHARED_STORES = [
    Store("memcached-meta", "default", "meta"),
    Store("memcached-classic", "default", "classic"),
    Store("redis", "redis"),
    Store("django-redis", "django_redis"),
    Store("pylibmc", "pylibmc"),
    # A Redis Cluster (three primaries, a replica each), through django-valkey.
    Store("cluster", "cluster"),
    # A table in PostgreSQL, directly and through PgBouncer's transaction pooling.
    Store("postgres", "postgres"),
    Store("pgbouncer", "pgbouncer"),
]
# TASKLOCK_TEST_STORES names the stores the store tests run on (all: unset).
# The matrix of other Python/Django pairs (noxfile.py) runs them on the stores
# whose client code changes with the Python or Django version.
if os.environ.get("TASKLOCK_TEST_STORES"):
    _chosen = os.environ["TASKLOCK_TEST_STORES"].split(",")
    _unknown = set(_chosen) - {store.name for store in SHARED_STORES}
    if _unknown:
        raise ValueError(
            f"TASKLOCK_TEST_STORES names unknown stores {sorted(_unknown)}; "
            f"the stores are {[store.name for store in SHARED_STORES]}"
        )
    SHARED_STORES = [store for store in SHARED_STORES if store.name in _chosen]


# What a test reads or writes of a store item a lock keeps, by its lock id. On
# most stores that is ``caches[alias].get(lock_id)``; on a cluster only a lock's
# own key is Django's, and the ids derived from it (fencing counters, semaphore
# slots) and the liveness records beside it are found through its backend.


def _cluster_key(alias: str, lock_id: str) -> tuple[object, str] | None:
    from django_tasklock.backends import backend_for

    if alias != "cluster":
        return None
    backend = backend_for(alias)
    return backend, backend.key_for(lock_id)


def stored(alias: str, lock_id: str) -> object:
    """The value the store keeps for ``lock_id`` (None: nothing)."""
    found = _cluster_key(alias, lock_id)
    if found is None:
        return caches[alias].get(lock_id)
    backend, key = found
    raw = backend._redis(key).get(key)  # type: ignore[attr-defined]
    return None if raw is None else backend._decode(raw)  # type: ignore[attr-defined]


def store_item(alias: str, lock_id: str, value: object) -> None:
    """Store ``value`` for ``lock_id``, as other code might."""
    found = _cluster_key(alias, lock_id)
    if found is None:
        caches[alias].set(lock_id, value)
        return
    backend, key = found
    client = backend._redis(key)  # type: ignore[attr-defined]
    client.set(key, backend._cache_client._serializer.dumps(value))  # type: ignore[attr-defined]


def drop(alias: str, lock_id: str) -> None:
    """Delete what the store keeps for ``lock_id`` (as its expiry would)."""
    found = _cluster_key(alias, lock_id)
    if found is None:
        caches[alias].delete(lock_id)
        return
    backend, key = found
    backend._redis(key).delete(key)  # type: ignore[attr-defined]


def record_beside(alias: str, lock_id: str, record: str) -> object:
    """The liveness record ``record`` as a contender reads it beside the lock
    ``lock_id`` (on most stores, on the lock's server; on a cluster, in its
    hash slot)."""
    from django_tasklock.backends import backend_for

    backend = backend_for(alias)
    assert backend.records is not None, f"{alias} keeps no liveness records"
    return backend.records.read_record(backend.key_for(lock_id), record)


def counted_cache(settings, memcached, redis_server, kind: str):
    """A CACHES alias ``counted`` on memcached or Redis through a FaultProxy,
    which counts the requests that reach the store (round trips), as
    TASKLOCK's cache; the proxy (close it when done)."""
    from tests.faultproxy import FaultProxy

    upstream = memcached.port if kind == "memcached" else redis_server.port
    proxy = FaultProxy(upstream)
    if kind == "memcached":
        config = {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": proxy.address,
        }
    else:
        config = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://{proxy.address}/0",
        }
    settings.CACHES = {**settings.CACHES, "counted": config}
    settings.TASKLOCK = {"CACHE": "counted", "MEMCACHED_PROTOCOL": "meta"}
    return proxy


def background(function, *args):
    """Start ``function`` in a new thread; return the thread and a dict that gets
    its ``result`` or ``error`` when it ends.

    Django's caches and database connections are per thread; the thread closes
    its own before it ends, as a Celery thread pool or a request handler would.
    """
    import threading

    outcome: dict[str, object] = {}

    def run() -> None:
        from django.db import connections

        try:
            outcome["result"] = function(*args)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            close_connections()
            # A request it made opened this thread's database connection
            # (Python 3.13 warns of one left for the garbage collector).
            # Django keeps an in-memory SQLite database's open on close(), the
            # test database here: its other connections keep the data.
            for connection in connections.all(initialized_only=True):
                raw = connection.connection
                connection.close()
                if raw is not None and connection.connection is not None:
                    raw.close()
                    connection.connection = None

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def in_thread(function, *args):
    """Run ``function`` in a new thread and return its result (or raise its error)."""
    thread, outcome = background(function, *args)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]


def forget_backend(celery_app):
    """Celery keeps a result backend per thread once asked for one; earlier tests
    in this thread may have met the app before its backend was configured."""
    celery_app._local.__dict__.pop("backend", None)


def reset_publisher(celery_app) -> None:
    """Close the app's broker connections and forget them, so that the next
    publish connects anew (to the broker_url configured by then)."""
    from kombu import pools

    pools.reset()
    celery_app._pool = None
    celery_app.amqp._producer_pool = None
    close_result_backends()
    forget_backend(celery_app)


def close_result_backends() -> None:
    """Close every Celery Redis result backend of this process, those of
    threads that ended (an in-process worker's) included, before the garbage
    collector finds their sockets open."""
    import gc

    from celery.backends.redis import RedisBackend

    # Not gc.collect() first: objects already unreachable are still listed
    # here, and must be closed before they are collected.
    # type(), not isinstance(): that would read __class__, which evaluates
    # Django's lazy objects.
    backends = [o for o in gc.get_objects() if issubclass(type(o), RedisBackend)]
    for backend in backends:
        consumer = backend.__dict__.get("result_consumer")
        if consumer is not None:
            consumer.stop()
            # A result that outlives it must not reconnect to unsubscribe.
            consumer.cancel_for = lambda task_id: None
        client = backend.__dict__.get("client")  # a cached_property
        if client is not None:
            client.connection_pool.disconnect()


def use_redis_broker(
    celery_app, redis_url: str, databases: tuple[int, int] = (3, 4)
) -> dict[str, str]:
    """Point ``celery_app`` (and worker processes started after, through the
    environment) at a private Redis: broker and results in ``databases``
    (db 3 and db 4; the docs' examples have their own)."""
    base = redis_url[:-2]
    broker_db, results_db = databases
    env = {
        "TASKLOCK_TEST_BROKER": f"{base}/{broker_db}",
        "TASKLOCK_TEST_RESULTS": f"{base}/{results_db}",
    }
    os.environ.update(env)
    celery_app.conf.update(
        broker_url=env["TASKLOCK_TEST_BROKER"],
        result_backend=env["TASKLOCK_TEST_RESULTS"],
    )
    reset_publisher(celery_app)
    return env
