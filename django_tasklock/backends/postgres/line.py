"""A lock's waiting line on PostgreSQL (``KeepsLines``), woken by ``NOTIFY``.

The line is one row beside the lock (``statements.TAKE_IN_LINE``): its
waiters in the order they came, each with a mark it renews at every try. A
try is one statement: the lock is taken if it is free and no live waiter is
before this one (which then leaves the line), else the waiter joins the line
or renews its mark. A release (or a recovery's discard, or a waiter that
gives up) whose line lists anyone sends ``NOTIFY django_tasklock`` with the
md5 of the lock's key, in its own statement: a release with nobody waiting
sends none, and pays one index probe for the line's row.

The wake-up: each process that waits keeps one connection that ``LISTEN``s
(a thread per cache alias), which wakes this process's waiters of that
lock (``capabilities.wake_here``). ``LISTEN`` needs a session of its own:
through PgBouncer's transaction pooling it is not delivered. So the listener
proves its channel when it connects, with a ``NOTIFY`` sent the way locks
are sent (through the pooler, if any) and read on the listening
connection; until that arrives, and on a pooler that drops it, the waiters
poll, in order: the waiter whose turn it is every ``TURN_POLL``, the others
less often the further back they are. ``OPTIONS["LISTEN"]`` names the
DATABASES alias to listen on (a direct connection to the primary beside a
pooler's), or is ``None`` to poll.

What a lost wake-up costs (the listener's connection broke, a notify raced
its waiter's ``LISTEN``, a failover): the waiter tries again at the latest
``locks.line.LONGEST`` after its last try. A waiter that died keeps its
place until its mark ends (``locks.line.MARK``), then is passed over.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from ..capabilities import done_here, expect_here, wait_here, waiting_keys, wake_here
from . import statements as sql
from .errors import StatementFailed, Unreachable, run_changed

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..base import Hold
    from .cache import PostgresCache
    from .wire import Wire


class _Store(Protocol):
    """What the line needs of its ``PostgresBackend``."""

    alias: str
    cache: PostgresCache

    def _run(
        self,
        statement: bytes,
        *params: str | None,
        guard: Callable[[Wire], object] | None = None,
        on_run: Wire | None = None,
    ) -> list[Any]: ...

    def young(self, wire: Wire) -> None: ...


__all__ = ["TURN_POLL", "Listener", "PostgresLines"]

logger = logging.getLogger("django_tasklock.backends.postgres")

#: How often the waiter whose turn it is tries the lock while its process
#: hears no ``NOTIFY`` (the others: this times their place, up to
#: ``locks.line.LONGEST``).
TURN_POLL: Final = 0.01
#: How long a waiter that hears ``NOTIFY`` blocks between its tries at most
#: (``locks.line.turn_wait`` bounds it further).
WOKEN_WAIT: Final = 0.5
#: Seconds between a listener's tries to connect after it failed.
_RETRY: Final = 1.0
#: Seconds before a listener whose channel a pooler dropped tries again.
_DROPPED_RETRY: Final = 60.0


class PostgresLines:
    """``KeepsLines`` for a ``PostgresBackend``: the line in the lock table,
    its wake-ups by ``NOTIFY`` to this process's ``Listener``."""

    #: A plain take does not look at the line: a blocking acquire starts in it.
    guards_takes = False
    #: Each step would hold an executor thread: an event loop's waiters poll.
    wakes_async = False

    def __init__(self, backend: _Store) -> None:
        self.backend, self.alias = backend, backend.alias

    def take_in_line(
        self, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        backend = self.backend
        wire = backend.cache.wire()
        params = (key, token, sql.seconds(expire), waiter, sql.seconds(mark))
        for _ in range(2):
            rows = backend._run(
                sql.TAKE_IN_LINE, *params, guard=backend.young, on_run=wire
            )
            took, ahead, run = rows[0]
            if run == wire.mark:
                if took == "1":
                    done_here(self.alias, key, waiter)
                    return token, 0.0
                expect_here(self.alias, key, waiter)  # (a NOTIFY from now on)
                return None, self._pause(int(ahead or 0))
            wire.relearn()  # (another server behind the pooler: judged first)
        raise run_changed(wire)

    def _pause(self, ahead: int) -> float:
        """How long a waiter with ``ahead`` waiters before it blocks."""
        listener = Listener.of(self.backend)
        if listener is not None and listener.hears:
            return WOKEN_WAIT
        return TURN_POLL * (ahead + 1)

    def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        return wait_here(self.alias, key, waiter, timeout, keep=True)

    def leave_line(self, key: str, waiter: str) -> None:
        done_here(self.alias, key, waiter)
        self.backend._run(sql.LEAVE_LINE, key, waiter)
        wake_here(self.alias, key)  # the next waiter here, if its turn came


def _digest(key: str) -> str:
    return hashlib.md5(key.encode()).hexdigest()


class Listener:
    """This process's ``LISTEN`` on one PostgresCache alias: a daemon thread
    that wakes the waiters here of each lock a ``NOTIFY`` names. ``hears``:
    whether its channel was proven to reach it (else waiters poll)."""

    _of: dict[str, Listener] = {}
    _guard = threading.Lock()

    def __init__(self, alias: str, listen: str, send: str, where: str) -> None:
        self.alias, self.where = alias, where
        self.listen_conninfo, self.send_conninfo = listen, send
        self.hears = False
        self.pid = os.getpid()
        self._said_dropped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tasklock-listen-{alias}", daemon=True
        )
        self._thread.start()

    @classmethod
    def of(cls, backend: _Store) -> Listener | None:
        """The alias's listener in this process, started if need be; None
        where its OPTIONS["LISTEN"] is None."""
        if backend.cache.listen is None:
            return None
        alias = backend.alias
        listener = cls._of.get(alias)
        if listener is not None and listener.pid == os.getpid():
            return listener  # (every try in line asks: no connection string made)
        with cls._guard:
            listener = cls._of.get(alias)
            if listener is None or listener.pid != os.getpid():
                listening = backend.cache.listen_conninfo()
                assert listening is not None
                send = backend.cache.conninfo()
                listener = cls(alias, listening, send, backend.cache.where)
                cls._of[alias] = listener
        return listener

    @classmethod
    def stop_all(cls) -> None:
        """Stop every listener of this process (its connections closed)."""
        with cls._guard:
            listeners, cls._of = list(cls._of.values()), {}
        for listener in listeners:
            listener._stop.set()
        for listener in listeners:
            if listener.pid == os.getpid():
                listener._thread.join(5)

    def _run(self) -> None:
        from ...conf import settings
        from .wire import Wire  # (psycopg: imported once a waiter listens)

        while not self._stop.is_set():
            wire = Wire(self.listen_conninfo, settings.SOCKET_TIMEOUT, self.where)
            try:
                wire.query(f"LISTEN {sql.CHANNEL}".encode(), ())
                if not self._proven(wire, settings.SOCKET_TIMEOUT):
                    self._dropped(settings.SOCKET_TIMEOUT)
                    self._stop.wait(_DROPPED_RETRY)
                    continue
                self.hears = True
                while not self._stop.is_set():
                    self._wake(wire.notified(0.5))
            except (Unreachable, StatementFailed) as exc:
                logger.debug("Listening on %s: %s", self.where, exc)
            finally:
                self.hears = False
                wire.close()
            self._stop.wait(_RETRY)

    def _proven(self, wire: Wire, timeout: float) -> bool:
        """Whether a ``NOTIFY`` sent the way locks are sent reaches ``wire``
        (a transaction pooler drops it); the others it heard meanwhile woken."""
        from .wire import Wire

        probe = f"probe:{secrets.token_hex(8)}"
        sender = Wire(self.send_conninfo, timeout, self.where)
        try:
            sender.query(b"SELECT pg_notify($1, $2)", (sql.CHANNEL, probe))
        finally:
            sender.close()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            heard = wire.notified(left)
            if probe in heard:
                self._wake(heard)
                return True
            self._wake(heard)
        return False

    def _dropped(self, waited: float) -> None:
        if not self._said_dropped:
            self._said_dropped = True
            logger.warning(
                "A NOTIFY sent to %s did not reach this process's LISTEN there "
                "within %gs (a transaction pooler such as PgBouncer drops it): "
                "lock waiters poll in line instead of being woken by a release. "
                "Set OPTIONS['LISTEN'] of CACHES[%r] to a DATABASES alias that "
                "connects to the primary directly, or to None to poll quietly.",
                self.where,
                waited,
                self.alias,
            )

    def _wake(self, payloads: list[str]) -> None:
        if not payloads:
            return
        named = set(payloads)
        for key in waiting_keys(self.alias):
            if _digest(key) in named:
                wake_here(self.alias, key)
