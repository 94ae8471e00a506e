"""Owner-checked locks on memcached, in four layers: ``meta`` (the meta
protocol with no socket: commands, replies, the owner check of a write, shared
with the async client), ``wire`` (meta and classic commands on pymemcache's
sockets, the hot path), ``restarts`` (a restarted server's new locks wait) and
``backend`` (the lock operations)."""

from __future__ import annotations

from .backend import MemcachedBackend
from .fencing import _bad_counter
from .meta import MOVES_IN_A_ROW, kept_moving
from .restarts import NodeRestarted, _refused, _runs, _unlearnable
from .wire import (
    _PAST,
    MemcachedHold,
    ServerRefused,
    _classic_servers,
    _talk,
    exptime,
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
    "_unlearnable",
    "exptime",
    "kept_moving",
    "meta_support",
    "sure_life",
]
