"""The PostgreSQL store's own promises: never inside the caller's transaction,
judged by the server's clock, bounded waits, a clear refusal when its table or
database is wrong. (Every store test runs on it too: ``SHARED_STORES``.)"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from unittest import mock

import pytest
from django.core.cache import caches
from django.core.management import call_command
from django.db import connections, transaction
from django.test import TestCase

from django_tasklock import Lock, memcache_lock, orphans
from django_tasklock.backends import close_thread_connections
from django_tasklock.backends.postgres.statements import TABLE
from django_tasklock.checks import check_settings
from django_tasklock.exceptions import LockBackendError, LockConfigurationError
from tests.helpers import wait_until
from tests.services_pg import Postgres

pytestmark = pytest.mark.usefixtures("postgres")


@pytest.fixture
def on_postgres(settings, postgres: Postgres) -> Postgres:
    settings.TASKLOCK = {"CACHE": "postgres", "LOCK_EXPIRE": 60}
    postgres.clear()
    return postgres


def _row(server: Postgres, lock_id: str, alias: str = "postgres") -> list[tuple]:
    """The lock's row, read over a connection of its own (another session)."""
    key = caches[alias].make_key(lock_id)
    return server.execute(
        f"SELECT value FROM {TABLE} WHERE key = %s AND expires > clock_timestamp()",
        (key,),
    )


def test_a_lock_taken_inside_atomic_is_seen_at_once_and_outlives_the_rollback(
    on_postgres, django_db_blocker
):
    lock = Lock("in-atomic")
    with django_db_blocker.unblock():
        with pytest.raises(ZeroDivisionError), transaction.atomic(using="pg"):
            # The caller's own write in the same database, undone below.
            connections["pg"].cursor().execute(
                f"INSERT INTO {TABLE} (key, value, expires) "
                "VALUES ('callers-row', 'x', clock_timestamp() + interval '1 hour')"
            )
            assert lock.acquire()
            # Another session sees it while the caller's transaction is open.
            assert _row(on_postgres, "in-atomic") == [(lock.token,)]
            assert Lock("in-atomic").acquire() is False
            1 / 0  # noqa: B018 - the caller's transaction rolls back
        connections["pg"].close()
    assert on_postgres.execute(f"SELECT 1 FROM {TABLE} WHERE key = 'callers-row'") == []
    assert _row(on_postgres, "in-atomic") == [(lock.token,)]
    assert lock.owned() and lock.release()
    assert _row(on_postgres, "in-atomic") == []


def test_holding_a_lock_holds_no_transaction_open(on_postgres):
    with memcache_lock("no-open-transaction", "oid") as acquired:
        assert acquired
        sessions = on_postgres.execute(
            "SELECT state, xact_start FROM pg_stat_activity "
            "WHERE application_name = 'django_tasklock'"
        )
        assert sessions, "the lock's connection is not in pg_stat_activity"
        assert all(state == "idle" and xact is None for state, xact in sessions)


class TestInsideADjangoTestCase(TestCase):
    """A TestCase wraps each test in a transaction (on its test database,
    made by the migrations, ours among them): a lock taken in it is the
    store's at once, and stays after the test's rollback."""

    databases = {"default", "pg_tests"}
    taken: dict[str, str] = {}

    def test_a_lock_in_a_testcase_is_committed(self) -> None:
        from django.test import override_settings

        caches_setting = {
            "tc": {
                "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
                "LOCATION": "pg_tests",
            }
        }
        with override_settings(
            CACHES={**_caches(), **caches_setting}, TASKLOCK={"CACHE": "tc"}
        ):
            lock = Lock("in-testcase")
            assert lock.acquire()
            type(self).taken["token"] = lock.token
            type(self).taken["key"] = caches["tc"].make_key("in-testcase")
            # The test database's name is the test runner's, not NAME.
            name = connections["pg_tests"].settings_dict["NAME"]
            assert name.startswith("test_")
            type(self).taken["database"] = name
            close_thread_connections()

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()  # the test's transaction is gone by now
        import psycopg

        port = connections["pg_tests"].settings_dict["PORT"]
        dsn = f"host=127.0.0.1 port={port} user=tasklock dbname={cls.taken['database']}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                f"SELECT value FROM {TABLE} WHERE key = %s", (cls.taken["key"],)
            ).fetchall()
            conn.execute(f"DELETE FROM {TABLE}")
        assert rows == [(cls.taken["token"],)], rows


