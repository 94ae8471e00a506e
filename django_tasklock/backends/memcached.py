"""Owner-checked locks on memcached, through the client of Django's PyMemcacheCache.

With memcached's meta commands (protocol.txt, "Meta Set", "Meta Delete") a lock
cycle is the same two round trips as the cookbook's unsafe ``add`` + ``delete``:

- acquire: ``ms <key> <len> T<ttl> F16 ME c`` stores only if absent (add mode) and
  answers the item's CAS id;
- release: ``md <key> C<cas>`` deletes only while the CAS id still matches;
- extend: ``ms <key> <len> C<cas> T<ttl> F16 c`` rewrites only while it matches.

Any later write to the key (a new holder after expiry, eviction or flush) gives it
a new CAS id, so a stale holder can neither delete nor prolong it. CAS ids are
unique only within one run of the server, though: a restarted memcached counts
from 1 again, and a new holder can get the very CAS id an old holder kept. A
restart always breaks the TCP connections to the server, so the CAS id alone is
trusted only while the connection that took the lock is still the one in use;
otherwise (a reconnect, another thread, a pooled client) release and extend first
read the item with ``gets`` and act only if both the stored token and the CAS id
are still this holder's. Where meta commands are missing (memcached < 1.6) the
same checks use ``add``, ``gets`` and ``cas`` (``cas(..., expire=-1)`` to delete).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import (
    MemcacheError,
    MemcacheUnexpectedCloseError,
    MemcacheUnknownCommandError,
)

from ..keys import memcached_key
from .base import Hold, LockBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.core.cache.backends.memcached import PyMemcacheCache

__all__ = ["MemcachedBackend", "MemcachedHold"]

# pymemcache's serde marks str values with flag 16 (FLAG_TEXT): storing the token
# with it lets cache.get(lock_id) read the owner back as a str.
_TEXT_FLAG = 16
_T = TypeVar("_T")
_POOLED = object()
# What a server that went away since the last command looks like on its socket.
_DROPPED = (MemcacheUnexpectedCloseError, BrokenPipeError, ConnectionResetError)
# Servers that answered ERROR to a meta command; they get the classic commands.
_classic_servers: set[Any] = set()


class MemcachedHold:
    """The CAS id of this holder's item, and the socket that wrote it."""

    __slots__ = ("cas", "sock")

    def __init__(self, cas: int, sock: object) -> None:
        self.cas, self.sock = cas, sock

    def __repr__(self) -> str:
        return f"MemcachedHold(cas={self.cas})"


def _wire_key(client: Any, key: str) -> bytes:
    """The key as the client itself sends it, with its own key_prefix.

    ``key`` comes from ``key_for``, which already made sure memcached can take it
    (length with the prefix, no whitespace or control characters).
    """
    wire: bytes = client.key_prefix + key.encode("utf-8")
    return wire


