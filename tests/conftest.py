from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from django.core.cache import caches, close_caches
from django.test import override_settings

from tests.services import Memcached, Redis

pytest_plugins = ["tests.fixtures"]


def wait_until(condition, limit: float = 30.0, about=None) -> float:
    """Seconds until ``condition()`` held, polling every 5 ms; ``about()``
    says what the failure message should show of the state then."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit:
            shown = f": {about()}" if about is not None else ""
            raise AssertionError(f"not within {limit}s{shown}")
        time.sleep(0.005)
    return time.monotonic() - started


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


@pytest.fixture(scope="session")
def memcached() -> Iterator[Memcached]:
    server = Memcached().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def memcached_pair() -> Iterator[tuple[Memcached, Memcached]]:
    first, second = Memcached().start(), Memcached().start()
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Redis]:
    server = Redis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _services(
    django_test_environment: None,
    memcached: Memcached,
    memcached_pair: tuple[Memcached, Memcached],
    redis_server: Redis,
) -> Iterator[None]:
    """Point every CACHES alias at this session's servers, here and in children."""
    from django.conf import settings

    env = {
        "TASKLOCK_TEST_MEMCACHED": memcached.address,
        "TASKLOCK_TEST_MEMCACHED_PAIR": ",".join(s.address for s in memcached_pair),
        "TASKLOCK_TEST_REDIS": redis_server.url,
    }
    os.environ.update(env)
    cache_settings = {alias: dict(config) for alias, config in settings.CACHES.items()}
    for alias in ("default", "prefixed", "pylibmc"):
        cache_settings[alias]["LOCATION"] = memcached.address
    cache_settings["pair"]["LOCATION"] = [s.address for s in memcached_pair]
    cache_settings["redis"]["LOCATION"] = redis_server.url
    cache_settings["django_redis"]["LOCATION"] = redis_server.url
    with override_settings(CACHES=cache_settings):
        yield
        close_connections()


@pytest.fixture(autouse=True)
def _forget_liveness_records() -> Iterator[None]:
    """Each test starts with no liveness record thread and no token watched
    for removal: the stores and settings they were written to go with the
    test."""
    yield
    from django_tasklock import orphans
    from django_tasklock.locks.liveness import forget_records

    forget_records()
    # Tokens of unknown fate a test left watched (its stores are gone, or
    # stopped for good) would keep a later test's wait for an empty watch
    # waiting: the stores and settings they were taken in go with the test.
    orphans.forget()
    # What this process learnt of memcached servers' runs: a later test's
    # server may get a port an earlier test's used, and would be taken for
    # that server restarted (new locks refused for the grace).
    from django_tasklock.backends.memcached import restarts

    with restarts._runs_mutex:
        restarts._runs.clear()
        restarts._refused.clear()
        restarts._unlearnable.clear()


@pytest.fixture(autouse=True)
def _clean_stores(
    memcached: Memcached,
    memcached_pair: tuple[Memcached, Memcached],
    redis_server: Redis,
) -> None:
    restarted = False
    for server in (memcached, *memcached_pair):
        if server.process is None:  # a test stopped it and failed before restarting
            server.start()
        # A test that restarted it left this thread's connections to the old
        # process: the next command on them would fail (tests run in a random
        # order, so any test may come next).
        pid = server.process.pid  # type: ignore[union-attr]
        restarted |= getattr(server, "pid_seen", pid) != pid
        server.pid_seen = pid  # type: ignore[attr-defined]
        server.flush_all()
    if restarted:
        close_connections()
    # Only the databases tests write: Celery's broker (db 3) and results (db 4)
    # keep their queue bindings for worker processes that outlive one test.
    caches["redis"]._cache.get_client(write=True).flushdb()
    with redis.Redis.from_url(f"{redis_server.url[:-2]}/2") as runs:
        runs.flushdb()
    caches["locmem"].clear()


@dataclass
class Store:
    """One way of storing locks, as the tests see it."""

    name: str
    alias: str
    protocol: str = "auto"

    @property
    def is_redis(self) -> bool:
        return self.alias in ("redis", "django_redis")

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
]


@pytest.fixture(params=SHARED_STORES, ids=lambda store: store.name)
def store(request: pytest.FixtureRequest, settings: object) -> Store:
    """Each store that shares locks between processes, configured as TASKLOCK."""
    chosen: Store = request.param
    settings.TASKLOCK = chosen.tasklock  # type: ignore[attr-defined]
    return chosen


@pytest.fixture(
    params=[*SHARED_STORES, Store("locmem", "locmem")], ids=lambda store: store.name
)
def any_store(request: pytest.FixtureRequest, settings: object) -> Store:
    """Every supported store, LocMem included (single-process tests)."""
    chosen: Store = request.param
    settings.TASKLOCK = chosen.tasklock  # type: ignore[attr-defined]
    return chosen


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


def use_redis_broker(celery_app, redis_url: str) -> dict[str, str]:
    """Point ``celery_app`` (and worker processes started after, through the
    environment) at a private Redis: broker db 3, results db 4."""
    base = redis_url[:-2]
    env = {"TASKLOCK_TEST_BROKER": f"{base}/3", "TASKLOCK_TEST_RESULTS": f"{base}/4"}
    os.environ.update(env)
    celery_app.conf.update(
        broker_url=env["TASKLOCK_TEST_BROKER"],
        result_backend=env["TASKLOCK_TEST_RESULTS"],
    )
    reset_publisher(celery_app)
    return env


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The docs' examples run in the order they are written, each building on
    the ones above it on its page; pytest-randomly shuffles every other test
    (the examples take the places it gave them, in their own order)."""
    places = [
        i
        for i, item in enumerate(items)
        if getattr(item, "originalname", "") == "test_example"
        and item.nodeid.startswith("tests/test_docs_examples.py::")
    ]
    ordered = sorted(
        (items[i] for i in places),
        key=lambda item: item.callspec.indices["example"],  # type: ignore[attr-defined]
    )
    for place, item in zip(places, ordered, strict=True):
        items[place] = item