def _caches() -> dict:
    from django.conf import settings

    return {alias: dict(config) for alias, config in settings.CACHES.items()}


def test_expiry_is_the_servers_clock_not_the_clients(on_postgres):
    lock = Lock("server-clock", expire=1)
    assert lock.acquire()
    # A client whose clock jumps an hour ahead (or back) changes nothing.
    with mock.patch("time.time", return_value=time.time() + 3600):
        assert Lock("server-clock").acquire() is False
        assert lock.owned()
    deadline = time.monotonic() + 10
    while Lock("server-clock").locked():
        assert time.monotonic() < deadline, "the lock did not expire by its second"
        time.sleep(0.05)
    assert _row(on_postgres, "server-clock") == []


def test_a_missing_lock_table_is_a_clear_refusal(settings):
    settings.CACHES = {
        **settings.CACHES,
        "no_table": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": "pg_no_table",
        },
    }
    settings.TASKLOCK = {"CACHE": "no_table"}
    with pytest.raises(LockConfigurationError, match="migrate django_tasklock") as e:
        Lock("no-table").acquire()
    assert "--database pg_no_table" in str(e.value)


@pytest.mark.parametrize(
    ("location", "found"),
    [("default", "not PostgreSQL"), ("nowhere", "which DATABASES does not have")],
)
def test_a_location_that_is_no_postgresql_database_is_refused(
    settings, location, found
):
    settings.CACHES = {
        **settings.CACHES,
        "wrong": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": location,
        },
    }
    settings.TASKLOCK = {"CACHE": "wrong"}
    errors = [e for e in check_settings() if e.id == "django_tasklock.E025"]
    assert len(errors) == 1 and found in errors[0].msg
    with pytest.raises(LockConfigurationError, match=found):
        Lock("wrong-database").acquire()


def test_the_migration_makes_the_table_on_postgresql_only(django_db_blocker):
    with django_db_blocker.unblock():
        call_command("migrate", "django_tasklock", database="default", verbosity=0)
        tables = connections["default"].introspection.table_names()
        connections["default"].close()
    assert TABLE not in tables


@pytest.fixture
def own_postgres(settings) -> Iterator[Postgres]:
    """A PostgreSQL of this test's (it freezes or restarts it), its table
    made: the cache ``own_pg``, TASKLOCK's store."""
    from django_tasklock.backends.postgres.statements import CREATE

    server = Postgres().start()
    server.execute(CREATE)
    settings.DATABASES["pg_own"]["PORT"] = str(server.port)
    settings.CACHES = {
        **settings.CACHES,
        "own_pg": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": "pg_own",
        },
    }
    settings.TASKLOCK = {"CACHE": "own_pg", "LOCK_EXPIRE": 60, "SOCKET_TIMEOUT": 1}
    yield server
    close_thread_connections()
    if server.process is not None:
        server.thaw()
    server.remove()


def test_a_frozen_server_is_an_error_within_the_timeout_never_a_hang(own_postgres):
    held = Lock("frozen")
    assert held.acquire()
    own_postgres.freeze()
    try:
        started = time.monotonic()
        with pytest.raises(LockBackendError, match="did not answer within 1 s"):
            Lock("frozen-other").acquire()
        # One bound for the statement; a reconnect is bounded too.
        assert time.monotonic() - started < 3
        result: list[object] = []

        def from_another_thread() -> None:
            try:
                result.append(Lock("frozen-third").acquire())
            except LockBackendError as exc:
                result.append(exc)
            finally:
                close_thread_connections()

        thread = threading.Thread(target=from_another_thread)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive() and isinstance(result[0], LockBackendError)
    finally:
        own_postgres.thaw()
    # Thawed, its holder still holds it and the store serves again. The takes
    # sent into the frozen server may run now: their tokens, of unknown fate,
    # are removed once it answers (``orphans``), so the locks come free.
    assert held.owned() and held.release()
    wait_until(lambda: orphans.watched_count() == 0, 15)
    assert Lock("frozen-other").acquire()
    assert Lock("frozen-third").acquire()


def test_a_lock_outlives_a_server_restart_and_its_holder_releases_it(own_postgres):
    held = Lock("restarted")
    assert held.acquire()
    own_postgres.restart()
    # The first statement on the old connection fails (unknown): refused, told.
    contender = Lock("restarted")
    outcome = None
    for _ in range(3):
        try:
            outcome = contender.acquire()
            break
        except LockBackendError:
            continue
    assert outcome is False, "a committed lock was lost in a restart"
    assert held.owned() and held.release()


