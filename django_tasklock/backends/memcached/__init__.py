"""Owner-checked locks on memcached, in four layers: ``meta`` (the meta
protocol with no socket: commands, replies, the owner check of a write, shared
with the client for event loops, ``aio``), ``wire`` (meta and classic commands
on pymemcache's sockets, the hot path), ``restarts`` (a restarted server's new
locks wait) and ``backend`` (the lock operations); ``pylibmc`` the classic
commands through libmemcached."""

from __future__ import annotations

from typing import Final

from ..base import Supported
from .backend import MemcachedBackend
from .fencing import _bad_counter
from .meta import MOVES_IN_A_ROW, kept_moving
from .pylibmc import PyLibMCBackend
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
    "SUPPORTED",
    "_PAST",
    "MemcachedBackend",
    "MemcachedHold",
    "NodeRestarted",
    "PyLibMCBackend",
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

#: This package's rows of the supported-caches table.
SUPPORTED: Final = (
    Supported(
        "django.core.cache.backends.memcached.PyMemcacheCache",
        "PyMemcacheCache",
        MemcachedBackend,
        needs="pymemcache",
        notes="meta commands on memcached 1.6+, classic ones on older servers "
        "and twemproxy; restarts detected",
    ),
    Supported(
        "django.core.cache.backends.memcached.PyLibMCCache",
        "PyLibMCCache",
        PyLibMCBackend,
        recommended=False,
        needs="pylibmc (libmemcached)",
        notes="classic commands only",
    ),
)
