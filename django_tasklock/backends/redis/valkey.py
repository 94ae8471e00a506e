"""Owner-checked locks on Valkey through django-valkey's ``ValkeyCache`` (one
server, or a primary with replicas).

The scripts are the Redis backend's: valkey-py is redis-py's fork, and Valkey
runs the same Lua. The cluster cache's backend is in ``cluster.py``.
"""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

from ...foreign import valkey_pickle_version
from .backend import DjangoRedisBackend

__all__ = ["ValkeyBackend"]


class ValkeyBackend(DjangoRedisBackend):
    """Locks on a django-valkey ``ValkeyCache``: its default client's
    ``get_client(write=True)``, the primary, with the client's serializer."""

    kind = "Valkey"
    async_client = None  # (valkey-py's asyncio client: not yet)
    client_exceptions = "valkey.exceptions"
    client_error = "ValkeyError"
    clients: ClassVar[tuple[str, ...]] = (
        "django_valkey.client.DefaultClient",
        "django_valkey.client.default.DefaultClient",
        "django_valkey.client.SentinelClient",
        "django_valkey.client.sentinel.SentinelClient",
    )
    other_client = (
        "django-valkey with CLIENT_CLASS {client!r}: only its DefaultClient (one "
        "server, or a primary with replicas) and SentinelClient keep a lock and "
        "its fencing counter on one primary (its sharded client spreads them "
        "over servers; its herd client rewrites stored values). Give locks an "
        "alias with one of those two"
    )

    def __init__(self, cache: Any, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        # The client's default serializer and no compressor (most settings):
        # a token is pickled here directly, the same bytes the client's
        # encode() would make, without its two calls and type tests.
        self._pickled = valkey_pickle_version(self._cache_client)

    def _encode(self, token: str) -> bytes:
        if self._pickled is not None:
            return pickle.dumps(token, self._pickled)
        return super()._encode(token)
