"""What every lock store implements, and which Django cache backends can be one."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, NamedTuple

from ..keys import fence_id
from ..values import FenceCounter

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache
    from django.core.checks import CheckMessage

__all__ = ["ONE_PLACE", "FenceCounter", "Hold", "LockBackend", "Peek", "Supported"]

#: How many lock ids' keys a backend remembers before it starts over.
_KEYS_REMEMBERED = 4096

#: The place of a store whose every lock is on one server (or one primary).
ONE_PLACE: Final = "store"

#: What a backend needs to prove ownership later: a CAS id on memcached, the
#: stored token on Redis and LocMem. Opaque to everything but its backend.
Hold = object


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
    #: Whether the store runs Lua scripts atomically (``script``, ``raw``):
    #: then rate limits decide in the store, on its clock, in one round trip;
    #: else by compare-and-swap on the client's clock.
    runs_scripts: ClassVar[bool] = False
    #: Whether a liveness record is kept beside each lock, in the lock's own
    #: hash slot (a cluster, where slots move between primaries), rather than
    #: once per server: it is then written with every lock taken for a token
    #: that promises it, and renewed beside every lock still held
    #: (``write_records_beside``).
    records_beside_locks: ClassVar[bool] = False
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

    def restarted_at(self, key: str) -> float | None:
        """When the server holding ``key`` was last seen to start again after a
        restart that emptied it (monotonic), if this backend can tell; None
        otherwise. Reading it on a new connection learns the server's run."""
        return None

    def reassert(self, key: str, token: str, expire: float) -> Hold | None:
        """Put back a lock a restart emptied, for its live holder: as
        ``acquire``, but never refused by a restart's grace period."""
        return self.acquire(key, token, expire)

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

    @abc.abstractmethod
    def held_many(self, keys: list[str]) -> list[bool]:
        """For each key, whether anybody holds that lock; one round trip."""

    # -- liveness records (locks.liveness) -----------------------------------------
    # A holder's record is safety state: a contender judges the holder dead
    # when it is missing. So it lives beside the lock it vouches for (on the
    # server holding the lock's key, on the primary), and is read and written
    # only through this backend's own connections, which raise on failure.
    # Django's cache client may do neither (pymemcache's HashClient answers
    # None for a server it marked failing, RedisCache reads from replicas).

    def record_places(self) -> list[object]:
        """Where a process keeps liveness records: one place per server a lock
        can be on. Empty when records cannot be kept beside locks (tokens then
        promise none, and locks last until they expire)."""
        return [ONE_PLACE]

    def record_place(self, key: str) -> object:
        """The place of ``record_places()`` that holds the lock at ``key``."""
        return ONE_PLACE

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        """Store the liveness record ``record_id`` at ``place`` for ``ttl``
        seconds; raises ``errors`` unless it was stored."""
        self.cache.set(record_id, value, timeout=ttl)

    def write_records_beside(
        self, record_id: str, value: str, ttl: int, keys: list[str]
    ) -> None:
        """Where ``records_beside_locks``: store the liveness record
        ``record_id`` beside each of the locks at ``keys`` for ``ttl`` seconds;
        raises ``errors`` unless all were stored."""
        raise NotImplementedError(f"{self.kind} keeps records once per server")

    def read_record(self, key: str, record_id: str) -> object | None:
        """The liveness record ``record_id`` kept beside the lock at ``key``;
        None only when its server answered that it has none, and ``errors``
        raised when it did not answer."""
        found: object | None = self.cache.get(record_id)
        return found

    def delete_record(self, place: object, record_id: str) -> None:
        """Remove the liveness record ``record_id`` at ``place``."""
        self.cache.delete(record_id)

    def uptimes(self) -> dict[str, float]:
        """Seconds each server of the store has run since it last started, by
        its name, for the servers that tell (none, for stores that cannot);
        raises ``errors`` when a server does not answer."""
        return {}

    def script(self, text: str, keys: tuple[str, ...], *args: object) -> Any:
        """Run the Lua script ``text`` atomically on the store (where
        ``runs_scripts``)."""
        raise NotImplementedError(f"{self.kind} runs no scripts")

    def raw(self, key: str) -> bytes | None:
        """The bytes a script stored at ``key`` (where ``runs_scripts``)."""
        raise NotImplementedError(f"{self.kind} runs no scripts")

    # -- plain items (the lock console's roster: no safety matter) -----------

    def add(self, key: str, value: str, timeout: int) -> bool:
        """``cache.add``: store the cache key ``key`` unless it exists."""
        return bool(self.cache.add(key, value, timeout=timeout))

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        """``cache.set_many``, for ``timeout`` seconds."""
        self.cache.set_many(items, timeout=timeout)

    def delete_many(self, keys: list[str]) -> None:
        """``cache.delete_many``."""
        self.cache.delete_many(keys)

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        """The values of the cache keys ``keys`` (before Django makes them) that
        are stored; one round trip per server. Raises ``errors`` when a server
        does not answer (never reports its keys missing)."""
        return self.cache.get_many(keys)

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