def test_a_stalled_pgbouncer_is_an_error_within_the_timeout(own_postgres, settings):
    from tests.services_pg import PgBouncer

    bouncer = PgBouncer(own_postgres).start()
    try:
        settings.DATABASES["pg_own"]["PORT"] = str(bouncer.port)
        close_thread_connections()
        held = Lock("behind-bouncer")
        assert held.acquire()
        assert bouncer.process is not None
        bouncer.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(LockBackendError, match="did not answer within 1 s"):
                Lock("behind-bouncer-other").acquire()
            assert time.monotonic() - started < 3
        finally:
            bouncer.process.send_signal(signal.SIGCONT)
        assert held.owned() and held.release()
    finally:
        close_thread_connections()
        bouncer.remove()


def test_the_async_client_is_the_loops_own_and_bounded(own_postgres):
    import asyncio

    from django_tasklock.aio import loop_backend
    from django_tasklock.backends.postgres.aio import AsyncPostgres

    async def scenario() -> tuple[bool, list[bool], float]:
        store = await loop_backend("own_pg", "auto")
        locks = [Lock(f"async-{n}") for n in range(50)]
        # Fifty coroutines at once take turns on the loop's one connection.
        taken = await asyncio.gather(*(lock.aacquire() for lock in locks))
        refused = await Lock("async-0").aacquire()
        released = await asyncio.gather(*(lock.arelease() for lock in locks))
        own_postgres.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(LockBackendError, match="did not answer within 1 s"):
                await Lock("async-frozen").aacquire()
            took = time.monotonic() - started
        finally:
            own_postgres.thaw()
        # Back once it answers a connection of its own (a thawed server on a
        # busy machine can take over the 1 s reply timeout to answer at all).
        await asyncio.to_thread(own_postgres.execute, "SELECT 1")
        assert await Lock("async-after").aacquire()
        native = isinstance(store, AsyncPostgres) and store.native
        await store.aclose()
        return native, [*taken, not refused, *released], took

    native, outcomes, took = asyncio.run(scenario())
    assert native
    assert all(outcomes)
    assert took < 3


def test_a_standby_is_refused_reads_and_writes_alike(own_postgres, settings):
    """Safety state is read on the primary only: a standby (its rows behind
    the primary's) is refused when the connection is made, for a take and for
    a read alike."""
    standby = own_postgres.standby()
    try:
        settings.DATABASES["pg_own"]["PORT"] = str(standby.port)
        close_thread_connections()
        refused = "session is read-only .a standby.+on the primary only"
        with pytest.raises(LockBackendError, match=refused):
            Lock("on-a-standby").acquire()
        with pytest.raises(LockBackendError, match=refused):
            Lock("on-a-standby").locked()
    finally:
        close_thread_connections()
        standby.remove()


def _taken_once_the_grace_is_over(lock_id: str, seen: float, grace: float) -> None:
    """``lock_id`` refused until ``grace`` seconds after ``seen`` (give or
    take half a second), then taken, within 10 s."""
    taken = False
    while not taken:
        assert time.monotonic() - seen < 10, "still refused past the grace"
        try:
            taken = Lock(lock_id).acquire()
        except LockBackendError:
            time.sleep(0.1)
    assert time.monotonic() - seen >= grace - 0.5


def test_a_promoted_standby_waits_the_grace_and_holders_keep_their_locks(
    own_postgres, settings
):
    """The primary gone, its streaming standby promoted (a new timeline) and
    clients sent to it: new locks wait RESTART_GRACE, counted from when the
    first process saw the new run, while the holder keeps its lock."""
    from reliability.nemesis import Proxy

    standby = own_postgres.standby()
    proxy = Proxy(own_postgres.port)
    try:
        settings.DATABASES["pg_own"]["PORT"] = str(proxy.port)
        settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": 3, "RESTART_GRACE": 3}
        close_thread_connections()
        held = Lock("failover-held")
        assert held.acquire()
        key = caches["own_pg"].make_key("failover-held")
        replicated = f"SELECT 1 FROM {TABLE} WHERE key = %s AND value = %s"
        wait_until(lambda: standby.execute(replicated, (key, held.token)) != [], 10)
        assert standby.execute("SELECT pg_promote()") == [(True,)]
        own_postgres.stop()
        proxy.upstream_port = standby.port
        proxy.reset()
        seen = time.monotonic()
        with pytest.raises(LockBackendError, match="began a new run"):
            Lock("failover-new").acquire()
        _taken_once_the_grace_is_over("failover-new", seen, grace=3)
        assert held.owned() and held.release()
    finally:
        close_thread_connections()
        proxy.close()
        standby.remove()


