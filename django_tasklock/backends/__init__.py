"""Which Django cache backends can hold a lock, and the lock backend for an alias."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from django.conf import settings as django_settings
from django.core.cache import InvalidCacheBackendError, caches
from django.core.signals import setting_changed
from django.dispatch import receiver

from ..conf import settings
from ..exceptions import LockConfigurationError
from .base import FenceCounter, Hold, LockBackend, Peek
from .supported import UNSUPPORTED, recommended_paths, supported_for, supported_names

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "IMPLICIT_CACHES",
    "FenceCounter",
    "Hold",
    "LockBackend",
    "Peek",
    "backend_for",
    "backends_generation",
    "caches_implicit",
    "close_thread_connections",
    "per_process_tests",
    "refuse_per_process",
    "thread_connections",
    "unsupported_reason",
]

logger = logging.getLogger(__name__)


def unsupported_reason(
    backend_class: type[Any], options: dict[str, Any] | None = None
) -> str | None:
    """Why a cache backend class (with its OPTIONS) cannot hold locks, or None."""
    entry = supported_for(backend_class)
    if entry is not None:
        return entry.backend.refusal(options or {})
    for base, reason in UNSUPPORTED:
        if issubclass(backend_class, base):
            return f"{reason}. Use {supported_names()}."
    return (
        f"{backend_class.__module__}.{backend_class.__qualname__} has no atomic "
        f"owner-checked operations django_tasklock knows. Use {supported_names()}."
    )


# One backend per alias and thread, over that thread's Django cache object (so its
# connections), forgotten when CACHES changes: looking the cache up and building a
# backend on every lock call would cost more than the lock itself.
_per_thread = threading.local()


_generation = [0]
#: Bumped in a forked child: what a parent's thread cached (its sockets included)
#: is the parent's, even though the forking thread keeps its id in the child.
fork_generation = [0]


def backends_generation() -> int:
    """Moves on when CACHES changes and in a forked child: backends built
    before are the past (``aio`` keys its per-loop backends by it too)."""
    return _generation[0]


def _forget_all() -> None:
    _generation[0] += 1


def _after_fork_in_child() -> None:
    _generation[0] += 1
    fork_generation[0] += 1
    # The forking thread's memo holds the parent's clients. Closing them closes
    # only the child's copies of the descriptors (no shutdown: pymemcache and
    # redis-py leave the parent's connection alone), and a later lock in the
    # child connects afresh.
    close_thread_connections()


@receiver(setting_changed)
def _forget_backends(*, setting: str, **kwargs: Any) -> None:
    if setting == "CACHES":
        # Django's own receiver resets its cache handler, maybe after this one:
        # a thread that built a backend between the two would keep the old
        # CACHES under the new generation. Reset first (it is idempotent).
        from django.test.signals import clear_cache_handlers

        clear_cache_handlers(setting=setting)
        _forget_all()


# A forked child must not talk over its parent's sockets.
os.register_at_fork(after_in_child=_after_fork_in_child)


class _ThreadBackends(dict[str, "LockBackend"]):
    """One thread's lock backends, closed when the thread ends (its local
    storage goes with it): a thread pool's threads (Celery's ``threads`` pool,
    a web server's) leave no socket open behind them.

    Keyed by alias: the backend for the memcached protocol last asked for.
    ``others`` keeps the ones built for another protocol, by (alias, protocol),
    until the thread's connections close: a lock taken on one still releases
    over it, and asking for that protocol again finds it."""

    def __init__(self, generation: int) -> None:
        super().__init__()
        #: ``_generation`` when they were built: CACHES changed or a fork since
        #: makes them the past.
        self.generation = generation
        self.others: dict[tuple[str, str], LockBackend] = {}

    def take_all(self) -> list[LockBackend]:
        """Every backend of the thread, forgotten (the caller closes them)."""
        backends = [*self.values(), *self.others.values()]
        self.clear()
        self.others.clear()
        return backends

    def __del__(self) -> None:
        for backend in self.take_all():
            with contextlib.suppress(Exception):  # a thread's end must not raise
                backend.close()


def close_thread_connections() -> None:
    """Close the connections django_tasklock opened in this thread.

    They outlive Django's ``close_caches()`` on purpose; call this where a thread
    ends for good (tests, custom thread pools). A later lock reconnects.
    """
    memo: _ThreadBackends | None = getattr(_per_thread, "backends", None)
    # Forgotten first: a close that fails must not leave half-closed backends in
    # use, and a thread that never locked has nothing to forget (backend_for
    # starts over from None).
    _per_thread.backends = None
    for backend in memo.take_all() if memo is not None else ():
        backend.close()


def thread_connections() -> int:
    """How many lock backends (each with its connections) this thread has open."""
    memo: _ThreadBackends | None = getattr(_per_thread, "backends", None)
    return 0 if memo is None else len(memo) + len(memo.others)


def backend_for(alias: str, *, protocol: str | None = None) -> LockBackend:
    """The lock backend of the CACHES entry ``alias``, for the calling thread.

    ``protocol`` is memcached's (TASKLOCK["MEMCACHED_PROTOCOL"]; None reads the
    setting). A backend speaks the protocol it was built with: asked for
    another, the thread gets (or builds) its backend for that one.
    """
    if protocol is None:
        protocol = settings.MEMCACHED_PROTOCOL
    memo: _ThreadBackends | None = getattr(_per_thread, "backends", None)
    if memo is None or memo.generation != _generation[0]:
        if memo:
            close_thread_connections()
        memo = _per_thread.backends = _ThreadBackends(_generation[0])
    backend = memo.get(alias)
    if backend is None or backend.protocol != protocol:
        backend = _rebuild(memo, alias, protocol)
    return backend


def _rebuild(memo: _ThreadBackends, alias: str, protocol: str) -> LockBackend:
    """The thread's backend of ``alias`` for ``protocol``, made current; the one
    it replaces is kept aside (not closed: a lock may still be held on it)."""
    old = memo.pop(alias, None)
    if old is not None:
        memo.others[alias, old.protocol] = old
    backend = memo.others.pop((alias, protocol), None) or _lookup(alias, protocol)
    memo[alias] = backend
    return backend


_app_checked = [False]


def _warn_if_not_installed() -> None:
    """Once per process: say so when the app is used without being installed,
    since its system checks then never run."""
    if _app_checked[0]:
        return
    _app_checked[0] = True
    from django.apps import apps

    if apps.ready and not apps.is_installed("django_tasklock"):
        logger.warning(
            "django_tasklock is used but is not in INSTALLED_APPS: its system "
            "checks never run, so a configuration that cannot lock (see the docs, "
            "System checks) is only reported when a lock is taken. Add "
            "'django_tasklock' to INSTALLED_APPS."
        )


#: Why Django's own default cache cannot hold locks (run time and check E015).
IMPLICIT_CACHES = (
    "CACHES is not set, so Django gives every process a LocMemCache of its own: "
    "a lock taken in one worker process is invisible to the others, and "
    "duplicate runs overlap. Set CACHES (its 'default', or the alias "
    f"TASKLOCK['CACHE'] names) to {recommended_paths()}."
)


#: How many test isolations (the ``tasklock`` fixture, ``TaskLockTestMixin``)
#: are running in this process: while any is, a per-process store is allowed.
per_process_tests = [0]


def refuse_per_process(aliases: Iterable[str], where: str) -> None:
    """Raise ``LockConfigurationError`` if one of ``aliases`` is a store each
    process has its own of (a row of the table that is not ``shared``:
    LocMemCache; check W001), where the system checks
    do not run (a worker, a beat, a leadership): ``where`` says which, and what
    it would do. Allowed by ``TASKLOCK['ALLOW_PER_PROCESS']`` and in a test
    isolation."""
    from django.utils.module_loading import import_string

    if settings.ALLOW_PER_PROCESS or per_process_tests[0]:
        return
    configured: dict[str, Any] = django_settings.CACHES
    for alias in sorted(set(aliases)):
        try:
            backend_class = import_string((configured.get(alias) or {})["BACKEND"])
        except (ImportError, KeyError):
            continue  # the lock itself reports an alias that cannot work
        entry = (
            supported_for(backend_class) if isinstance(backend_class, type) else None
        )
        if entry is not None and not entry.shared:
            raise LockConfigurationError(
                f"{where}, but CACHES[{alias!r}], its lock store, is "
                f"{backend_class.__name__}: "
                "each process has its own, so a lock taken in one process is "
                "invisible to the others (check W001). Point TASKLOCK['CACHE'] (or "
                f"the cache= alias) at a shared store, {recommended_paths()}; in "
                "tests that run in one process, set TASKLOCK['ALLOW_PER_PROCESS'] "
                "= True (the tasklock fixture and TaskLockTestMixin allow it)."
            )


def caches_implicit() -> bool:
    """True when the project never set CACHES: Django's per-process default."""
    overridden: bool = django_settings.is_overridden("CACHES")  # type: ignore[misc]
    return not overridden


def _lookup(alias: str, protocol: str) -> LockBackend:
    _warn_if_not_installed()
    try:
        cache = caches[alias]
    except InvalidCacheBackendError as exc:
        raise LockConfigurationError(
            f"TASKLOCK['CACHE'] (or cache=) names {alias!r}, which is not in CACHES "
            f"({exc}). Add that alias to CACHES or name an existing one."
        ) from exc
    entry = supported_for(type(cache))
    if entry is not None:
        caches_setting: dict[str, Any] = django_settings.CACHES
        options = caches_setting[alias].get("OPTIONS") or {}
        reason = entry.backend.refusal(options)
        if reason is not None:
            raise LockConfigurationError(
                f"CACHES[{alias!r}] cannot hold locks: {reason}. (Run 'manage.py "
                "check'.)"
            )
    if entry is not None and not entry.shared and caches_implicit():
        raise LockConfigurationError(IMPLICIT_CACHES)
    if entry is not None:
        return entry.backend(cache, alias, protocol)
    reason = unsupported_reason(type(cache))
    raise LockConfigurationError(
        f"CACHES[{alias!r}] cannot hold locks: {reason} (Run 'manage.py check'.)"
    )
