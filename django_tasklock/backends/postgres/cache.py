"""``PostgresCache``: Django's cache API on the lock table of a PostgreSQL
database, over a connection of its own.

``LOCATION`` names the DATABASES alias (default ``"default"``) whose
database holds the table (``python manage.py migrate`` makes it).
``OPTIONS["LISTEN"]``: the DATABASES alias on which this process ``LISTEN``s
for the releases its lock waiters wait for (``line``; by default
``LOCATION``'s), or None to poll: behind a transaction pooler, an alias that
connects to the primary directly. ``OPTIONS["FAILOVER"]``: ``"synchronous"``
declares that a standby is
promoted only if it had every commit the primary acknowledged, so that a
promoted standby of a synchronous primary is no restart (``runs``); by
default ``"asynchronous"``. Unlike
Django's ``DatabaseCache``, ``add`` is one atomic statement judged by the
server's clock, so the Celery cookbook's recipe (``cache.add`` then
``cache.delete``) is as safe on it as on memcached; and no operation joins
the caller's transaction: a lock taken inside ``transaction.atomic()`` is
seen by every other process at once and survives a rollback.

A str is stored as text (so ``cache.get(lock_id)`` reads a lock's owner
back, as on memcached); any other value pickled.
"""

from __future__ import annotations

import base64
import math
import pickle
import threading
from typing import Any, Literal

from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
from django.db import connections
from psycopg.conninfo import make_conninfo

from ...conf import settings as tasklock_settings
from ...exceptions import LockConfigurationError
from . import statements as sql
from .checks import database_problem
from .wire import Wire

__all__ = ["PostgresCache"]

#: What Django's connection parameters hold for psycopg that libpq does not read.
_NOT_LIBPQ = ("cursor_factory", "context", "prepare_threshold")


def conninfo_for(connection: Any, timeout: float) -> str:
    """The libpq connection string of Django's connection ``connection``
    (its DATABASES entry, as Django would connect: in tests, the test
    database), with a connect timeout of ours unless it has one."""
    params = {
        name: value
        for name, value in connection.get_connection_params().items()
        if name not in _NOT_LIBPQ and value is not None
    }
    params.setdefault("connect_timeout", max(2, math.ceil(timeout)))
    # The primary only: a standby's rows lag behind (a liveness record not yet
    # replicated would read as missing, its holder as dead), and libpq refuses
    # a session it cannot write in when it connects.
    params["target_session_attrs"] = "read-write"
    params.setdefault("application_name", "django_tasklock")
    return make_conninfo(**params)