@pytest.mark.parametrize("replication", ["synchronous", "asynchronous"])
def test_a_promoted_synchronous_standby_is_no_restart_where_declared(
    own_postgres, settings, replication, caplog
):
    """OPTIONS["FAILOVER"] = "synchronous" declares that only a standby with
    every acknowledged commit is promoted. A primary that waited for its
    standby's flush of each commit (synchronous_standby_names set): the
    promoted standby has the held lock, and a new lock is taken at once. A
    primary that did not wait (the declaration wrong): the promoted standby
    is a new run as without it, new locks wait the grace, and the log says
    the run before it was not synchronous."""
    from reliability.nemesis import Proxy

    standby = own_postgres.standby()
    proxy = Proxy(own_postgres.port)
    try:
        if replication == "synchronous":
            own_postgres.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            # (remote_apply: a commit returns once the standby shows it too,
            # so the read there below sees the lock at once.)
            own_postgres.execute("ALTER SYSTEM SET synchronous_commit = 'remote_apply'")
            own_postgres.execute("SELECT pg_reload_conf()")
            wait_until(
                lambda: (
                    own_postgres.execute("SELECT sync_state FROM pg_stat_replication")
                    == [("sync",)]
                ),
                10,
            )
        settings.DATABASES["pg_own"]["PORT"] = str(proxy.port)
        settings.CACHES = {
            **settings.CACHES,
            "own_pg": {
                **settings.CACHES["own_pg"],
                "OPTIONS": {"FAILOVER": "synchronous"},
            },
        }
        settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": 3, "RESTART_GRACE": 30}
        close_thread_connections()
        held = Lock("sync-failover-held")
        assert held.acquire()
        key = caches["own_pg"].make_key("sync-failover-held")
        replicated = f"SELECT 1 FROM {TABLE} WHERE key = %s AND value = %s"
        if replication == "synchronous":  # there at once: the commit waited for it
            assert standby.execute(replicated, (key, held.token)) == [(1,)]
        else:
            wait_until(lambda: standby.execute(replicated, (key, held.token)), 10)
        assert standby.execute("SELECT pg_promote()") == [(True,)]
        own_postgres.stop()
        proxy.upstream_port = standby.port
        proxy.reset()
        with caplog.at_level("WARNING", "django_tasklock.backends.postgres"):
            # (The first statement may meet the proxy's reset of its old
            # connection: that error is not the outcome tried; once more.)
            outcome: object = None
            for _ in range(3):
                try:
                    outcome = Lock("sync-failover-new").acquire()
                except LockBackendError as exc:
                    outcome = exc
                if "closed the connection" not in str(outcome):
                    break
            if replication == "synchronous":
                assert outcome is True, outcome
            else:
                assert isinstance(outcome, LockBackendError), outcome
                assert "began a new run" in str(outcome), outcome
        said = {
            "synchronous": "it has every lock its predecessor acknowledged",
            "asynchronous": "the run before it was seen committing without waiting",
        }
        assert said[replication] in caplog.text.replace("\n", " ")
        assert held.owned() and held.release()
    finally:
        close_thread_connections()
        proxy.close()
        standby.remove()


def test_an_unknown_failover_option_is_refused(settings):
    settings.CACHES = {
        **settings.CACHES,
        "bad_failover": {
            "BACKEND": "django_tasklock.backends.postgres.cache.PostgresCache",
            "LOCATION": "pg",
            "OPTIONS": {"FAILOVER": "sync"},
        },
    }
    settings.TASKLOCK = {"CACHE": "bad_failover"}
    errors = [m for m in check_settings() if m.id == "django_tasklock.E025"]
    assert len(errors) == 1 and "OPTIONS['FAILOVER'] is 'sync'" in errors[0].msg
    with pytest.raises(LockConfigurationError, match="Set it to 'synchronous'"):
        Lock("bad-failover").acquire()


