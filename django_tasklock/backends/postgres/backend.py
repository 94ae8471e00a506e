"""Owner-checked locks in a PostgreSQL table (``statements``), over the
cache's own connection (``wire``): every operation one statement, one round
trip, atomic on the primary and judged by its clock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from ...conf import settings as tasklock_settings
from ...exceptions import LockConfigurationError
from ...keys import encodable_key, hashed_id
from ..base import FenceCounter, Hold, LockBackend, Peek
from ..capabilities import ONE_PLACE
from . import checks
from . import statements as sql
from .errors import MissingTable, StatementFailed, Unreachable, run_changed
from .line import PostgresLines
from .runs import taken_on_run

if TYPE_CHECKING:
    from collections.abc import Callable

    from .cache import PostgresCache
    from .wire import Wire

__all__ = ["PostgresBackend"]


#: Seconds between a thread's sweeps of expired rows (``statements.SWEEP``).
SWEEP_EVERY = 60.0


class PostgresBackend(LockBackend):
    """Locks on the database a ``PostgresCache`` alias names."""

    kind = "PostgreSQL"
    errors = (Unreachable, StatementFailed)
    async_client: ClassVar[str | None] = "django_tasklock.backends.postgres.aio"
    cache: PostgresCache

    alias_checks = staticmethod(checks.alias_checks)

    def __init__(
        self, cache: PostgresCache, alias: str, protocol: str = "auto"
    ) -> None:
        super().__init__(cache, alias, protocol)
        self.records = self.items = self.restarts = self
        self.lines = PostgresLines(self)
        self._swept = time.monotonic()

    def _run(
        self,
        statement: bytes,
        *params: str | None,
        guard: Callable[[Wire], object] | None = None,
        on_run: Wire | None = None,
    ) -> list[Any]:
        """``statement`` run on this thread's connection (``on_run``: that
        connection, its run mark sent as the last parameter)."""
        wire = on_run or self.cache.wire()
        try:
            return wire.query(statement, params, guard, on_run is not None)
        except MissingTable as exc:
            raise LockConfigurationError(
                f"CACHES[{self.alias!r}]'s lock table {sql.TABLE} does not exist "
                f"in database {self.cache.database!r}: run python manage.py "
                f"migrate django_tasklock --database {self.cache.database} "
                f"({exc})"
            ) from None

    def _one(self, statement: bytes, *params: str | None) -> bool:
        return bool(self._run(statement, *params))

    def _take(self, statement: bytes, *params: str | None) -> bool:
        """A take made only on the run the connection learnt (``TAKE_ON_RUN``,
        ``TAKE_OVER_ON_RUN``): where the server is on another (a pooler sent
        the connection to a promoted standby), the run is learnt again and
        judged (``young`` may refuse), then the take tried once more."""
        wire = self.cache.wire()
        for _ in range(2):
            rows = self._run(statement, *params, guard=self.young, on_run=wire)
            taken = taken_on_run(wire.mark, rows)
            if taken is not None:
                return taken
            wire.relearn()
        raise run_changed(wire)

    def key_for(self, lock_id: str) -> str:
        # Text holds any UTF-8 but NUL: ids that are not such are hashed.
        key = encodable_key(self.cache, lock_id)
        return self.cache.make_key(hashed_id(lock_id)) if "\x00" in key else key

    def describe(self, key: str) -> str:
        return f"{self.kind} cache {self.alias!r} at {self.cache.where}"

    def close(self) -> None:
        self.cache.disconnect()

    def young(self, wire: Wire | Any) -> None:
        """Refuse a new lock while the run of the database ``wire`` reached is
        younger than ``RESTART_GRACE`` (``runs``: a promoted standby, another
        cluster), when live holders may still be putting back what it lacks."""
        started = wire.run_started
        if started is None:
            return
        grace = tasklock_settings.RESTART_GRACE
        age = time.monotonic() - started
        if age >= grace:
            wire.run_started = None
            return
        raise Unreachable(
            f"{wire.where} began a new run {age:.0f}s ago (a promoted standby, "
            "another cluster, or the record of its run deleted): it may lack the "
            "last locks its predecessor held, "
            f"so new locks wait until it is {grace:g}s old "
            "(TASKLOCK['RESTART_GRACE']) while their live holders put them back"
        )

    def restarted_at(self, key: str) -> float | None:
        # Asked of a held lock found gone: first whether the server is still
        # on the run learnt (a pooler may have sent the connection on).
        wire = self.cache.wire()
        if wire.run_started is None and self._run(sql.READ_RUN_MARK)[0][0] != wire.mark:
            wire.relearn()
        return wire.run_started

    def reassert(self, key: str, token: str, expire: float) -> Hold | None:
        return token if self._one(sql.TAKE, key, token, sql.seconds(expire)) else None

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        taken = self._take(sql.TAKE_ON_RUN, key, token, sql.seconds(expire))
        if time.monotonic() - self._swept > SWEEP_EVERY:
            self.sweep()
        return token if taken else None

    def sweep(self) -> None:
        """Remove a batch of rows that expired a minute or more ago."""
        self._swept = time.monotonic()
        self._run(sql.SWEEP)

    def take_over(
        self, key: str, expected: str, token: str, expire: float
    ) -> Hold | None:
        params = (key, token, sql.seconds(expire), expected)
        taken = self._take(sql.TAKE_OVER_ON_RUN, *params)
        return token if taken else None

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        drawn, held, counter = self._run(
            sql.FENCE, key, str(hold), str(fence.ttl), fence.key, str(fence.floor)
        )[0]
        if drawn is not None:
            return int(drawn)
        if held == "t":
            raise StatementFailed(
                f"the fencing counter {fence.key!r} holds {counter!r}, not a number; "
                "some other code wrote to that key. Delete it (it restarts from "
                "the clock); no fence was drawn, and the lock is still held"
            )
        return None

    def release(self, key: str, hold: Hold, token: object) -> bool:
        return self._one(sql.RELEASE, key, str(hold))

    def discard(self, key: str, token: str) -> bool:
        return self._one(sql.DISCARD, key, token)

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        extended = self._one(sql.EXTEND, key, str(hold), sql.seconds(expire))
        return hold if extended else None

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        replaced = self._one(sql.REPLACE, key, str(hold), sql.seconds(expire), new)
        return new if replaced else None

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        peek = self.peek(key)
        return peek is not None and peek.hold == hold

    def locked(self, key: str) -> bool:
        return self._one(sql.READ, key)

    def values_many(self, keys: list[str]) -> list[object | None]:
        if not keys:
            return []
        found = {
            key: self.cache.decode(value, pickled == "t")
            for key, value, pickled in self._run(sql.READ_MANY, sql.array(keys))
        }
        return [found.get(key) for key in keys]

    def ttl(self, key: str) -> float | None:
        rows = self._run(sql.READ, key)
        return max(0.0, float(rows[0][2])) if rows else None

    def peek(self, key: str) -> Peek | None:
        return self.peeked(self._run(sql.READ, key))

    def peeked(self, rows: list[Any]) -> Peek | None:
        """The ``Peek`` of ``statements.READ``'s ``rows`` (the async client's
        too)."""
        if not rows:
            return None
        value, pickled, _left = rows[0]
        if pickled == "t":  # (Django's cache API stored it: no token's)
            decoded = self.cache.decode(value, True)
            return Peek(decoded, ("pickled", value))
        return Peek(value, value)

    def last_fence(self, key: str, fence_key: str) -> int | None:
        rows = self._run(sql.READ, fence_key)
        return int(rows[0][0]) if rows else None

    # Liveness records: rows of the same table, on the same primary.

    def record_places(self) -> list[object]:
        return [ONE_PLACE]

    def record_place(self, key: str) -> object:
        return ONE_PLACE

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        self._run(sql.WRITE, self.key_for(record_id), value, sql.seconds(ttl), "f")

    def read_record(self, key: str, record_id: str) -> object | None:
        # A run that may lack what its predecessor held may lack the record
        # too: its holder is not judged dead by it meanwhile.
        rows = self._run(sql.READ, self.key_for(record_id), guard=self.young)
        return self.cache.decode(rows[0][0], rows[0][1] == "t") if rows else None

    def delete_record(self, place: object, record_id: str) -> None:
        self._run(sql.DELETE, self.key_for(record_id))

    # Plain items (the lock console's roster): the same table too.

    def add(self, key: str, value: str, timeout: int) -> bool:
        return self._one(sql.ADD, self.key_for(key), value, sql.seconds(timeout), "f")

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        if items:
            keys = sql.array([self.key_for(key) for key in items])
            values = sql.array(list(items.values()))
            self._run(sql.WRITE_MANY, keys, values, sql.seconds(timeout))

    def delete_many(self, keys: list[str]) -> None:
        if keys:
            self._run(sql.DELETE_MANY, sql.array([self.key_for(k) for k in keys]))

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        if not keys:
            return {}
        made = {self.key_for(key): key for key in keys}
        rows = self._run(sql.READ_MANY, sql.array(list(made)))
        return {
            made[key]: self.cache.decode(value, pickled == "t")
            for key, value, pickled in rows
        }
