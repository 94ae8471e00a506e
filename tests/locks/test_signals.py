"""Every lock signal fires once per event, with the lock id, owner and timings,
and a receiver that raises never breaks a lock."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from django.core.cache import caches

from django_tasklock import Lock, LockLost, memcache_lock
from django_tasklock.signals import (
    lock_acquired,
    lock_contended,
    lock_lost,
    lock_released,
)
from example_project.feeds.metrics import LockMetrics

SIGNALS = {
    "acquired": lock_acquired,
    "contended": lock_contended,
    "released": lock_released,
    "lost": lock_lost,
}


@pytest.fixture
def events() -> Iterator[list[tuple[str, dict[str, object]]]]:
    seen: list[tuple[str, dict[str, object]]] = []
    receivers = {}
    for name, signal in SIGNALS.items():

        def receiver(sender, signal=None, _name=name, **kwargs):
            assert sender is Lock
            seen.append((_name, kwargs))

        receivers[name] = receiver
        signal.connect(receiver)
    yield seen
    for name, signal in SIGNALS.items():
        signal.disconnect(receivers[name])


def names(events) -> list[str]:
    return [name for name, _ in events]


def test_acquire_and_release_once_each(any_store, events):
    lock = Lock("signalled")
    began = time.monotonic()
    assert lock.acquire()
    took = time.monotonic()
    fence = lock.fence
    assert lock.release()
    ended = time.monotonic()
    assert names(events) == ["acquired", "released"]
    acquired, released = events[0][1], events[1][1]
    assert acquired["lock_id"] == released["lock_id"] == "signalled"
    assert acquired["owner"] == released["owner"] == lock.token
    # Not drawn yet when acquired (fences are drawn when read); the release
    # carries the one the holder read.
    assert acquired["fence"] is None
    assert released["fence"] == fence == lock.fence and fence is not None
    assert acquired["lock"] is lock
    # Within the calls that reported them (a loaded machine's first
    # connection to a cluster took 1.2 s: no bound of the clock's).
    assert 0 <= acquired["waited"] <= took - began  # type: ignore[operator]
    assert 0 <= released["held"] <= ended - began  # type: ignore[operator]


def test_contended_once_per_refused_acquire_with_the_holder(any_store, events):
    holder = Lock("busy")
    assert holder.acquire()
    assert Lock("busy").acquire() is False
    waiting = Lock("busy")
    assert waiting.acquire(blocking=True, timeout=0.3) is False
    assert names(events) == ["acquired", "contended", "contended"]
    first, second = events[1][1], events[2][1]
    assert first["owner"] == second["owner"] == holder.token
    assert first["lock_id"] == "busy"
    assert second["waited"] >= 0.3 > first["waited"]  # type: ignore[operator]
    assert holder.release()


def test_blocking_acquire_that_waits_then_succeeds_is_one_acquired(any_store, events):
    holder = Lock("handover", expire=2)
    assert holder.acquire()
    # Refused at once (the holder's lock has just been taken for 2 s), the waiter
    # tries again until the holder's lock expires, then takes it: one signal.
    waiter = Lock("handover", expire=60)
    assert waiter.acquire(blocking=True, timeout=30)
    assert names(events) == ["acquired", "acquired"]
    waited = events[1][1]["waited"]
    assert isinstance(waited, float) and waited >= 0.5, waited
    assert waiter.release()


def test_lost_once_though_release_finds_it_lost_again(any_store, events):
    lock = Lock("lost")
    assert lock.acquire()
    caches[any_store.alias].delete("lost")
    assert lock.extend() is False
    assert lock.release() is False
    assert names(events) == ["acquired", "lost"]
    lost = events[1][1]
    assert lost["during"] == "extend" and lost["owner"] == lock.token
    assert lost["fence"] is None  # never read, never drawn: a write must not go
    with pytest.raises(LockLost):  # out unfenced now
        lock.fence  # noqa: B018
    assert lost["held"] >= 0  # type: ignore[operator]


def test_memcache_lock_sends_the_same_signals(any_store, events):
    with memcache_lock("recipe", "oid") as acquired:
        assert acquired
        with memcache_lock("recipe", "oid") as again:
            assert not again
    assert names(events) == ["acquired", "contended", "released"]


def test_raising_receiver_never_breaks_a_lock(any_store, caplog):
    def broken(sender, **kwargs):
        raise RuntimeError("metrics exporter is down")

    for signal in SIGNALS.values():
        signal.connect(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="django.dispatch"):
            lock = Lock("robust")
            assert lock.acquire()
            assert Lock("robust").acquire() is False
            assert lock.release()
        assert not Lock("robust").locked(), "a raising receiver leaked the lock"
        assert "metrics exporter is down" in caplog.text
    finally:
        for signal in SIGNALS.values():
            signal.disconnect(broken)


def test_metrics_recipe_counts_and_times(any_store):
    """The README's recipe (example_project/feeds/metrics.py) over real events."""
    metrics = LockMetrics().connect()
    try:
        for _ in range(3):
            with Lock("feeds.import_feed-lock-abc"):
                assert Lock("feeds.import_feed-lock-abc").acquire() is False
        lost = Lock("other-lock")
        assert lost.acquire()
        caches[any_store.alias].delete("other-lock")
        assert lost.release() is False
    finally:
        metrics.disconnect()
    assert metrics.events == Counter(
        {
            ("acquired", "feeds.import_feed"): 3,
            ("contended", "feeds.import_feed"): 3,
            ("released", "feeds.import_feed"): 3,
            ("acquired", "other-lock"): 1,
            ("lost", "other-lock"): 1,
        }
    )
    assert len(metrics.held_seconds["feeds.import_feed"]) == 3
    assert all(0 <= held < 1 for held in metrics.held_seconds["feeds.import_feed"])
    # Disconnected: nothing more is counted.
    with Lock("feeds.import_feed-lock-abc"):
        pass
    assert metrics.events[("acquired", "feeds.import_feed")] == 3


def test_lost_receiver_may_release_the_lock_it_is_told_about(any_store):
    """A receiver that cleans up (release_quietly) from the heartbeat's thread
    must not deadlock on the lock's own guard."""
    calls = []

    def clean_up(sender, lock, **kwargs):
        lock.release_quietly()
        calls.append(lock.lock_id)

    lock_lost.connect(clean_up)
    try:
        lock = Lock("cleaned", expire=3, renew=True)
        assert lock.acquire()
        caches[any_store.alias].delete("cleaned")
        heartbeat = lock._heartbeat
        assert heartbeat is not None
        # A beat comes every third of the lock's sure life; on a busy machine
        # it may come late, so a hang is one that outlasts many of them.
        heartbeat.join(timeout=30)
        assert not heartbeat._thread.is_alive(), "the heartbeat hung in its receiver"
        assert calls == ["cleaned"] and lock.lost
    finally:
        lock_lost.disconnect(clean_up)