def test_django_closing_its_caches_leaves_their_connections_open(on_postgres):
    """Django's close_caches() (on ``request_finished``, and by Celery's
    Django fix-up after every task) keeps the store's session, as
    Django's Redis cache keeps its pool: the next use of the cache API (the
    cookbook recipe's ``caches["postgres"]``) and of a lock runs on the same
    server process, with no connect; only close_thread_connections() ends
    it."""
    from django.core.cache import close_caches

    cache = caches["postgres"]

    def session() -> int:
        return int(cache.wire().query(b"SELECT pg_backend_pid()", ())[0][0])

    assert cache.add("kept-recipe", "true", 60)
    before = session()
    close_caches()
    assert cache.delete("kept-recipe")
    assert session() == before
    with Lock("kept-session"):
        assert session() == before
    close_thread_connections()
    alive = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
    wait_until(lambda: on_postgres.execute(alive, (before,)) == [], 10)
    assert session() != before


def test_a_pooler_sent_to_a_promoted_standby_is_a_new_run_on_the_same_connection(
    own_postgres, settings
):
    """PgBouncer re-pointed to the promoted standby (as a failover manager
    does), its clients' connections kept: the connection this process had
    learnt the old run on takes nothing on the new one. The take sees the
    run mark changed, learns the run again, and is refused for the grace;
    the holder keeps its lock, and after the grace a new lock is taken."""
    from tests.services_pg import PgBouncer

    standby = own_postgres.standby()
    bouncer = PgBouncer(own_postgres).start()
    try:
        settings.DATABASES["pg_own"]["PORT"] = str(bouncer.port)
        settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": 3, "RESTART_GRACE": 3}
        close_thread_connections()
        held = Lock("pooled-failover-held")
        assert held.acquire()
        wire = caches["own_pg"].wire()
        connection = wire._conn  # (its libpq connection: kept, not made again)
        key = caches["own_pg"].make_key("pooled-failover-held")
        replicated = f"SELECT 1 FROM {TABLE} WHERE key = %s AND value = %s"
        wait_until(lambda: standby.execute(replicated, (key, held.token)) != [], 10)
        assert standby.execute("SELECT pg_promote()") == [(True,)]
        bouncer.point_at(standby)
        own_postgres.stop()
        seen = time.monotonic()
        with pytest.raises(LockBackendError, match="began a new run"):
            Lock("pooled-failover-new").acquire()
        assert wire._conn is connection, "the take reconnected: not the case tried"
        _taken_once_the_grace_is_over("pooled-failover-new", seen, grace=3)
        assert held.owned() and held.release()
    finally:
        close_thread_connections()
        bouncer.remove()
        standby.remove()


def test_a_table_emptied_behind_the_store_is_a_run_not_known(
    own_postgres, settings, caplog
):
    """The table is made with its run's record, and Django's cache.clear()
    keeps it: a connection made after it takes at once. Its rows deleted
    behind the store (a TRUNCATE), which run lost what since is not known:
    a new connection refuses new locks for the grace, as after a failover."""
    settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 30}
    caches["own_pg"].clear()
    close_thread_connections()
    with Lock("emptied"):
        pass
    own_postgres.execute(f"TRUNCATE {TABLE}")
    close_thread_connections()
    with (
        caplog.at_level("WARNING", "django_tasklock.backends.postgres"),
        pytest.raises(LockBackendError, match="or the record of its run deleted"),
    ):
        Lock("emptied").acquire()
    assert "holds no record of the database's run" in caplog.text


def test_notifications_between_statements_keep_the_connection(on_postgres):
    """A ``LISTEN`` a transaction pooler left on its server connection sends
    notifications to whichever client gets it next: they are dropped, not
    taken for the server ending the session (a reconnect each time). Bytes
    that are no notification still mean a new connection."""
    from django_tasklock.backends.postgres.cache import conninfo_for
    from django_tasklock.backends.postgres.wire import Wire

    conninfo = conninfo_for(connections["pg"], 2)
    wire, other = Wire(conninfo, 2, "pg"), Wire(conninfo, 2, "pg")
    try:
        wire.query(b"LISTEN tasklock_test", ())
        first = wire.query(b"SELECT pg_backend_pid()", ())
        other.query(b"SELECT pg_notify('tasklock_test', 'x')", ())
        wait_until(lambda: "x" in wire.notified(0.1))  # as a listener hears it
        other.query(b"SELECT pg_notify('tasklock_test', 'y')", ())
        wait_until(lambda: wire._readable.poll(0))  # (unread when the query comes)
        assert wire.query(b"SELECT pg_backend_pid()", ()) == first
        other.query(b"SELECT pg_terminate_backend($1::int)", (first[0][0],))
        wait_until(lambda: wire._readable.poll(0))
        assert wire.query(b"SELECT pg_backend_pid()", ()) != first  # reconnected
    finally:
        wire.close()
        other.close()
