"""What a memcached lock backend reads without owning a lock: who holds a
key, for how long, and the server a key goes to (the base of the backend)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from pymemcache.exceptions import MemcacheError, MemcacheUnknownCommandError

from ..base import Hold, LockBackend, Peek
from . import meta
from .wire import (
    MemcachedHold,
    Wire,
    _read_stats,
    _server_name,
    _wire_key,
    expiry_on,
    exptime,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["MemcachedReads"]


class MemcachedReads(LockBackend):
    """The reads of ``MemcachedBackend``, which sets what is declared here."""

    wire: Wire
    _hash_client: Any
    _only_client: Any
    #: The hash client's server picker (``foreign.memcached_server_picker``).
    _pick: Any

    def describe(self, key: str) -> str:
        try:
            server = _server_name(self._client(key).server)
        except self.errors:
            server = "(no live server)"
        return f"memcached cache {self.alias!r} at {server}"

    def _client(self, key: str) -> Any:
        """The server Django's own ``cache.add(key)`` talks to."""
        if self._only_client is not None:
            return self._only_client
        client = self._pick(key)
        if client is None:  # HashClient with ignore_exc=True and every server dead
            raise MemcacheError("All memcached servers are marked dead")
        return client

    # Reads go again once over a connection that had dropped (a restarted
    # server), as writes do: a read has no effect to repeat.

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        client = self._client(key)
        value, _cas = self.wire.once_more(client, lambda: client.gets(key))
        return bool(value == token)

    def locked(self, key: str) -> bool:
        client = self._client(key)
        return self.wire.once_more(client, lambda: client.get(key)) is not None

    def _get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """The stored values of the made keys ``keys``: one round trip per
        server, straight to it (HashClient's own get_many would mark a failing
        server dead and send its keys elsewhere), whose failure raises."""
        by_client: dict[Any, list[str]] = {}
        for key in keys:
            by_client.setdefault(self._client(key), []).append(key)
        found: dict[str, Any] = {}
        for client, its_keys in by_client.items():
            found.update(
                self.wire.once_more(client, partial(client.get_many, its_keys))
            )
        return found

    def values_many(self, keys: list[str]) -> list[object | None]:
        found = self._get_many(keys)
        return [found.get(key) for key in keys]

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        made = {self.cache.make_and_validate_key(key): key for key in keys}
        return {made[key]: value for key, value in self._get_many(made).items()}

    # Plain items (the roster) go through this package's own clients too, so
    # that no write of ours waits on a server longer than SOCKET_TIMEOUT.

    def _by_client(self, keys: Iterable[str]) -> dict[Any, list[str]]:
        by_client: dict[Any, list[str]] = {}
        for key in keys:
            made = self.cache.make_and_validate_key(key)
            by_client.setdefault(self._client(made), []).append(made)
        return by_client

    def add(self, key: str, value: str, timeout: int) -> bool:
        made = self.cache.make_and_validate_key(key)
        client = self._client(made)
        ttl = exptime(timeout)
        return bool(
            self.wire.once_more(
                client, lambda: client.add(made, value, expire=ttl, noreply=False)
            )
        )

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        values = {self.cache.make_and_validate_key(k): v for k, v in items.items()}
        ttl = exptime(timeout)
        for client, keys in self._by_client(items).items():
            mine = {key: values[key] for key in keys}
            failed = self.wire.once_more(
                client,
                partial(client.set_many, mine, expire=ttl, noreply=False),
            )
            if failed:
                raise MemcacheError(
                    f"memcached at {_server_name(client.server)} did not store "
                    f"{', '.join(map(str, failed))}"
                )

    def delete_many(self, keys: list[str]) -> None:
        for client, its_keys in self._by_client(keys).items():
            self.wire.once_more(
                client, partial(client.delete_many, its_keys, noreply=False)
            )

    # -- liveness records: on each server, straight to it --------------------------

    def _servers(self) -> list[Any]:
        if self._only_client is not None:
            return [self._only_client]
        return list(self._hash_client.clients.values())

    def _at(self, place: object) -> Any:
        for client in self._servers():
            if client.server == place:
                return client
        raise MemcacheError(f"no memcached server {place!r} in cache {self.alias!r}")

    def record_places(self) -> list[object]:
        return [client.server for client in self._servers()]

    def record_place(self, key: str) -> object:
        return self._client(key).server

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        client, key = self._at(place), self.key_for(record_id)
        if not self.wire.once_more(
            client, lambda: _write_after(client, key, value, ttl)
        ):
            raise MemcacheError(f"memcached at {place!r} did not store {key!r}")

    def read_record(self, key: str, record_id: str) -> object | None:
        client, record_key = self._client(key), self.key_for(record_id)
        found: object | None = self.wire.once_more(
            client, lambda: client.get(record_key)
        )
        return found

    def delete_record(self, place: object, record_id: str) -> None:
        client, key = self._at(place), self.key_for(record_id)
        self.wire.once_more(client, lambda: client.delete(key, noreply=False))

    def uptimes(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for client in self._servers():
            try:
                stats = self.wire.once_more(client, partial(_read_stats, client))
            except MemcacheUnknownCommandError:
                continue  # a proxy without stats: it cannot tell
            if b"uptime" in stats:
                found[_server_name(client.server)] = float(stats[b"uptime"])
        return found

    def ttl(self, key: str) -> float | None:
        # Only the meta protocol can read an item's remaining time, so this is
        # tried whatever MEMCACHED_PROTOCOL says.
        client = self._client(key)
        reply = self.wire.command(client, meta.read_ttl(_wire_key(client, key)))
        if reply is None:
            raise MemcacheError(
                "reading a lock's remaining time needs memcached's meta commands "
                "(memcached 1.6+)"
            )
        return meta.ttl_of(reply)

    def peek(self, key: str) -> Peek | None:
        client = self._client(key)
        value, cas = self.wire.once_more(client, lambda: client.gets(key))
        if cas is None:
            return None
        # The CAS id was read on this connection: while it stays the one in
        # use, it proves the item unchanged (see meta.while_ours), so a replace
        # through this hold is one round trip. Classic-protocol servers, maybe
        # behind a proxy, always check the value first.
        sock = getattr(client, "sock", None) if self.wire.meta(client) else None
        return Peek(value, MemcachedHold(int(cas), sock))

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self._client(key).get(fence_key)
        return None if value is None else int(value)


#: How many times a record's write reads and writes again when another write
#: of this process's came between its read and its write.
_RECORD_TRIES = 3


def _write_after(client: Any, key: str, value: str, ttl: int) -> bool:
    """Write a liveness record only over what was there when it was read (CAS),
    or where there was nothing (add): never a plain set. Its end is a time on
    the server's clock counted from the send (``expiry_on``), so an earlier
    write of this process's, held up in the network or in a stalled server
    past its caller's timeout, would otherwise land after a later one and end
    the record sooner than its holder counts; a contender would then find a
    live holder's record gone (the fault checker's soak found four such
    robberies, each as a paused server resumed). Conditional, that write
    finds the item changed (or there) and is refused. True if stored."""
    for _ in range(_RECORD_TRIES):
        _, cas = client.gets(key)
        expire = expiry_on(client.server, ttl)
        if cas is None:
            if client.add(key, value, expire=expire, noreply=False):
                return True
        elif client.cas(key, value, cas, expire=expire, noreply=False):
            return True
    return False