def _flag(reply: bytes, name: bytes) -> int | None:
    for flag in reply.split()[1:]:
        if flag[:1] == name:
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
        # A client of our own, built exactly as Django builds its one (same
        # servers, options and hashing, so the same server for a key), which
        # close_caches() leaves alone: Celery's Django fixup closes every cache
        # connection after every task, and reconnecting would cost each locked
        # task more than the lock.
        django_cache = cast(Any, cache)
        self._hash_client: Any = django_cache._class(
            django_cache.client_servers, **django_cache._options
        )

    def close(self) -> None:
        self._hash_client.close()

    def _client(self, key: str) -> Any:
        """The server Django's own ``cache.add(key)`` talks to."""
        hash_client = self._hash_client
        if not isinstance(hash_client, HashClient):
            return hash_client
        clients = hash_client.clients
        if len(clients) == 1:
            # One server: nowhere else to go, even while HashClient has marked it
            # dead after errors of other cache calls; talking to it directly means
            # locking resumes the moment it is back.
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

    # -- protocol choice -----------------------------------------------------------

    def _meta(self, client: Any) -> bool:
        if self.protocol == "classic":
            return False
        return self.protocol == "meta" or client.server not in _classic_servers

    def _no_meta(self, client: Any) -> None:
        if self.protocol == "meta":
            raise MemcacheError(
                f"memcached at {client.server} has no meta commands (needs 1.6+); "
                "set TASKLOCK['MEMCACHED_PROTOCOL'] to 'auto' or 'classic'"
            )
        _classic_servers.add(client.server)

    def _command(self, client: Any, command: bytes) -> bytes | None:
        """Send one meta command and read its one-line reply.

        None if the server does not know meta commands. On the client's own socket
        where it has one (pymemcache's raw_command costs more than the lock's own
        work); any error closes the connection, as pymemcache does.
        """
        sock: Any = getattr(client, "sock", _POOLED)
        if sock is _POOLED:  # PooledClient: its sockets are its pool's
            try:
                reply: bytes = client.raw_command(command, b"\r\n")
            except MemcacheUnknownCommandError:
                self._no_meta(client)
                return None
            return reply
        if sock is None:
            client._connect()
            sock = client.sock
        try:
            sock.sendall(command + b"\r\n")
            reply = sock.recv(4096)
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    raise MemcacheUnexpectedCloseError()
                reply += chunk
        except BaseException:
            client.close()
            raise
        if reply.startswith((b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")):
            # Close: an old server also answers the rest of the command (its data
            # line) with ERROR, which must not be read as the next reply.
            client.close()
            if reply.startswith(b"ERROR"):
                self._no_meta(client)
                return None
            raise MemcacheError(reply.strip().decode(errors="replace"))
        return reply[:-2]

    def _hold(self, client: Any, cas: object) -> MemcachedHold:
        cas_id = int(cast(Any, cas))
        if cas_id == 0:
            raise MemcacheError(
                f"memcached at {client.server} runs without CAS ids (-C), so a "
                "lock cannot be owner-checked; restart it without -C"
            )
        # PooledClient hides its sockets: its holds are always verified by value.
        return MemcachedHold(cas_id, getattr(client, "sock", None))

    def _owner_cas(
        self, client: Any, key: str, hold: MemcachedHold, token: str
    ) -> int | None:
        """The CAS id to act on if this holder still owns the lock, else None.

        On the connection that took the lock, the CAS id it learnt is proof
        enough. Elsewhere the stored token decides (tokens are random per
        acquisition, nobody else writes ours), and the CAS id read with it makes
        the following write conditional on nothing having changed since.
        """
        if hold.sock is not None and getattr(client, "sock", None) is hold.sock:
            return hold.cas
        value, cas = client.gets(key)
        return int(cas) if value == token and cas is not None else None

    def _once_more(self, client: Any, operation: Callable[[], _T]) -> _T:
        """Run ``operation``, again once if a connection from before had dropped.

        A restarted (or idle-timed-out) server leaves pymemcache a dead socket
        that fails the next command; pymemcache then reconnects. A fresh
        connection that fails is an outage, and is raised.
        """
        reused = getattr(client, "sock", None) is not None
        try:
            return operation()
        except _DROPPED:
            if not reused:
                raise
            return operation()

    # -- acquire -----------------------------------------------------------------

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        ttl = math.ceil(expire)
        tries = 0

        def attempt() -> MemcachedHold | None:
            nonlocal tries
            tries += 1
            hold = self._acquire(client, key, token, ttl)
            if hold is None and tries > 1:
                # The dropped first try may have stored our token before the
                # connection went: then the lock is ours.
                value, cas = client.gets(key)
                if value == token:
                    return self._hold(client, cas)
            return hold

        return self._once_more(client, attempt)

    def _acquire(
        self, client: Any, key: str, token: str, ttl: int
    ) -> MemcachedHold | None:
        if self._meta(client):
            data = token.encode()
            wire = _wire_key(client, key)
            command = b"ms %s %d T%d F%d ME c\r\n%s" % (
                wire, len(data), ttl, _TEXT_FLAG, data,
            )  # fmt: skip
            reply = self._command(client, command)
            if reply is not None:
                if reply.startswith(b"NS"):
                    return None
                if not reply.startswith(b"HD"):
                    raise MemcacheError(f"unexpected reply to ms: {reply!r}")
                cas = _flag(reply, b"c")
                if not cas:
                    self._command(client, b"md %s" % wire)
                return self._hold(client, cas)
        if not client.add(key, token, expire=ttl, noreply=False):
            return None
        value, cas = client.gets(key)
        # Someone else's value here means our item expired in between: not ours.
        return self._hold(client, cas) if value == token else None

    # -- release -----------------------------------------------------------------

    def release(self, key: str, hold: Hold, token: str) -> bool:
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        return self._once_more(client, lambda: self._release(client, key, hold, token))

    def _release(self, client: Any, key: str, hold: MemcachedHold, token: str) -> bool:
        cas = self._owner_cas(client, key, hold, token)
        if cas is None:
            return False
        if self._meta(client):
            reply = self._command(client, b"md %s C%d" % (_wire_key(client, key), cas))
            if reply is not None:
                if reply.startswith(b"HD"):
                    return True
                if reply.startswith((b"EX", b"NF")):
                    return False
                raise MemcacheError(f"unexpected reply to md: {reply!r}")
        # cas() answers True (STORED), False (EXISTS: another owner's) or None
        # (NOT_FOUND); a negative expiry makes the stored item expire at once.
        return bool(client.cas(key, token, cas, expire=-1, noreply=False))

    # -- extend ------------------------------------------------------------------

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        ttl = math.ceil(expire)
        return self._once_more(
            client, lambda: self._extend(client, key, hold, token, ttl)
        )

    def _extend(
        self, client: Any, key: str, hold: MemcachedHold, token: str, ttl: int
    ) -> MemcachedHold | None:
        cas = self._owner_cas(client, key, hold, token)
        if cas is None:
            return None
        if self._meta(client):
            data = token.encode()
            command = b"ms %s %d C%d T%d F%d c\r\n%s" % (
                _wire_key(client, key), len(data), cas, ttl, _TEXT_FLAG, data,
            )  # fmt: skip
            reply = self._command(client, command)
            if reply is not None:
                if reply.startswith(b"HD"):
                    return self._hold(client, _flag(reply, b"c"))
                if reply.startswith((b"EX", b"NF")):
                    return None
                raise MemcacheError(f"unexpected reply to ms: {reply!r}")
        if not client.cas(key, token, cas, expire=ttl, noreply=False):
            return None
        value, new_cas = client.gets(key)
        return self._hold(client, new_cas) if value == token else None

    # -- inspection ----------------------------------------------------------------

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        value, _cas = self._client(key).gets(key)
        return bool(value == token)

    def locked(self, key: str) -> bool:
        return self._client(key).get(key) is not None

    def ttl(self, key: str) -> float | None:
        # Only the meta protocol can read an item's remaining time, so this is
        # tried whatever MEMCACHED_PROTOCOL says.
        client = self._client(key)
        reply = self._command(client, b"mg %s t" % _wire_key(client, key))
        if reply is None:
            raise MemcacheError(
                "reading a lock's remaining time needs memcached's meta commands "
                "(memcached 1.6+)"
            )
        if not reply.startswith(b"HD"):
            return None
        seconds = _flag(reply, b"t")
        return float("inf") if seconds is None or seconds < 0 else float(seconds)
