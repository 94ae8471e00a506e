"""Owner-checked locks on Redis and Valkey: one server or a primary with
replicas (Django's ``RedisCache``, django-redis, django-valkey, Sentinel
included), and a Redis or Valkey Cluster. ``backend`` holds the Lua scripts
and the lock operations; ``valkey`` and ``cluster`` the other clients' and
the cluster's keys, records and failovers (``failover``); ``sockets`` our own
clients over the cache's servers, with timeouts of ours; ``aio`` and ``resp``
the client for event loops."""

from __future__ import annotations

from typing import Final

from ..base import Supported
from .backend import DjangoRedisBackend, RedisBackend
from .cluster import ValkeyClusterBackend
from .valkey import ValkeyBackend

__all__ = [
    "SUPPORTED",
    "DjangoRedisBackend",
    "RedisBackend",
    "ValkeyBackend",
    "ValkeyClusterBackend",
]

#: This package's rows of the supported-caches table.
SUPPORTED: Final = (
    Supported(
        "django.core.cache.backends.redis.RedisCache",
        "RedisCache",
        RedisBackend,
        needs="redis",
        notes="one primary (its replicas read only)",
    ),
    Supported(
        "django_redis.cache.RedisCache",
        "django-redis's RedisCache",
        DjangoRedisBackend,
        needs="django-redis",
        notes="its DefaultClient or SentinelClient",
    ),
    Supported(
        "django_valkey.cluster_cache.cache.ClusterValkeyCache",
        "django-valkey's ClusterValkeyCache",
        ValkeyClusterBackend,
        needs="django-valkey",
        notes="a Valkey or Redis Cluster: each lock's keys in one hash slot; "
        "no liveness records yet (a crashed holder's lock lasts LOCK_EXPIRE)",
    ),
    Supported(
        "django_valkey.cache.ValkeyCache",
        "django-valkey's ValkeyCache",
        ValkeyBackend,
        needs="django-valkey",
        notes="its default client: one primary (its replicas read only)",
    ),
)
