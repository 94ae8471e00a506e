from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import redis
from django.core.cache import caches
from django.test import override_settings

from tests.helpers import (
    SHARED_STORES,
    Store,
    close_connections,
)
from tests.services import Memcached, Redis, RedisCluster, session_port
from tests.services_pg import PgBouncer, Postgres

pytest_plugins = ["tests.fixtures"]


# A project of its own, run by tests/project/test_new_project.py in its own
# environment: its tests are not this suite's.
collect_ignore = ["newproject"]


@pytest.fixture(scope="session")
def memcached() -> Iterator[Memcached]:
    server = Memcached(port=session_port()).start(redraw=session_port)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def memcached_pair() -> Iterator[tuple[Memcached, Memcached]]:
    first = Memcached(port=session_port()).start(redraw=session_port)
    second = Memcached(port=session_port()).start(redraw=session_port)
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Redis]:
    server = Redis(port=session_port()).start(redraw=session_port)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of this session's (three primaries, a replica each), the
    CACHES alias ``cluster`` here and in children. Started with the session,
    not when a test first asks for it: its settings must lie under every
    test's own (a test's override_settings, when it ends, puts back what was
    there when it began)."""
    # Its nodes judge a silent peer failed after 30 s, not 2 s: a loaded CI
    # (8 workers on 2 cores) starves a node for seconds, and a failover it
    # causes may lose a holder's renewed lock (the likeliest cause of one CI
    # failure: a renewed slot gone 1 s after its renewal, its holder told).
    # The tests of failovers make clusters of their own.
    server = RedisCluster(node_timeout=30_000).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """This session's PostgreSQL, its lock table made (the app's migration's
    statement), the DATABASES alias ``pg`` here and in children."""
    from django_tasklock.backends.postgres.statements import CREATE

    server = Postgres(port=session_port()).start()
    server.execute(CREATE)
    yield server
    server.remove()


@pytest.fixture(scope="session")
def pgbouncer(postgres: Postgres) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode before it: the alias ``pgbouncer``."""
    bouncer = PgBouncer(postgres, port=session_port()).start()
    yield bouncer
    bouncer.remove()


@pytest.fixture(scope="session", autouse=True)
def _services(
    django_test_environment: None,
    memcached: Memcached,
    memcached_pair: tuple[Memcached, Memcached],
    redis_server: Redis,
    redis_cluster: RedisCluster,
    postgres: Postgres,
    pgbouncer: PgBouncer,
) -> Iterator[None]:
    """Point every CACHES alias at this session's servers, here and in children."""
    from django.conf import settings

    env = {
        "TASKLOCK_TEST_MEMCACHED": memcached.address,
        "TASKLOCK_TEST_MEMCACHED_PAIR": ",".join(s.address for s in memcached_pair),
        "TASKLOCK_TEST_REDIS": redis_server.url,
        "TASKLOCK_TEST_CLUSTER": redis_cluster.url,
        "TASKLOCK_TEST_POSTGRES": str(postgres.port),
        "TASKLOCK_TEST_PGBOUNCER": str(pgbouncer.port),
    }
    os.environ.update(env)
    # (Django's connections read these very dicts: changed in place, before
    # any connection to them.)
    for database in ("pg", "pg_tests", "pg_no_table"):
        settings.DATABASES[database]["PORT"] = str(postgres.port)
    settings.DATABASES["pgbouncer"]["PORT"] = str(pgbouncer.port)
    cache_settings = {alias: dict(config) for alias, config in settings.CACHES.items()}
    for alias in ("default", "prefixed", "pylibmc"):
        cache_settings[alias]["LOCATION"] = memcached.address
    cache_settings["pair"]["LOCATION"] = [s.address for s in memcached_pair]
    cache_settings["redis"]["LOCATION"] = redis_server.url
    cache_settings["django_redis"]["LOCATION"] = redis_server.url
    cache_settings["cluster"]["LOCATION"] = redis_cluster.url
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
    # Likewise what it learnt of cluster primaries' runs.
    from django_tasklock.backends.redis import failover

    failover.forget()
    # PostgreSQL's listeners (lock waiters' wake-ups), whose servers and
    # settings go with the test too.
    listening = sys.modules.get("django_tasklock.backends.postgres.line")
    if listening is not None:
        listening.Listener.stop_all()


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


