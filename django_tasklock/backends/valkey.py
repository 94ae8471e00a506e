"""Owner-checked locks on Valkey through django-valkey: its ``ValkeyCache`` (one
server, or a primary with replicas) and its ``ClusterValkeyCache`` (a Valkey or
Redis Cluster, through valkey-py's cluster client).

The scripts are the Redis backend's: valkey-py is redis-py's fork, and Valkey
runs the same Lua. On a cluster, every key of one lock carries one hash tag
(``cluster_key``), so a script that touches a lock and its fencing counter, or
a read of a semaphore's slots, stays in one hash slot, on one primary.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from typing import TYPE_CHECKING, Any

from ..keys import lock_group
from .failover import Promotions
from .redis import DjangoRedisBackend

if TYPE_CHECKING:
    from .base import Hold

__all__ = ["ValkeyBackend", "ValkeyClusterBackend", "cluster_key"]


class ValkeyBackend(DjangoRedisBackend):
    """Locks on a django-valkey ``ValkeyCache``: its default client's
    ``get_client(write=True)``, the primary, with the client's serializer."""

    kind = "Valkey"
    client_exceptions = "valkey.exceptions"
    client_error = "ValkeyError"

    def __init__(self, cache: Any, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        # The client's default serializer and no compressor (most settings):
        # a token is pickled here directly, the same bytes the client's
        # encode() would make, without its two calls and type tests.
        client = self._cache_client
        plain = (
            type(client._serializer).__name__ == "PickleSerializer"
            and type(client._compressor).__name__ == "IdentityCompressor"
        )
        self._pickled = client._serializer._pickle_version if plain else None

    def _encode(self, token: str) -> bytes:
        if self._pickled is not None:
            return pickle.dumps(token, self._pickled)
        return super()._encode(token)


def cluster_key(make_key: Any, lock_id: str) -> str:
    """The key of ``lock_id`` on a cluster: Django's key for the id behind a hash
    tag made from its lock's group (``keys.lock_group``), so the lock, its
    fencing counter, a semaphore's slots, a call's run lock and its queued mark
    hash to one slot. The tag is hex, so no brace in an id can end it early."""
    group = lock_group(lock_id)
    tag = hashlib.md5(group.encode(), usedforsecurity=False).hexdigest()[:16]
    key: str = make_key("{" + tag + "}" + lock_id)
    return key


class ValkeyClusterBackend(ValkeyBackend):
    """Locks on a django-valkey ``ClusterValkeyCache``.

    Every command goes to the primary that serves its key's slot now
    (valkey-py's cluster client follows ``MOVED`` and ``ASK``; it never reads
    from a replica unless ``read_from_replicas`` is set, which the system
    checks refuse). Liveness records are not kept on a cluster yet: a record
    must live on the primary of every lock it vouches for, and slots move
    between primaries; so tokens promise none, and a crashed holder's lock
    lasts until it expires (``LOCK_EXPIRE``), as on a store without records.
    """

    kind = "Valkey cluster"

    def __init__(self, cache: Any, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        self.promotions = Promotions(self.errors)
        #: key -> its hash slot, remembered (the CRC is computed in Python).
        self._slots: dict[str, int] = {}

    def key_for(self, lock_id: str) -> str:
        return cluster_key(self.cache.make_key, lock_id)

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        hold = super().acquire(key, token, expire)
        if hold is not None:
            self._keep_unless_promoted(key, token)
        return hold

    def take_over(
        self, key: str, expected: str, token: str, expire: float
    ) -> Hold | None:
        hold = super().take_over(key, expected, token, expire)
        if hold is not None:
            self._keep_unless_promoted(key, token)
        return hold

    def _keep_unless_promoted(self, key: str, token: str) -> None:
        """Give back a lock just taken on a primary that took over within the
        grace (``failover``), and raise; also when its run cannot be read."""
        client = self._redis(key)
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= 10_000:
                self._slots.clear()
            slot = self._slots[key] = client.keyslot(key)
        try:
            why = self.promotions.refusal(client, slot)
        except self.errors as exc:
            why = f"whether its primary took over lately could not be read ({exc})"
        if why is None:
            return
        with contextlib.suppress(*self.errors):  # else it expires, held by nobody
            self.discard(key, token)
        raise self.errors[0](why)

    def _server(self) -> str:
        return "cluster " + str(self._cache_client._server[0])

    def record_places(self) -> list[object]:
        return []

    def uptimes(self) -> dict[str, float]:
        # Every primary's: a restarted one may have come back empty.
        client = self._redis("")
        info = client.info("server", target_nodes=client.PRIMARIES)
        return {
            str(node): float(fields["uptime_in_seconds"])
            for node, fields in info.items()
        }

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key in keys:  # each its own slot: no multi-key read across slots
            made = self.key_for(key)
            raw = self._redis(made).get(made)
            if raw is not None:
                found[key] = self._decode(raw)
        return found

    def close(self) -> None:
        primary, self._primary = self._primary, None
        if primary is not None:
            primary.disconnect_connection_pools()
