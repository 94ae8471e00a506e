"""What every lock store implements, and which Django cache backends can be one."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from ..keys import fence_id
from ..values import FenceCounter
from .capabilities import (
    ONE_PLACE,
    CacheItems,
    Hold,
    KeepsLines,
    KeepsRecords,
    KeepsRecordsBeside,
    PlainItems,
    RunsScripts,
    TellsRestarts,
    TellsUptimes,
)

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache
    from django.core.checks import CheckMessage

__all__ = ["ONE_PLACE", "FenceCounter", "Hold", "LockBackend", "Peek", "Supported"]

#: How many lock ids' keys a backend remembers before it starts over.
_KEYS_REMEMBERED = 4096


class Peek(NamedTuple):
    """What the store holds for a lock: the stored value and a hold on that very
    item, which ``release()`` accepts to remove it only if it is still there."""

    value: object
    hold: Hold


class LockBackend(abc.ABC):
    """Atomic, owner-checked lock primitives on one Django cache alias.

    A backend object belongs to the thread that made it, like the Django cache
    object it wraps. ``errors`` lists the exceptions that mean "the store could not
    be reached or failed"; ``Lock`` turns them into ``LockBackendError``.
    """

    kind: ClassVar[str]
    errors: tuple[type[BaseException], ...] = ()
    #: memcached only: "auto", "meta" or "classic" (TASKLOCK["MEMCACHED_PROTOCOL"]),
    #: fixed when the backend is built.
    protocol: str
    #: What it can do beyond its locks (``capabilities``): the object that
    #: does each, or None where it cannot; set by the store's ``__init__``.
    records: KeepsRecords | None = None
    records_beside: KeepsRecordsBeside | None = None
    restarts: TellsRestarts | None = None
    uptime: TellsUptimes | None = None
    scripts: RunsScripts | None = None
    lines: KeepsLines | None = None
    items: PlainItems
    #: The module of the store's own client for event loops, whose
    #: ``build(backend)`` makes one for a loop (or None where this alias's
    #: settings rule it out); None: loops use this backend on executor threads.
    async_client: ClassVar[str | None] = None

    def __init__(self, cache: BaseCache, alias: str, protocol: str = "auto") -> None:
        self.cache = cache
        self.alias = alias
        self.protocol = protocol
        self._keys: dict[str, tuple[str, str]] = {}
        #: key -> when this thread may next look at who holds that lock
        #: (``locks.recovery``; monotonic).
        self.looks: dict[str, float] = {}
        #: expire -> ``shortest_life(expire)``, remembered (asked per acquire).
        self.lives: dict[float, float] = {}
        self.items = CacheItems(cache)

    @classmethod
    def refusal(cls, options: dict[str, Any]) -> str | None:
        """Why an alias of this store with these OPTIONS cannot hold locks (a
        client that spreads a lock's keys over servers, say), with what to
        write instead; None if it can."""
        return None

    @classmethod
    def alias_checks(
        cls, alias: str, config: dict[str, Any], protocol: object, hint: str
    ) -> list[CheckMessage]:
        """The system checks of this store's own for ``CACHES[alias]``
        (``config``), one it can hold locks; ``protocol`` is
        ``TASKLOCK['MEMCACHED_PROTOCOL']`` (None: another setting is wrong),
        ``hint`` how to point locks at another alias."""
        return []

    def keys_for(self, lock_id: str) -> tuple[str, str]:
        """The store keys of ``lock_id`` and of its fencing counter, remembered:
        deriving them costs more than the rest of an acquire's Python."""
        keys = self._keys.get(lock_id)
        if keys is None:
            if len(self._keys) >= _KEYS_REMEMBERED:
                self._keys.clear()
            keys = self._keys[lock_id] = (
                self.key_for(lock_id),
                self.key_for(fence_id(lock_id)),
            )
        return keys

    def close(self) -> None:  # noqa: B027 - most backends use Django's connections
        """Close connections this backend opened itself (not Django's)."""

    def describe(self, key: str) -> str:
        """Name the store, for error messages: kind, alias and server."""
        return f"{self.kind} cache {self.alias!r}"

    def shortest_life(self, expire: float) -> float:
        """The least time a lock stored with ``expire`` is sure to live."""
        return expire

    def key_for(self, lock_id: str) -> str:
        """The store key of ``lock_id``, the same one ``cache.add(lock_id)`` uses."""
        return self.cache.make_key(lock_id)

    @abc.abstractmethod
    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        """Take the lock if nobody holds it: the hold, or None if it is held."""

    @abc.abstractmethod
    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        """Draw the next fencing token for the lock ``hold`` owns; None if it no
        longer owns it.

        Drawn only while the lock is verifiably still this holder's, so every
        token drawn under a later acquisition is larger. A counter is made only
        when somebody draws: locks whose fence is never read leave none.
        """

    @abc.abstractmethod
    def release(self, key: str, hold: Hold, token: object) -> bool:
        """Remove the lock only if ``hold`` still owns it; True if it was removed.

        ``token`` is the value stored with ``hold``: this holder's token, or for a
        forced release whatever value was read (other code may store anything).
        """

    @abc.abstractmethod
    def discard(self, key: str, token: str) -> bool:
        """Remove the lock only while it stores ``token``; True if it was removed.

        For tokens whose acquisition or release had an unknown outcome (a timeout,
        a dropped reply): nobody holds them, so the stored value is proof enough.
        """

    def lost_with_store(self, exc: BaseException) -> bool:
        """True if ``exc`` shows that the store lost what it held (a memcached
        that no longer runs keeps nothing)."""
        return False

    @abc.abstractmethod
    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        """Reset the expiry only if ``hold`` still owns it; return the new hold."""

    @abc.abstractmethod
    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        """Store ``new`` for ``expire`` seconds in place of the item ``hold`` holds
        (whose value is ``old``), only if the store still has that very item;
        the hold on the new item, or None if the item changed or went.

        How a call's lock changes state in one step: queued to running when a
        worker starts it, running to queued when it retries itself.
        """

    def take_over(
        self, key: str, expected: str, token: str, expire: float
    ) -> Hold | None:
        """Store ``token`` for ``expire`` seconds if the lock stores ``expected``
        (a queued call's mark) or is free; the hold, or None if it holds
        anything else. A backend that can do it in one round trip does."""
        peek = self.peek(key)
        if peek is None:
            return self.acquire(key, token, expire)
        if peek.value != expected:
            return None
        return self.replace(key, peek.hold, peek.value, token, expire)

    @abc.abstractmethod
    def owned(self, key: str, hold: Hold, token: str) -> bool:
        """True if ``hold`` still owns the lock."""

    @abc.abstractmethod
    def locked(self, key: str) -> bool:
        """True if anybody holds the lock."""

    def held_many(self, keys: list[str]) -> list[bool]:
        """For each key, whether anybody holds that lock; one round trip."""
        return [value is not None for value in self.values_many(keys)]

    @abc.abstractmethod
    def values_many(self, keys: list[str]) -> list[object | None]:
        """For each key, the value stored there (a holder's token, as
        ``peek`` reads it), or None; one round trip."""

    @abc.abstractmethod
    def ttl(self, key: str) -> float | None:
        """Seconds left on the current hold, whoever owns it; None if not held."""

    @abc.abstractmethod
    def peek(self, key: str) -> Peek | None:
        """The stored value and a hold on it, whoever owns it; None if not held."""

    @abc.abstractmethod
    def last_fence(self, key: str, fence_key: str) -> int | None:
        """The last fencing token drawn for the lock at ``key``; None if none is
        known (never taken, or the counter expired, was evicted or flushed)."""


@dataclass(frozen=True)
class Supported:
    """A Django cache class that can hold locks, and the lock backend for it:
    a row of the supported-caches table, which each store package declares
    (``SUPPORTED`` in its ``__init__``) and ``backends.supported`` gathers."""

    #: The cache class's dotted path, as CACHES names it.
    path: str
    #: Its name in messages.
    name: str
    #: The lock backend speaking to it.
    backend: type[LockBackend]
    #: Whether a lock taken in one process is seen by the others.
    shared: bool = True
    #: Named in the hints of errors that ask for a shared cache.
    recommended: bool = True
    #: The package it needs beyond Django (the pip extra of django_tasklock).
    needs: str = ""
    #: What else to know, for the docs.
    notes: str = ""