def _clean(request: pytest.FixtureRequest, chosen: Store) -> None:
    """Empty the stores kept apart from ``_clean_stores``'s, for a test of
    ``chosen``: the cluster, PostgreSQL's table."""
    if chosen.alias == "cluster":
        request.getfixturevalue("redis_cluster").flush()
    elif chosen.is_postgres:
        request.getfixturevalue("postgres").clear()


@pytest.fixture(params=SHARED_STORES, ids=lambda store: store.name)
def store(request: pytest.FixtureRequest, settings: object) -> Store:
    """Each store that shares locks between processes, configured as TASKLOCK."""
    chosen: Store = request.param
    _clean(request, chosen)
    settings.TASKLOCK = chosen.tasklock  # type: ignore[attr-defined]
    return chosen


@pytest.fixture(
    params=[*SHARED_STORES, Store("locmem", "locmem")], ids=lambda store: store.name
)
def any_store(request: pytest.FixtureRequest, settings: object) -> Store:
    """Every supported store, LocMem included (single-process tests)."""
    chosen: Store = request.param
    _clean(request, chosen)
    settings.TASKLOCK = chosen.tasklock  # type: ignore[attr-defined]
    return chosen


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """The docs' examples run in the order they are written, each building on
    the ones above it on its page; pytest-randomly shuffles every other test
    (the examples take the places it gave them, in their own order)."""
    _deselect_unchosen(config, items)
    places = [
        i
        for i, item in enumerate(items)
        if getattr(item, "originalname", "") == "test_example"
        and item.nodeid.startswith("tests/project/test_docs_examples.py::")
    ]
    ordered = sorted(
        (items[i] for i in places),
        key=lambda item: item.callspec.indices["example"],  # type: ignore[attr-defined]
    )
    for place, item in zip(places, ordered, strict=True):
        items[place] = item
    # Modules marked long first, longest first (their ``seconds``, measured
    # in make test's run), then those with slow tests (in pytest-randomly's
    # order among them, and their own tests in its order too). make test
    # hands modules to xdist's workers in this order (--no-loadscope-reorder;
    # tests/scheduling.py): its own, largest first, started a long module of
    # one test (a fault group) last, to run on alone for minutes.
    # A module marked ``long(first=False)`` (valgrind's benchmark run, which
    # took over 600 s under the load of the first long modules) comes after
    # the other long ones, before the rest.
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.partition("::")[0], []).append(item)

    def rank(tests: list[pytest.Item]) -> tuple[int, float]:
        long = tests[0].get_closest_marker("long")
        if long is not None:
            group = 0 if long.kwargs.get("first", True) else 1
            return group, -long.kwargs["seconds"]
        return (2 if any(t.get_closest_marker("slow") for t in tests) else 3), 0.0

    first = sorted(modules.values(), key=rank)
    items[:] = [item for tests in first for item in tests]


def _deselect_unchosen(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where TASKLOCK_TEST_STORES chose the stores (the matrix), a test
    parametrized over stores none of which was chosen is deselected, as
    chosen, not reported skipped (in a full run it would still show as a
    skip: "got empty parameter set")."""
    if not os.environ.get("TASKLOCK_TEST_STORES"):
        return
    unchosen = [
        item
        for item in items
        if any(
            str(mark.kwargs.get("reason", "")).startswith("got empty parameter set")
            for mark in item.iter_markers("skip")
        )
    ]
    if unchosen:
        config.hook.pytest_deselected(items=unchosen)
        gone = {id(item) for item in unchosen}
        items[:] = [item for item in items if id(item) not in gone]


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` as tests/scheduling.py has it: a long module of one
    test keeps no other long module waiting behind it on its worker."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.scheduling import LongFirstScheduling

    return LongFirstScheduling(config, log)
