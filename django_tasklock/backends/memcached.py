"""Owner-checked locks on memcached, through the client of Django's PyMemcacheCache.

Each operation is one round trip with memcached's meta commands (protocol.txt,
"Meta Set", "Meta Delete", "Meta Get"):

- acquire: ``ms <key> <len> T<ttl> F16 ME c`` stores only if absent (add mode) and
  answers the item's CAS id, which becomes the hold;
- release: ``md <key> C<cas>`` deletes only while the CAS id still matches;
- extend: ``ms <key> <len> C<cas> T<ttl> c`` rewrites only while it matches.

Any other write to the key (a new holder after expiry, eviction, flush or restart)
gives it a new CAS id, so a stale holder can neither delete nor prolong it. Where
meta commands are missing (memcached < 1.6) the same checks use ``gets`` and
``cas``, releasing with ``cas(..., expire=-1)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

from pymemcache.client.base import check_key_helper
from pymemcache.client.hash import HashClient
from pymemcache.exceptions import MemcacheError, MemcacheUnknownCommandError

from ..keys import memcached_key
from .base import Hold, LockBackend

if TYPE_CHECKING:
    from django.core.cache.backends.memcached import PyMemcacheCache

__all__ = ["MemcachedBackend"]

# pymemcache's serde marks str values with flag 16 (FLAG_TEXT): storing the token
# with it lets cache.get(lock_id) read the owner back as a str.
_TEXT_FLAG = 16
# Servers that answered ERROR to a meta command; they get the classic commands.
_classic_servers: set[str] = set()


def _wire_key(client: Any, key: str) -> bytes:
    """The key as the client itself sends it: its own key_prefix, checked."""
    wire: bytes = check_key_helper(key, client.allow_unicode_keys, client.key_prefix)
    return wire


def _cas_of(reply: bytes) -> int | None:
    for flag in reply.split()[1:]:
        if flag[:1] == b"c":
            return int(flag[1:])
    return None


def _ttl_of(reply: bytes) -> int | None:
    for flag in reply.split()[1:]:
        if flag[:1] == b"t":
            return int(flag[1:])
    return None


class MemcachedBackend(LockBackend):
    """Locks on the memcached servers of a PyMemcacheCache alias."""

    kind = "memcached"
    errors = (OSError, MemcacheError)
    cache: PyMemcacheCache

    def __init__(
        self, cache: PyMemcacheCache, alias: str, protocol: str = "auto"
    ) -> None:
        super().__init__(cache, alias)
        self.protocol = protocol
        self._hash_client: Any = cast(Any, cache)._cache

    def _client(self, key: str) -> Any:
        """The server Django's own ``cache.add(key)`` talks to."""
        hash_client = self._hash_client
        if not isinstance(hash_client, HashClient):
            return hash_client
        clients = hash_client.clients
        if len(clients) == 1 and not hash_client._dead_clients:
            return next(iter(clients.values()))
        client = hash_client._get_client(key)
        if client is None:  # HashClient with ignore_exc=True and every server dead
            raise MemcacheError("All memcached servers are marked dead")
        return client

    def describe(self, key: str) -> str:
        try:
            server = self._client(key).server
        except self.errors:
            server = "(no live server)"
        if isinstance(server, tuple):
            server = "{}:{}".format(*server)
        return f"memcached cache {self.alias!r} at {server}"

    def key_for(self, lock_id: str) -> str:
        reserved = len(getattr(self._hash_client, "key_prefix", b"") or b"")
        return memcached_key(self.cache, lock_id, reserved=reserved)

    def _meta(self, client: Any) -> bool:
        if self.protocol == "classic":
            return False
        return self.protocol == "meta" or str(client.server) not in _classic_servers

    def _no_meta(self, client: Any) -> None:
        if self.protocol == "meta":
            raise MemcacheError(
                f"memcached at {client.server} has no meta commands (needs 1.6+); "
                "set TASKLOCK['MEMCACHED_PROTOCOL'] to 'auto' or 'classic'"
            )
        _classic_servers.add(str(client.server))

    def _raw(self, client: Any, command: bytes) -> bytes:
        reply: bytes = client.raw_command(command, b"\r\n")
        return reply

    # -- acquire -----------------------------------------------------------------

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        if self._meta(client):
            data = token.encode()
            command = b"ms %s %d T%d F%d ME c\r\n%s" % (
                _wire_key(client, key),
                len(data),
                math.ceil(expire),
                _TEXT_FLAG,
                data,
            )
            try:
                reply = self._raw(client, command)
            except MemcacheUnknownCommandError:
                self._no_meta(client)
            else:
                if reply.startswith(b"HD"):
                    return _cas_of(reply)
                if reply.startswith(b"NS"):
                    return None
                raise MemcacheError(f"unexpected reply to ms: {reply!r}")
        if not client.add(key, token, expire=math.ceil(expire), noreply=False):
            return None
        value, cas = client.gets(key)
        # Someone else's value here means our item expired in between: not ours.
        return int(cas) if value == token else None

    # -- release -----------------------------------------------------------------

    def release(self, key: str, hold: Hold, token: str) -> bool:
        client = self._client(key)
        if self._meta(client):
            try:
                reply = self._raw(
                    client, b"md %s C%d" % (_wire_key(client, key), cast(int, hold))
                )
            except MemcacheUnknownCommandError:
                self._no_meta(client)
            else:
                if reply.startswith(b"HD"):
                    return True
                if reply.startswith((b"EX", b"NF")):
                    return False
                raise MemcacheError(f"unexpected reply to md: {reply!r}")
        # cas() answers True (STORED), False (EXISTS: another owner's) or None
        # (NOT_FOUND); a negative expiry makes the stored item expire at once.
        return bool(client.cas(key, token, hold, expire=-1, noreply=False))

    # -- extend ------------------------------------------------------------------

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        if self._meta(client):
            data = token.encode()
            command = b"ms %s %d C%d T%d F%d c\r\n%s" % (
                _wire_key(client, key),
                len(data),
                cast(int, hold),
                math.ceil(expire),
                _TEXT_FLAG,
                data,
            )
            try:
                reply = self._raw(client, command)
            except MemcacheUnknownCommandError:
                self._no_meta(client)
            else:
                if reply.startswith(b"HD"):
                    return _cas_of(reply)
                if reply.startswith((b"EX", b"NF")):
                    return None
                raise MemcacheError(f"unexpected reply to ms: {reply!r}")
        if not client.cas(key, token, hold, expire=math.ceil(expire), noreply=False):
            return None
        value, cas = client.gets(key)
        return int(cas) if value == token else None

    # -- inspection ----------------------------------------------------------------

    def owned(self, key: str, hold: Hold) -> bool:
        client = self._client(key)
        if self._meta(client):
            try:
                reply = self._raw(client, b"mg %s c" % _wire_key(client, key))
            except MemcacheUnknownCommandError:
                self._no_meta(client)
            else:
                return reply.startswith(b"HD") and _cas_of(reply) == hold
        _value, cas = client.gets(key)
        return cas is not None and int(cas) == hold

    def locked(self, key: str) -> bool:
        client = self._client(key)
        return client.get(key) is not None

    def ttl(self, key: str) -> float | None:
        # Only the meta protocol can read an item's remaining time, so this is
        # tried whatever MEMCACHED_PROTOCOL says.
        client = self._client(key)
        try:
            reply = self._raw(client, b"mg %s t" % _wire_key(client, key))
        except MemcacheUnknownCommandError:
            raise MemcacheError(
                "reading a lock's remaining time needs memcached's meta commands "
                "(memcached 1.6+)"
            ) from None
        if not reply.startswith(b"HD"):
            return None
        seconds = _ttl_of(reply)
        return float("inf") if seconds is None or seconds < 0 else float(seconds)
