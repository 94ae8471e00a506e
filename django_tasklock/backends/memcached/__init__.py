"""Owner-checked locks on memcached, in three layers: ``wire`` (meta and
classic commands, the hot path, replies read by length), ``restarts`` (a
restarted server's new locks wait) and ``backend`` (the lock operations)."""

from __future__ import annotations

from .backend import MemcachedBackend
from .fencing import _bad_counter
from .restarts import NodeRestarted, _refused, _runs, _unlearnable
from .wire import (
    _PAST,
    MOVES_IN_A_ROW,
    MemcachedHold,
    ServerRefused,
    _classic_servers,
    _talk,
    _ttl_of,
    exptime,
    kept_moving,
    meta_support,
    sure_life,
)

__all__ = [
    "MOVES_IN_A_ROW",
    "_PAST",
    "MemcachedBackend",
    "MemcachedHold",
    "NodeRestarted",
    "ServerRefused",
    "_bad_counter",
    "_classic_servers",
    "_refused",
    "_runs",
    "_talk",
    "_ttl_of",
    "_unlearnable",
    "exptime",
    "kept_moving",
    "meta_support",
    "sure_life",
]
