"""Every part of another package's that this package reads and that package
does not publish: each one here, by name, and nowhere else.

A lock must reach its store the way the cache's own client does (the same
servers, options, hashing and serializer), and some of that is kept by Django,
pymemcache, redis-py and django-valkey under a leading underscore. Each is read
through a function below, which raises ``LockConfigurationError`` naming the
package, the part and the installed version when a release no longer has it:
a clear refusal when the lock is first used, never an ``AttributeError`` deep
in a lock. ``tests/project/test_foreign.py`` reads every one on the versions installed
(the newest, in ``make test``) and on the oldest this package supports (the
``oldest`` nox session).

Where a hot path needs a part (the memcached server picker, the Redis
serializer), it is read once, when the backend is built, and what it gives (a
bound method, an object) is kept there; ``stream_writer`` is read on each
write of the client for loops (an attribute read behind one call), the
others where a connection opens or an item's deadline is asked.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable

from .exceptions import LockConfigurationError

__all__ = [
    "CELERY_STATE",
    "celery_original_run",
    "celery_task_stack",
    "django_cache_client",
    "locmem_deadline",
    "memcached_client_of",
    "memcached_connect",
    "memcached_server_picker",
    "redis_serializer",
    "stream_writer",
    "valkey_pickle_version",
]


def _changed(
    distribution: str, part: str, problem: Exception
) -> LockConfigurationError:
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        version = "(version unknown)"
    return LockConfigurationError(
        f"django_tasklock reads {part} of {distribution}, which {distribution} "
        f"{version} does not have ({type(problem).__name__}: {problem}). Install "
        f"a release of {distribution} that django_tasklock supports (the extras "
        "in its setup.cfg say which), and report this version at the project's "
        "issue tracker."
    )


def _read(target: Any, name: str, distribution: str, part: str) -> Any:
    try:
        return getattr(target, name)
    except AttributeError as exc:
        raise _changed(distribution, part, exc) from exc


# -- Django ----------------------------------------------------------------------


def django_cache_client(cache: Any) -> Any:
    """Django's ``RedisCache``'s client object (``RedisCacheClient``: its
    connection pools and serializer), ``cache._cache``."""
    return _read(cache, "_cache", "Django", "RedisCache._cache")


def memcached_client_of(cache: Any) -> tuple[type, dict[str, Any]]:
    """The client class Django's memcached cache builds its client from and
    the options it passes it (its defaults merged with the alias's OPTIONS):
    ``cache._class`` and ``cache._options``."""
    made = _read(cache, "_class", "Django", "BaseMemcachedCache._class")
    options = _read(cache, "_options", "Django", "BaseMemcachedCache._options")
    return made, dict(options)


def locmem_deadline(cache: Any, key: str) -> float | None:
    """The wall-clock time a ``LocMemCache`` item at ``key`` (a made key)
    expires at (None: never, or not there), from ``cache._expire_info``."""
    deadlines = _read(cache, "_expire_info", "Django", "LocMemCache._expire_info")
    deadline: float | None = deadlines.get(key)
    return deadline


def redis_serializer(client: Any) -> Any:
    """The serializer (``dumps``, ``loads``) of Django's ``RedisCacheClient``
    or of django-valkey's client, ``client._serializer``."""
    return _read(client, "_serializer", "Django", "RedisCacheClient._serializer")


# -- pymemcache ------------------------------------------------------------------


def memcached_server_picker(hash_client: Any) -> Any:
    """pymemcache's ``HashClient._get_client``: the client of the server a key
    goes to (None when every server is marked dead), as the cache's own
    ``add`` picks it."""
    return _read(hash_client, "_get_client", "pymemcache", "HashClient._get_client")


def memcached_connect(client: Any) -> None:
    """Open a pymemcache ``Client``'s connection (``client._connect()``): it
    then has a ``sock`` to write to."""
    _read(client, "_connect", "pymemcache", "Client._connect")()


# -- redis-py --------------------------------------------------------------------


def stream_writer(conn: Any) -> Any:
    """The asyncio stream writer of a redis-py (or valkey-py) asyncio
    ``Connection``, ``conn._writer`` (None once closed): written to directly,
    since ``send_packed_command`` drops the whole connection when its caller is
    cancelled mid-write."""
    try:
        return conn._writer
    except AttributeError as exc:
        raise _changed("redis", "Connection._writer (redis.asyncio)", exc) from exc


# -- django-valkey ---------------------------------------------------------------


def valkey_pickle_version(client: Any) -> int | None:
    """The pickle protocol django-valkey's client pickles values with, when
    its serializer is the default pickle one and no compressor is set (then a
    token is pickled here directly, the very bytes the client would write);
    None for any other serializer or compressor."""
    serializer = _read(client, "_serializer", "django-valkey", "client._serializer")
    compressor = _read(client, "_compressor", "django-valkey", "client._compressor")
    if (
        type(serializer).__name__ != "PickleSerializer"
        or type(compressor).__name__ != "IdentityCompressor"
    ):
        return None
    version: int = _read(
        serializer,
        "_pickle_version",
        "django-valkey",
        "PickleSerializer._pickle_version",
    )
    return version


# -- Celery ------------------------------------------------------------------------

#: Celery's module of the current app and task (``get_current_task``), looked
#: up in ``sys.modules`` (Celery stays unimported until a task runs).
CELERY_STATE: Final = "celery._state"


def celery_task_stack(state: Any) -> tuple[dict[Any, Any], Callable[[], Any]] | None:
    """The storage of Celery's thread-local task stack (``celery._state``'s
    ``_task_stack._local.__storage__``, which has an entry for a thread only
    while a task runs in it) and its thread-ident function; None for a stack
    of any other make, which is then asked as Celery publishes it
    (``get_current_task()``). Read once: both are made with the stack."""
    local = getattr(getattr(state, "_task_stack", None), "_local", None)
    storage = getattr(local, "__storage__", None)
    ident = getattr(local, "__ident_func__", None)
    if type(storage) is not dict or not callable(ident):
        return None
    return storage, ident


def celery_original_run(task: Any) -> Any:
    """A Celery task's own ``run`` where ``autoretry_for`` replaced it with a
    plain function over it (Celery keeps it as ``task._orig_run``); None for
    any other task, or any other object."""
    return getattr(task, "_orig_run", None)
