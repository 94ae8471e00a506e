"""Owner-checked locks on memcached through libmemcached (Django's PyLibMCCache).

libmemcached has no meta commands, so locks use the classic ones, as on a
memcached before 1.6: ``add`` to take, ``gets`` for the token and CAS id, and
``cas`` to act only while both are still this holder's. A release is ``cas``
with an absolute expiry long past, which expires the item at once (memcached has
no delete-if-CAS in the classic protocol). The backend builds a client of its
own from the alias's servers and options, with CAS support switched on, so
``gets`` answers CAS ids whatever the alias's ``behaviors`` say.

Keys go to pylibmc as bytes: given a str, pylibmc 1.6.3 has been seen (memcached
-vv) to send ``gets`` with a garbage one-byte key now and then, and read that
miss as the answer, which would make a holder's own lock look lost.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from pymemcache.exceptions import MemcacheError

from ...conf import settings as tasklock_settings
from ...foreign import memcached_client_of
from ...keys import memcached_key
from ...values import unique_value
from ..base import FenceCounter, Hold, LockBackend, Peek
from ..capabilities import ONE_PLACE
from . import meta
from .fencing import _bad_counter
from .wire import _PAST, _talk, exptime, sure_life

if TYPE_CHECKING:
    from django.core.cache.backends.memcached import PyLibMCCache

__all__ = ["PyLibMCBackend"]

# Clients a forked child inherited from its parent. Freeing one sends "quit" on
# the socket it shares with the parent, which cuts the parent's connection: the
# child keeps them, unused, for good.
_inherited: list[Any] = []


class _Cas:
    """A hold of this backend (its CAS id) as ``meta.while_ours`` reads it,
    and learns a moved item's new id into; never proven by a connection."""

    __slots__ = ("cas", "sock")

    def __init__(self, cas: int) -> None:
        self.cas, self.sock = cas, None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class PyLibMCBackend(LockBackend):
    """Locks on the memcached servers of a PyLibMCCache alias."""

    kind = "memcached (libmemcached)"
    cache: PyLibMCCache

    def __init__(self, cache: PyLibMCCache, alias: str, protocol: str = "auto") -> None:
        import pylibmc

        super().__init__(cache, alias, protocol)
        # libmemcached picks each key's server itself, so a liveness record
        # can be kept beside every lock only where all keys share one server.
        if len(cache.client_servers) == 1:
            self.records = self
        self.uptime = self
        self.errors = (pylibmc.Error, OSError, MemcacheError)
        self._not_found = pylibmc.NotFound
        self._client_error = pylibmc.ClientError
        options = memcached_client_of(cache)[1]
        behaviors = {**options.pop("behaviors", {}), "cas": True}
        # A lock must stay on its server: never let libmemcached move a failing
        # server's keys to another one.
        behaviors.pop("remove_failed", None)
        # Never wait longer than SOCKET_TIMEOUT on a server (libmemcached's
        # own default is 4 s to connect and 5 s for a reply).
        ours = max(1, int(tasklock_settings.SOCKET_TIMEOUT * 1000))
        for name in ("connect_timeout", "_poll_timeout"):
            behaviors[name] = min(behaviors.get(name) or ours, ours)
        self._mc: Any = pylibmc.Client(
            cache.client_servers, behaviors=behaviors, **options
        )
        self._pid = os.getpid()

    def close(self) -> None:
        if os.getpid() != self._pid:
            _inherited.append(self._mc)  # the parent's connection: leave it be
        else:
            self._mc.disconnect_all()

    def describe(self, key: str) -> str:
        servers = ", ".join(self.cache.client_servers)
        return f"memcached cache {self.alias!r} (pylibmc) at {servers}"

    def shortest_life(self, expire: float) -> float:
        return sure_life(expire)

    def key_for(self, lock_id: str) -> str:
        return memcached_key(self.cache, lock_id)

    def _read_item(self, key: str) -> tuple[object, int] | None:
        """The item at ``key``: its value and CAS id; None if it is gone."""
        value, cas = self._mc.gets(key.encode())
        return None if cas is None else (value, int(cas))

    def _ours(self, key: str, token: object) -> int | None:
        """The CAS id of the item at ``key`` if it stores ``token``, else None."""
        found = self._read_item(key)
        return found[1] if found is not None and found[0] == token else None

    def _write(self, key: str, token: object, cas: int, expire: int) -> bool:
        """``cas``: write only while the item's CAS id is still ``cas``."""
        try:
            return bool(self._mc.cas(key.encode(), token, cas, expire))
        except self._not_found:
            return False

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        if not self._mc.add(key.encode(), token, exptime(expire)):
            return None
        # Someone else's value here means our item expired in between.
        return self._ours(key, token)

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        try:
            try:
                number = int(self._mc.incr(fence.key.encode(), 1))
            except self._not_found:
                if self._mc.add(fence.key.encode(), str(fence.floor), fence.ttl):
                    number = fence.floor
                else:  # made by another holder in between
                    number = int(self._mc.incr(fence.key.encode(), 1))
        except self._client_error as exc:
            raise _bad_counter(fence, str(exc).encode()) from exc
        return number if self._still(key, hold, token) is not None else None

    def _still(self, key: str, hold: Hold, token: object) -> int | None:
        """The CAS id to act on while the item is still the one ``hold`` took:
        the same CAS id, or a unique token of ours under a new one (memcached's
        slab rebalancer moved it); None otherwise."""
        cas = self._ours(key, token)
        if cas is None or (cas != hold and not unique_value(token)):
            return None
        return cas

    def _while_still(
        self, key: str, hold: Hold, token: object, value: object, expire: int
    ) -> bool:
        """Write ``value`` for ``expire`` while the item is still the one
        ``hold`` took (``meta.while_ours``'s owner check); whether it was."""

        def write(cas: int) -> bool | None:
            return True if self._write(key, value, cas, expire) else None

        steps = meta.while_ours(key, _Cas(cast("int", hold)), token)
        return meta.drive(steps, lambda: self._read_item(key), write) is not None

    def release(self, key: str, hold: Hold, token: object) -> bool:
        return self._while_still(key, hold, token, token, _PAST)

    def discard(self, key: str, token: str) -> bool:
        cas = self._ours(key, token)
        return cas is not None and self._write(key, token, cas, _PAST)

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        return self.replace(key, hold, token, token, expire)

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        if not self._while_still(key, hold, old, new, exptime(expire)):
            return None
        return self._ours(key, new)

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        return self._still(key, hold, token) is not None

    def locked(self, key: str) -> bool:
        return self._mc.get(key.encode()) is not None

    def values_many(self, keys: list[str]) -> list[object | None]:
        wire = [key.encode() for key in keys]
        found = self._mc.get_multi(wire)
        return [found.get(key) for key in wire]

    def ttl(self, key: str) -> float | None:
        # libmemcached cannot read an item's expiry. With one server, where the
        # key lives is plain: ask it with a meta command on a socket of our own.
        servers = self.cache.client_servers
        if len(servers) != 1 or servers[0].startswith("/"):
            raise MemcacheError(
                "reading a lock's remaining time through pylibmc needs a single "
                "memcached server (host:port) in LOCATION"
            )
        host, _, port = servers[0].rpartition(":")
        reply = _talk((host, int(port or 11211)), meta.read_ttl(key.encode()), 2.0)
        if not reply.startswith((b"EN", b"HD")):
            raise MemcacheError(f"memcached answered {reply!r} to mg (needs 1.6+)")
        return meta.ttl_of(reply)

    def record_places(self) -> list[object]:
        return [ONE_PLACE]

    def record_place(self, key: str) -> object:
        return ONE_PLACE

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        if not self._mc.set(self.key_for(record_id).encode(), value, ttl):
            raise MemcacheError(f"memcached did not store the record {record_id!r}")

    def read_record(self, key: str, record_id: str) -> object | None:
        found: object | None = self._mc.get(self.key_for(record_id).encode())
        return found

    def delete_record(self, place: object, record_id: str) -> None:
        self._mc.delete(self.key_for(record_id).encode())

    def uptimes(self) -> dict[str, float]:
        # One (server, stats) pair per server; libmemcached raises when one
        # does not answer.
        return {
            _text(name).split(" ")[0]: float(_text(stats["uptime"]))
            for name, stats in self._mc.get_stats()
            if "uptime" in stats
        }

    def peek(self, key: str) -> Peek | None:
        value, cas = self._mc.gets(key.encode())
        if cas is None:
            return None
        return Peek(value, int(cas))

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self._mc.get(fence_key.encode())
        return None if value is None else int(value)
