"""What a lock store may do beyond its locks: each a small protocol that a store
provides or not, found on its backend by capability (``backend.records``,
``backend.scripts``, ...: the object that does it, or None), never by class.

- ``KeepsRecords``: liveness records beside the locks they vouch for (crash
  recovery tells a dead holder by its missing record);
- ``KeepsRecordsBeside``: records written beside each lock held, in the lock's
  own hash slot, rather than once per server (a cluster, where slots move);
- ``TellsRestarts``: when a server last restarted empty, and putting back a
  live holder's lock it lost (memcached, a cluster's primaries);
- ``TellsUptimes``: how long each server has run (the lock console's notice
  that a young server's roster may be incomplete);
- ``KeepsLines``: a waiting line beside each lock, woken on release (a
  blocking acquire waits its turn there instead of polling);
- ``RunsScripts``: Lua run atomically in the store (rate limits decide there,
  on its clock);
- ``PlainItems``: plain writes and reads (the lock console's roster: no safety
  matter), which every store has (``CacheItems``, on Django's cache, unless
  its own connections do better).

A store's backend sets the ones it has in its ``__init__`` (most to itself).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache

__all__ = [
    "ONE_PLACE",
    "WAITING_HERE",
    "CacheItems",
    "CacheRecords",
    "Hold",
    "KeepsLines",
    "KeepsRecords",
    "KeepsRecordsBeside",
    "PlainItems",
    "RunsScripts",
    "TellsRestarts",
    "TellsUptimes",
    "done_here",
    "expect_here",
    "wait_here",
    "wait_here_any",
    "waiting_keys",
    "wake_here",
]

#: The place of a store whose every lock is on one server (or one primary).
ONE_PLACE: Final = "store"

#: What a backend needs to prove ownership later: a CAS id on memcached, the
#: stored token on Redis and LocMem. Opaque to everything but its backend.
Hold = object


class KeepsRecords(Protocol):
    """Liveness records, safety state: a contender judges a holder dead when
    its record is missing. So a record lives beside the lock it vouches for
    (on the server holding the lock's key, on the primary), read and written
    through connections that raise on failure, which Django's cache clients
    may not (pymemcache's HashClient answers None for a server it marked
    failing, RedisCache reads from replicas)."""

    def record_places(self) -> list[object]:
        """Where a process keeps its records: one place per server a lock can
        be on."""

    def record_place(self, key: str) -> object:
        """The place of ``record_places()`` that holds the lock at ``key``."""

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        """Store the record ``record_id`` at ``place`` for ``ttl`` seconds;
        raises the backend's ``errors`` unless it was stored."""

    def read_record(self, key: str, record_id: str) -> object | None:
        """The record ``record_id`` kept beside the lock at ``key``; None only
        when its server answered that it has none; raises the backend's
        ``errors`` when it did not answer."""

    def delete_record(self, place: object, record_id: str) -> None:
        """Remove the record ``record_id`` at ``place``."""


class KeepsLines(Protocol):
    """A lock's waiting line, in the store beside the lock: the blocking
    acquires it refused, in the order they came. While a waiter in line has
    the turn (the first whose mark has not expired), the lock, once free, is
    refused to everybody else; a release wakes that waiter. The line decides
    only who may take a free lock, never who holds one: the lock's own item
    does, as ever, and a line lost (a flush, a failover) costs order, never
    safety (``locks.line``)."""

    #: True where a plain take refuses a free lock while a waiter has the turn
    #: (a script does both: Redis); False where it cannot (memcached), so a
    #: blocking acquire starts in line, lest a holder coming back at once
    #: take the lock past every waiter.
    guards_takes: bool
    #: True where an event loop's waiters can wait in line without a
    #: connection or an executor thread each. None can yet: on Redis a
    #: blocking pop per waiter (a thousand coroutines of one loop opened a
    #: connection each per wait, and took under one lock a second between
    #: them), on memcached an executor thread per step. Async waiters poll.
    wakes_async: bool

    def take_in_line(
        self, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        """Take the lock at ``key`` for ``token`` (as ``acquire``) if it is
        free and it is ``waiter``'s turn (or nobody's): its hold, and
        ``waiter`` leaves the line. Else None and how long, in seconds, to
        wait at most before the next try; ``waiter`` is then in the line (at
        its end the first time), its mark renewed for ``mark`` seconds."""

    def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        """Block until ``waiter`` is woken (a release, its turn come) or
        ``timeout`` seconds have passed: True if woken. ``timeout`` is below
        the store's reply timeout."""

    def leave_line(self, key: str, waiter: str) -> None:
        """Take ``waiter`` out of the line (it gave up); the next waiter is
        woken if the lock is free."""


#: (alias, lock key) -> this process's waiters blocked in that lock's line by
#: ``wait_here``, each an event: what a release here sets (``wake_here``),
#: where the store cannot wake them.
WAITING_HERE: dict[tuple[str, str], dict[str, threading.Event]] = {}
_here = threading.Lock()


def wait_here(
    alias: str, key: str, waiter: str, timeout: float, keep: bool = False
) -> bool:
    """Block ``waiter`` of this process until a release of the lock at ``key``
    here (``wake_here``) or ``timeout`` seconds: True if woken. With
    ``keep``, the waiter stays listed after it (until ``done_here``), so that
    a wake-up between two of its tries is kept for its next wait, not lost."""
    place = (alias, key)
    with _here:
        events = WAITING_HERE.setdefault(place, {})
        event = events.get(waiter)
        if event is None:
            event = events[waiter] = threading.Event()
    try:
        return event.wait(timeout)
    finally:
        event.clear()
        if not keep:
            done_here(alias, key, waiter)


def wait_here_any(alias: str, keys: list[str], waiter: str, timeout: float) -> bool:
    """``wait_here`` for a release of any of the locks at ``keys`` (a
    semaphore's slots)."""
    event = threading.Event()
    with _here:
        for key in keys:
            WAITING_HERE.setdefault((alias, key), {})[waiter] = event
    try:
        return event.wait(timeout)
    finally:
        for key in keys:
            done_here(alias, key, waiter)


def expect_here(alias: str, key: str, waiter: str) -> None:
    """List ``waiter`` of this process as waiting for the lock at ``key``
    before its first wait (it joined the line): a wake-up from now on is kept
    for that wait."""
    with _here:
        WAITING_HERE.setdefault((alias, key), {}).setdefault(waiter, threading.Event())


def done_here(alias: str, key: str, waiter: str) -> None:
    """``waiter`` no longer waits for the lock at ``key`` (it took it, or
    left)."""
    place = (alias, key)
    with _here:
        events = WAITING_HERE.get(place)
        if events is not None:
            events.pop(waiter, None)
            if not events:
                del WAITING_HERE[place]


def wake_here(alias: str, key: str) -> None:
    """Wake this process's waiters on the lock at ``key`` (it was released, or
    a waiter left its line): each tries again at once."""
    with _here:
        for event in WAITING_HERE.get((alias, key), {}).values():
            event.set()


def waiting_keys(alias: str) -> list[str]:
    """The keys of the locks of ``alias`` that waiters of this process wait
    for (``wait_here``)."""
    with _here:
        return [key for (of, key) in WAITING_HERE if of == alias]


class KeepsRecordsBeside(Protocol):
    """Records kept beside each lock, in its own hash slot: written with every
    lock taken for a token that promises one, and renewed beside every lock
    still held."""

    def write_records_beside(
        self, record_id: str, value: str, ttl: int, keys: list[str]
    ) -> None:
        """Store the record ``record_id`` beside each of the locks at ``keys``
        for ``ttl`` seconds; raises the backend's ``errors`` unless all were
        stored."""


class TellsRestarts(Protocol):
    """A store whose servers can restart empty and say so."""

    def restarted_at(self, key: str) -> float | None:
        """When the server holding ``key`` was last seen to start again after
        a restart that emptied it (monotonic); None if it was not. Reading it
        on a new connection learns the server's run."""

    def reassert(self, key: str, token: str, expire: float) -> Hold | None:
        """Put back a lock a restart emptied, for its live holder: as the
        backend's ``acquire``, but never refused by a restart's grace."""


class TellsUptimes(Protocol):
    """A store whose servers tell how long they have run."""

    def uptimes(self) -> dict[str, float]:
        """Seconds each server has run since it last started, by its name, for
        the servers that tell; raises the backend's ``errors`` when a server
        does not answer."""


class RunsScripts(Protocol):
    """A store that runs Lua scripts atomically."""

    def script(self, text: str, keys: tuple[str, ...], *args: object) -> Any:
        """Run the Lua script ``text`` atomically on the store."""

    def raw(self, key: str) -> bytes | None:
        """The bytes a script stored at ``key``."""


class PlainItems(Protocol):
    """Plain cache items, as Django's cache API has them."""

    def add(self, key: str, value: str, timeout: int) -> bool:
        """``cache.add``: store the cache key ``key`` unless it exists."""

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        """``cache.set_many``, for ``timeout`` seconds."""

    def delete_many(self, keys: list[str]) -> None:
        """``cache.delete_many``."""

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        """The values of the cache keys ``keys`` (before Django makes them)
        that are stored; one round trip per server. Raises the backend's
        ``errors`` when a server does not answer (never reports its keys
        missing)."""


class CacheItems:
    """``PlainItems`` on a Django cache object itself."""

    def __init__(self, cache: BaseCache) -> None:
        self.cache = cache

    def add(self, key: str, value: str, timeout: int) -> bool:
        return bool(self.cache.add(key, value, timeout=timeout))

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        self.cache.set_many(items, timeout=timeout)

    def delete_many(self, keys: list[str]) -> None:
        self.cache.delete_many(keys)

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        return self.cache.get_many(keys)


class CacheRecords:
    """``KeepsRecords`` on a Django cache object itself, in one place: only for
    a cache whose client raises rather than answer for a server it cannot
    reach (LocMem, in this process)."""

    def __init__(self, cache: BaseCache) -> None:
        self.cache = cache

    def record_places(self) -> list[object]:
        return [ONE_PLACE]

    def record_place(self, key: str) -> object:
        return ONE_PLACE

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        self.cache.set(record_id, value, timeout=ttl)

    def read_record(self, key: str, record_id: str) -> object | None:
        found: object | None = self.cache.get(record_id)
        return found

    def delete_record(self, place: object, record_id: str) -> None:
        self.cache.delete(record_id)
