"""Redis and Valkey clients of this package's own, with timeouts of its own.

A lock's safety duties (take, renew, release, a liveness record's renewal)
must never wait longer than ``TASKLOCK['SOCKET_TIMEOUT']`` on a server: a
stalled server then holds up only what is on it, and a read of it that times
out tells nothing (new locks there are refused). Django's and django-redis's
clients wait for as long as the alias's OPTIONS say, by default for ever. So
the backends do not use the cache's client: they use one made here over the
same servers, with the same connection options (credentials, TLS, database,
protocol, retries), whose connect and reply timeouts are the alias's where
shorter, and ``SOCKET_TIMEOUT`` otherwise.

Made from the public parts of redis-py's (or valkey-py's, its fork) client:
a connection pool's ``connection_class`` and ``connection_kwargs``; a Sentinel
pool's service and Sentinels; a cluster client's startup nodes and options.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ...conf import settings

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["close_own", "own_client", "own_timeouts"]

_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


def own_timeouts(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (a connection's keyword arguments) with its connect and
    reply timeouts never longer than SOCKET_TIMEOUT (nor unset)."""
    ours = settings.SOCKET_TIMEOUT
    made = dict(options)
    for name in _TIMEOUTS:
        theirs = made.get(name)
        made[name] = ours if not theirs else min(theirs, ours)
    return made


def own_client(client: Any, on_connect: Callable[[Any], object] | None = None) -> Any:
    """A client of this package's own that reaches what ``client`` (a
    ``redis.Redis``, ``valkey.Valkey`` or ``valkey.cluster.ValkeyCluster``
    a cache handed out) reaches, with ``own_timeouts``. Its connections are
    its own: closing it leaves the cache's alone. On a cluster, ``on_connect``
    is called with every connection it makes to a node, as it is made (a
    node restarted in place is reconnected to)."""
    package = importlib.import_module(type(client).__module__.split(".", 1)[0])
    if hasattr(client, "nodes_manager"):
        return _own_cluster(package, client, on_connect)
    pool = client.connection_pool
    sentinel = importlib.import_module(f"{package.__name__}.sentinel")
    if isinstance(pool, sentinel.SentinelConnectionPool):
        made = _own_sentinel_pool(sentinel, pool)
    else:
        made = type(pool)(
            connection_class=pool.connection_class,
            max_connections=pool.max_connections,
            **own_timeouts(pool.connection_kwargs),
        )
    return type(client)(connection_pool=made)


def _own_sentinel_pool(sentinel: Any, pool: Any) -> Any:
    """A pool that asks Sentinels of its own (the same addresses, with our
    timeouts) for the primary of ``pool``'s service, and connects to it
    with our timeouts."""
    manager = pool.sentinel_manager
    addresses = [
        (kwargs["host"], kwargs["port"])
        for kwargs in (s.connection_pool.connection_kwargs for s in manager.sentinels)
    ]
    first = manager.sentinels[0].connection_pool.connection_kwargs if addresses else {}
    asked = {
        name: first[name]
        for name in ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile")
        if name in first
    }
    own_manager = sentinel.Sentinel(
        addresses,
        min_other_sentinels=manager.min_other_sentinels,
        sentinel_kwargs=own_timeouts(asked),
    )
    options = {
        name: value
        for name, value in pool.connection_kwargs.items()
        if name != "connection_pool"
    }
    return sentinel.SentinelConnectionPool(
        pool.service_name,
        own_manager,
        is_master=pool.is_master,
        check_connection=pool.check_connection,
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **own_timeouts(options),
    )


def _own_cluster(
    package: Any, client: Any, on_connect: Callable[[Any], object] | None
) -> Any:
    """A cluster client of our own over ``client``'s startup nodes, with its
    options and its nodes' connection options, and our timeouts; the user's
    connect hook kept, after ``on_connect``."""
    cluster = importlib.import_module(f"{package.__name__}.cluster")
    manager = client.nodes_manager
    nodes = [
        cluster.ClusterNode(node.host, node.port)
        for node in manager.startup_nodes.values()
    ]
    # (The cluster client's own connect hook is in its nodes' options: the
    # new client puts in its own, which calls the one given it.)
    hooks = ("valkey_connect_func", "redis_connect_func")
    options = {
        name: value
        for name, value in manager.connection_kwargs.items()
        if name not in ("host", "port", *hooks)
    }
    user = getattr(client, "user_on_connect_func", None)
    if on_connect is not None or user is not None:

        def connected(connection: Any) -> None:
            if on_connect is not None:
                on_connect(connection)
            if user is not None:
                user(connection)

        options[f"{package.__name__}_connect_func"] = connected
    kept = {
        name: getattr(client, name)
        for name in (
            "cluster_error_retry_attempts",
            "retry",
            "read_from_replicas",
            "reinitialize_steps",
        )
        if getattr(client, name, None) is not None
    }
    return type(client)(
        startup_nodes=nodes,
        address_remap=manager.address_remap,
        **kept,
        **own_timeouts(options),
    )


def close_own(client: Any) -> None:
    """Close every connection of ``client`` (one ``own_client`` made), its
    own Sentinels' too."""
    if hasattr(client, "nodes_manager"):
        client.close()
        return
    pool = client.connection_pool
    pool.disconnect()
    manager = getattr(pool, "sentinel_manager", None)
    for asked in getattr(manager, "sentinels", ()):
        asked.connection_pool.disconnect()
