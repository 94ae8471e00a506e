"""Fault cases 55-56: blocking acquires waiting in a lock's line, on Redis,
memcached and PostgreSQL (``locks.line``).

55. The first waiter in line is SIGKILLed, a second waits behind it, and the
    holder releases: the second must take the lock once the dead waiter's
    mark ends (its turn passed over), never wait on it for good.
56. The line is lost while a waiter waits in it (its keys deleted, as a
    flush or a failover would; on PostgreSQL the waiting process's
    ``LISTEN`` connection terminated too), and the holder releases: the
    waiter, woken by nobody, must take the lock by its own next try.

Each waiter is a process of its own (``tests.settings``, the stores named by
the environment), so the holder's release wakes it only across processes.
Overlaps: a waiter that took the lock before the holder released it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from reliability.faults import Row

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tests.services import Memcached, Redis

#: Seconds past a bound that a loaded machine may add (process start-up is
#: not counted: the waiters are in line before the release).
SLACK = 1.0

_WAITER = """
import sys, time
from tests.workers import setup_django
setup_django()
from django.conf import settings
settings.TASKLOCK = {{"CACHE": {alias!r}, "LIVENESS": None, "WAITING": "line"}}
from django_tasklock import Lock
lock = Lock({lock_id!r}, expire=30)
took = lock.acquire(blocking=True, timeout=60)
print(f"took {{took}} {{time.monotonic()!r}}", flush=True)
if took:
    lock.release()