class PostgresCache(BaseCache):
    """A Django cache on the lock table of the database ``LOCATION`` names."""

    def __init__(self, location: str, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.database = location or "default"
        options = params.get("OPTIONS", {})
        self.failover = options.get("FAILOVER", "asynchronous")
        #: The DATABASES alias to LISTEN on (None: waiters poll).
        self.listen: str | None = options.get("LISTEN", self.database)
        # Connections per thread, not per cache object: Django hands one
        # cache object to an event loop's task and to the executor threads
        # it starts (asgiref's Local follows the context), and a libpq
        # connection serves one statement at a time.
        self._threads = threading.local()

    @property
    def where(self) -> str:
        """The database, for messages."""
        config = connections.settings[self.database]
        host = config.get("HOST") or "localhost"
        port = config.get("PORT") or 5432
        return f"database {self.database!r} ({host}:{port}/{config.get('NAME')})"

    @property
    def synchronous(self) -> bool:
        """Whether only synchronous standbys are promoted (OPTIONS["FAILOVER"])."""
        return bool(self.failover == "synchronous")

    def wire(self) -> Wire:
        """This thread's connection."""
        wire: Wire | None = getattr(self._threads, "wire", None)
        if wire is None:
            problem = database_problem(
                "A PostgresCache", self.database, self.failover, self.listen
            )
            if problem is not None:
                raise LockConfigurationError(problem)
            wire = self._threads.wire = Wire(
                self.conninfo(),
                tasklock_settings.SOCKET_TIMEOUT,
                self.where,
                self.synchronous,
            )
        return wire

    def conninfo(self) -> str:
        """The libpq connection string of the locks' connections."""
        timeout = tasklock_settings.SOCKET_TIMEOUT
        return conninfo_for(connections[self.database], timeout)

    def listen_conninfo(self) -> str | None:
        """The libpq connection string to LISTEN on (None: do not)."""
        if self.listen is None:
            return None
        timeout = tasklock_settings.SOCKET_TIMEOUT
        return conninfo_for(connections[self.listen], timeout)

    def close(self, **kwargs: Any) -> None:
        """Django's ``close_caches()``, at the end of every request and (by
        Celery's Django fix-up) after every task: the connection is kept, as
        Django's memcached and Redis caches keep theirs, so that neither a
        request nor a task pays a connect (and, through PgBouncer, a login)
        for its locks. ``disconnect`` closes it."""

    def disconnect(self) -> None:
        """Close this thread's connection (a later use opens another)."""
        wire = getattr(self._threads, "wire", None)
        self._threads.wire = None
        if wire is not None:
            wire.close()

    @staticmethod
    def encode(value: Any) -> tuple[str, str]:
        """The stored text of ``value`` and whether it is pickled (``t``/``f``)."""
        if isinstance(value, str):
            return value, "f"
        return base64.b64encode(
            pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        ).decode(), "t"

    @staticmethod
    def decode(text: str, pickled: bool) -> Any:
        return pickle.loads(base64.b64decode(text)) if pickled else text

    def _seconds(self, timeout: float | object | None) -> str | Literal[False] | None:
        """The lifetime of ``timeout`` as a statement parameter (None: never
        expires); False: gone at once (a timeout of 0 or less)."""
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.default_timeout
        if timeout is None:
            return None
        assert isinstance(timeout, (int, float))
        return sql.seconds(timeout) if timeout > 0 else False

    def _query(self, statement: bytes, *params: str | None) -> list[Any]:
        return self.wire().query(statement, params)

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None
    ) -> bool:
        key = self.make_and_validate_key(key, version=version)
        seconds = self._seconds(timeout)
        if seconds is False:
            return False
        text, pickled = self.encode(value)
        return bool(self._query(sql.ADD, key, text, seconds, pickled))

    def get(self, key: Any, default: Any = None, version: Any = None) -> Any:
        key = self.make_and_validate_key(key, version=version)
        rows = self._query(sql.READ, key)
        return self.decode(rows[0][0], rows[0][1] == "t") if rows else default

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None
    ) -> None:
        key = self.make_and_validate_key(key, version=version)
        seconds = self._seconds(timeout)
        if seconds is False:
            self._query(sql.DELETE, key)
            return
        text, pickled = self.encode(value)
        self._query(sql.WRITE, key, text, seconds, pickled)

    def touch(
        self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None
    ) -> bool:
        key = self.make_and_validate_key(key, version=version)
        seconds = self._seconds(timeout)
        if seconds is False:
            return bool(self._query(sql.DELETE, key))
        return bool(self._query(sql.TOUCH, key, None, seconds))

    def delete(self, key: Any, version: Any = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        rows = self._query(sql.DELETE, key)
        return bool(rows) and rows[0][0] == "t"

    def has_key(self, key: Any, version: Any = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        return bool(self._query(sql.READ, key))

    def get_many(self, keys: Any, version: Any = None) -> dict[Any, Any]:
        made = {self.make_and_validate_key(key, version=version): key for key in keys}
        if not made:
            return {}
        rows = self._query(sql.READ_MANY, sql.array(list(made)))
        return {made[key]: self.decode(value, p == "t") for key, value, p in rows}

    def delete_many(self, keys: Any, version: Any = None) -> None:
        made = [self.make_and_validate_key(key, version=version) for key in keys]
        if made:
            self._query(sql.DELETE_MANY, sql.array(made))

    def clear(self) -> None:
        self._query(sql.CLEAR)
