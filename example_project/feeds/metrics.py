"""Lock metrics from django_tasklock's signals: the README's recipe, for real.

Counts every lock event per task, and collects how long locks were held. Swap the
Counter and lists for your metrics client (prometheus_client's Counter and
Histogram, statsd's incr and timing) and connect it in your AppConfig.ready().
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from django_tasklock.signals import (
    lock_acquired,
    lock_contended,
    lock_lost,
    lock_released,
)


def task_of(lock_id: str) -> str:
    """``feeds.import_feed`` for ``feeds.import_feed-lock-<md5>``: one label per
    task, not one per argument digest (which would explode a metric's labels)."""
    return lock_id.partition("-lock-")[0]


class LockMetrics:
    """Counts of ``(event, task)`` and hold times per task, from the signals."""

    def __init__(self) -> None:
        self.events: Counter[tuple[str, str]] = Counter()
        self.held_seconds: defaultdict[str, list[float]] = defaultdict(list)
        self.waited_seconds: defaultdict[str, list[float]] = defaultdict(list)
        self._uid = f"feeds-lock-metrics-{id(self)}"

    def _count(self, event: str, lock_id: str) -> str:
        task = task_of(lock_id)
        self.events[event, task] += 1
        return task

    def on_acquired(
        self, sender: Any, *, lock_id: str, waited: float, **_: Any
    ) -> None:
        self.waited_seconds[self._count("acquired", lock_id)].append(waited)

    def on_contended(self, sender: Any, *, lock_id: str, **_: Any) -> None:
        self._count("contended", lock_id)

    def on_released(self, sender: Any, *, lock_id: str, held: float, **_: Any) -> None:
        self.held_seconds[self._count("released", lock_id)].append(held)

    def on_lost(self, sender: Any, *, lock_id: str, **_: Any) -> None:
        # Worth an alert: the protected work may have run twice at once.
        self._count("lost", lock_id)

    def _pairs(self) -> list[tuple[Any, Any]]:
        return [
            (lock_acquired, self.on_acquired),
            (lock_contended, self.on_contended),
            (lock_released, self.on_released),
            (lock_lost, self.on_lost),
        ]

    def connect(self) -> LockMetrics:
        for signal, receiver in self._pairs():
            signal.connect(receiver, dispatch_uid=self._uid)
        return self

    def disconnect(self) -> None:
        for signal, _receiver in self._pairs():
            signal.disconnect(dispatch_uid=self._uid)