"""


class Store:
    """One store's alias here and in the waiters, how many are in a lock's
    line, and how that line is lost."""

    def __init__(
        self,
        name: str,
        alias: str,
        in_line: Callable[[str], int],
        lose: Callable[[str], None],
        mark_bound: float,
    ) -> None:
        self.name, self.alias = name, alias
        self.in_line, self.lose = in_line, lose
        #: The longest a dead waiter may hold up the next (its mark, in the
        #: store's clock, and a try's wait).
        self.mark_bound = mark_bound


def _key(alias: str, lock_id: str) -> str:
    from django_tasklock.backends import backend_for

    return backend_for(alias).keys_for(lock_id)[0]


def _redis_store(url: str) -> Store:
    from django_tasklock.locks.line import LONGEST, MARK

    def client() -> Any:
        import redis

        return redis.Redis.from_url(url)

    def in_line(lock_id: str) -> int:
        return int(client().zcard(f"{{{_key('redis', lock_id)}}}tasklock-line"))

    def lose(lock_id: str) -> None:
        key = _key("redis", lock_id)
        found = list(client().scan_iter(match=f"{{{key}}}tasklock-line*"))
        client().delete(*found)

    return Store("Redis", "redis", in_line, lose, MARK + LONGEST)


def _memcached_store() -> Store:
    from django_tasklock.backends import backend_for
    from django_tasklock.backends.memcached.line import _Names
    from django_tasklock.locks.line import LONGEST, MARK

    def counters(lock_id: str) -> tuple[Any, list[str]]:
        backend = backend_for("default")
        key = _key("default", lock_id)
        names = _Names(key)
        return backend._client(key), [names.head, names.tail]

    def in_line(lock_id: str) -> int:
        client, keys = counters(lock_id)
        got = client.get_many(keys)
        return max(int(got.get(keys[1], 0)) - int(got.get(keys[0], 0)), 0)

    def lose(lock_id: str) -> None:
        client, keys = counters(lock_id)
        client.delete_many(keys)

    # (Marks in whole seconds on memcached's clock: up to 2 more.)
    return Store("memcached", "default", in_line, lose, MARK + 2 + LONGEST)


def _postgres_store(database: Any) -> Store:
    from django_tasklock.backends.postgres import statements as sql
    from django_tasklock.locks.line import LONGEST, MARK

    def in_line(lock_id: str) -> int:
        rows = database.execute(
            f"SELECT value FROM {sql.TABLE} WHERE key = %s AND expires > now()",
            (_key("postgres", lock_id) + sql.LINE,),
        )
        return len(rows[0][0].split()) if rows else 0

    def lose(lock_id: str) -> None:
        database.execute(
            f"DELETE FROM {sql.TABLE} WHERE key = %s",
            (_key("postgres", lock_id) + sql.LINE,),
        )
        database.execute(  # the waiters' LISTEN connections: no NOTIFY heard
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE left(query, 7) = 'LISTEN ' AND pid <> pg_backend_pid()"
        )

    return Store("PostgreSQL", "postgres", in_line, lose, MARK + LONGEST)


class Waiter:
    """A process waiting in line for ``lock_id``."""

    def __init__(self, store: Store, lock_id: str) -> None:
        code = _WAITER.format(alias=store.alias, lock_id=lock_id)
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )

    def took_at(self) -> float | None:
        """When it took the lock (monotonic); None if it gave up or died."""
        assert self.process.stdout is not None
        said = self.process.stdout.readline().split()
        return float(said[2]) if said and said[1] == "True" else None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _until(condition: Callable[[], bool], limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def _tried(
    stores: list[Store], tries: int, lose: bool
) -> tuple[int, int, int, dict[str, list[float]]]:
    """Each store ``tries`` times: a held lock, waiters in line (the first
    SIGKILLed; or, with ``lose``, one waiter and its line lost), the release.
    Attempts, overlaps, wrongs, and per store the seconds from the release
    to the next take."""
    from django.test import override_settings

    from django_tasklock import Lock

    attempts = overlapping = wrong = 0
    waited: dict[str, list[float]] = {store.name: [] for store in stores}
    for store in stores:
        bound = (0.5 if lose else store.mark_bound) + SLACK
        for attempt in range(tries):
            lock_id = f"line-fault-{'lost' if lose else 'killed'}-{attempt}"
            with override_settings(TASKLOCK={"CACHE": store.alias, "LIVENESS": None}):
                holder = Lock(lock_id, expire=60)
                if not holder.acquire():
                    wrong += 1
                    continue
                attempts += 1
                waiters: list[Waiter] = []
                try:
                    for n in range(1 if lose else 2):
                        waiters.append(Waiter(store, lock_id))
                        joined = store.in_line
                        if not _until(lambda n=n, i=lock_id, j=joined: j(i) > n):
                            wrong += 1  # (never in line: the case not carried out)
                    if lose:
                        store.lose(lock_id)
                    else:
                        waiters[0].kill()
                    released = time.monotonic()
                    wrong += not holder.release()
                    took = waiters[-1].took_at()
                finally:
                    for waiter in waiters:
                        waiter.close()
            if took is None:
                wrong += 1
                continue
            overlapping += took < released
            waited[store.name].append(took - released)
            wrong += took - released > bound
    return attempts, overlapping, wrong, waited


@contextlib.contextmanager
def _stores() -> Iterator[list[Store]]:
    """The three stores, this part's own (the others' restart and stop
    theirs), here (CACHES ``redis``, ``default``, ``postgres``) and in the
    waiters (the environment)."""
    from tests.services import Memcached, Redis

    main, redis_server = Memcached().start(), Redis().start()
    try:
        with _on(main, redis_server) as stores:
            yield stores
    finally:
        main.stop()
        redis_server.stop()


@contextlib.contextmanager
def _on(main: Memcached, redis_server: Redis) -> Iterator[list[Store]]:
    from django.conf import settings
    from django.test import override_settings

    from django_tasklock.backends import close_thread_connections
    from tests.services_pg import lock_servers

    caches = {
        **settings.CACHES,
        "redis": {**settings.CACHES["redis"], "LOCATION": redis_server.url},
        "default": {**settings.CACHES["default"], "LOCATION": main.address},
    }
    named = {
        "TASKLOCK_TEST_REDIS": redis_server.url,
        "TASKLOCK_TEST_MEMCACHED": main.address,
    }
    before = {name: os.environ.get(name) for name in named}
    os.environ.update(named)
    try:
        with lock_servers() as (database, _bouncer), override_settings(CACHES=caches):
            settings.DATABASES["pg"]["PORT"] = str(database.port)
            close_thread_connections()
            try:
                yield [
                    _redis_store(redis_server.url),
                    _memcached_store(),
                    _postgres_store(database),
                ]
            finally:
                close_thread_connections()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(quick: bool) -> list[Row]:
    tries = 1 if quick else 3
    rows = []
    with _stores() as stores:
        attempts, overlapping, wrong, waited = _tried(stores, tries, lose=False)
        row = Row(
            "55. waiters in line: the first SIGKILLed", attempts, overlapping, wrong
        )
        row.figures.append(
            "the next took it "
            + ", ".join(f"{_spread(s)}s ({name})" for name, s in waited.items())
            + " after the release (the dead waiter's turn passed over when its "
            "mark ended)"
        )
        rows.append(row)
        attempts, overlapping, wrong, waited = _tried(stores, tries, lose=True)
        row = Row("56. waiters in line: the line lost", attempts, overlapping, wrong)
        row.figures.append(
            "the waiter took it "
            + ", ".join(f"{_spread(s)}s ({name})" for name, s in waited.items())
            + " after the release (woken by nobody: its own next try)"
        )
        rows.append(row)
    return rows
