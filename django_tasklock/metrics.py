"""Prometheus metrics from the lock signals: ``TASKLOCK["METRICS"] =
"prometheus"`` (the ``[prometheus]`` extra) connects them when the app is
ready.

Counters (``_total``) and histograms, labelled by task name and cache alias,
never by lock id (one series per argument digest would explode Prometheus):

- ``tasklock_acquisitions_total{task, cache}``
- ``tasklock_contentions_total{task, cache, policy}``: acquires refused,
  by the contention policy of the call (``none`` for a plain ``Lock``)
- ``tasklock_duplicates_total{task, cache, action}``: calls stopped at
  ``.delay()``: ``joined`` or ``replaced`` (deduplicated), ``raised`` (refused)
- ``tasklock_locks_lost_total{task, cache, during}``
- ``tasklock_store_errors_total{task, cache}``
- ``tasklock_rate_limited_total{task}``: admissions refused by a rate limit
- ``tasklock_wait_seconds{task, cache}``: how long acquires that took their
  lock waited
- ``tasklock_hold_seconds{task, cache}``: how long locks were held

Under Celery's prefork pool, set ``PROMETHEUS_MULTIPROC_DIR`` (an empty
directory) in the worker's environment before it starts: prometheus_client
then writes each process's values there, and ``metrics_view`` (or any
``MultiProcessCollector``) sums them (see the docs, Metrics).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Final

from .conf import settings
from .signals import (
    call_deduplicated,
    lock_acquired,
    lock_contended,
    lock_lost,
    lock_released,
    lock_store_failed,
    rate_limit_refused,
)

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse
    from prometheus_client import CollectorRegistry

__all__ = ["LockMetrics", "install", "limit_label", "metrics_view", "task_label"]

#: Seconds: a lock wait is short, a hold may be long.
WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
HOLD_BUCKETS: Final = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600)
_SUFFIXES: Final = ("-lock-", "-slot-", "-run-")


#: The ``task`` label of a lock no task took (a bare ``Lock`` or
#: ``memcache_lock``), of a bare ``Semaphore``'s slot, and of a rate limit that
#: no ``@rate_limited`` and no ``RATE_LIMITS`` entry declares: one series
#: each, whatever their ids, which an application may make per object.
UNNAMED_LOCK: Final = "(lock)"
UNNAMED_SEMAPHORE: Final = "(semaphore)"
UNNAMED_LIMIT: Final = "(limit)"


def task_label(lock: Any, lock_id: str) -> str:
    """The ``task`` label of a lock: the task (or function) that took it, or
    the task named in a lock id made as the recipe makes them
    (``<task>-lock-<digest>``); else a fixed label, never the lock id."""
    about = getattr(lock, "about", None)
    if about is not None:
        return str(about[0] if isinstance(about, tuple) else about.name)
    if getattr(lock, "slot_of", None) is not None:
        return UNNAMED_SEMAPHORE
    for suffix in _SUFFIXES:
        named, found, _ = lock_id.partition(suffix)
        if found and named:
            return named
    return UNNAMED_LOCK


def limit_label(limit_id: str) -> str:
    """The ``task`` label of a rate limit: its declared name (a keyed
    limit's ``<name>-<digest>`` counts under ``<name>``), else a fixed one."""
    from .limits.decorator import declared_limit

    if limit_id in settings.rate_limit_names():
        return limit_id
    limits = declared_limit(limit_id)
    return UNNAMED_LIMIT if limits is None else limits.base


def _cache(lock: Any) -> str:
    return str(
        getattr(lock, "_alias", None) or getattr(lock, "_cache", None) or settings.CACHE
    )


def _policy(lock: Any, task: str) -> str:
    """The contention policy of the call that was refused ``lock``: its
    decorator's (found by the task's name among Celery's registered tasks),
    else ``TASKLOCK["ON_CONTENTION"]``; ``none`` for a lock no decorator took."""
    about = getattr(lock, "about", None)
    options = getattr(about, "options", None)
    if options is None:
        if task not in _declared:
            _declared[task] = _declared_policy(task)
        # (_NO_DECORATOR is a label itself; None: the setting's policy)
        return str(_declared[task] or settings.ON_CONTENTION)
    return str(options.on_contention or settings.ON_CONTENTION)


_NO_DECORATOR: Final = "none"
#: A task name's declared ``on_contention`` (None: the setting's), or
#: ``_NO_DECORATOR``; looked up once per name.
_declared: dict[str, str | None] = {}


def _declared_policy(task: str) -> str | None:
    try:
        from celery import current_app
    except ImportError:  # Celery is optional
        return _NO_DECORATOR
    from .targets import spec_of

    found = current_app.tasks.get(task)
    spec = None if found is None else spec_of(found, any_mode=True)
    if spec is None:
        return _NO_DECORATOR
    policy: str | None = spec.options.on_contention
    return policy


class LockMetrics:
    """The counters and histograms, and the signal receivers that fill them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        where = REGISTRY if registry is None else registry
        #: The registry the metrics are in.
        self.registry = where
        both = ["task", "cache"]
        self.acquisitions = Counter(
            "tasklock_acquisitions", "Locks taken.", both, registry=where
        )
        self.contentions = Counter(
            "tasklock_contentions",
            "Acquires refused because another holder had the lock.",
            [*both, "policy"],
            registry=where,
        )
        self.duplicates = Counter(
            "tasklock_duplicates",
            "Calls stopped at .delay(): joined or replaced (deduplicated), raised "
            "(refused).",
            [*both, "action"],
            registry=where,
        )
        self.lost = Counter(
            "tasklock_locks_lost",
            "Locks found lost.",
            [*both, "during"],
            registry=where,
        )
        self.store_errors = Counter(
            "tasklock_store_errors", "Store calls that failed.", both, registry=where
        )
        self.rate_limited = Counter(
            "tasklock_rate_limited",
            "Admissions refused by a rate limit.",
            ["task"],
            registry=where,
        )
        wait = "Seconds an acquire that took its lock waited."
        self.wait = Histogram(
            "tasklock_wait_seconds", wait, both, buckets=WAIT_BUCKETS, registry=where
        )
        hold = "Seconds a lock was held."
        self.hold = Histogram(
            "tasklock_hold_seconds", hold, both, buckets=HOLD_BUCKETS, registry=where
        )

    # -- receivers -------------------------------------------------------------

    def on_acquired(
        self, sender: Any, *, lock: Any, lock_id: str, waited: float, **_: Any
    ) -> None:
        labels = (task_label(lock, lock_id), _cache(lock))
        self.acquisitions.labels(*labels).inc()
        self.wait.labels(*labels).observe(waited)

    def on_contended(self, sender: Any, *, lock: Any, lock_id: str, **_: Any) -> None:
        task = task_label(lock, lock_id)
        self.contentions.labels(task, _cache(lock), _policy(lock, task)).inc()

    def on_released(
        self, sender: Any, *, lock: Any, lock_id: str, held: float, **_: Any
    ) -> None:
        self.hold.labels(task_label(lock, lock_id), _cache(lock)).observe(held)

    def on_lost(
        self, sender: Any, *, lock: Any, lock_id: str, during: str, **_: Any
    ) -> None:
        self.lost.labels(task_label(lock, lock_id), _cache(lock), during).inc()

    def on_store_failed(
        self, sender: Any, *, lock: Any, lock_id: str, **_: Any
    ) -> None:
        self.store_errors.labels(task_label(lock, lock_id), _cache(lock)).inc()

    def on_deduplicated(self, sender: Any, *, action: str, **_: Any) -> None:
        from .targets import spec_of

        spec = spec_of(sender, any_mode=True)
        name = str(getattr(sender, "name", sender))
        cache = None if spec is None else spec.options.cache
        self.duplicates.labels(name, cache or settings.CACHE, action).inc()

    def on_rate_limited(self, sender: Any, *, limit_id: str, **_: Any) -> None:
        self.rate_limited.labels(limit_label(limit_id)).inc()

    _RECEIVERS: Final = (
        (lock_acquired, "on_acquired"),
        (lock_contended, "on_contended"),
        (lock_released, "on_released"),
        (lock_lost, "on_lost"),
        (lock_store_failed, "on_store_failed"),
        (call_deduplicated, "on_deduplicated"),
        (rate_limit_refused, "on_rate_limited"),
    )

    def connect(self) -> None:
        for signal, name in self._RECEIVERS:
            signal.connect(
                getattr(self, name), weak=False, dispatch_uid=f"tasklock-{name}"
            )

    def disconnect(self) -> None:
        for signal, name in self._RECEIVERS:
            signal.disconnect(dispatch_uid=f"tasklock-{name}")


_installed: list[LockMetrics] = []
_mutex = threading.Lock()


def install() -> LockMetrics:
    """Make the metrics (once per process) and connect their receivers."""
    with _mutex:
        if not _installed:
            _installed.append(LockMetrics())
        metrics = _installed[0]
    metrics.connect()
    return metrics


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus's text format, of every process when ``PROMETHEUS_MULTIPROC_DIR``
    is set (prefork workers and a multi-process web server), else of this one.
    Route it where only your scraper can reach it."""
    from django.http import HttpResponse
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        generate_latest,
        multiprocess,
    )

    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
