"""memcached's clock, late: no lock goes before the life its holder counts on.

memcached judges expiry by whole seconds on a timer that fires once a second
and is re-armed after each firing. When the server is paused or starved of
CPU, a tick comes late and the timer's phase moves against the seconds it
counts; an item stored just before the phase wraps past a second goes almost a
second sooner than ``n - 1`` seconds. Here the server is SIGSTOPped for random
spans while holders take locks on it, and a watcher reads every lock until it
goes: none may go before its holder's ``valid_until`` (the store's sure life,
counted from before the command was sent).
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time

import pytest
from pymemcache.client.base import Client

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import backend_for
from tests.helpers import close_connections
from tests.services import Memcached

EXPIRE = 4
SECONDS = 30
ALIASES = {
    "clock-meta": "django.core.cache.backends.memcached.PyMemcacheCache",
    "clock-pylibmc": "django.core.cache.backends.memcached.PyLibMCCache",
}


@pytest.fixture
def server(settings):
    server = Memcached().start()
    settings.CACHES = {
        **settings.CACHES,
        **{
            alias: {"BACKEND": backend, "LOCATION": server.address}
            for alias, backend in ALIASES.items()
        },
    }
    settings.TASKLOCK = {"CACHE": "clock-meta", "LOCK_EXPIRE": EXPIRE, "LIVENESS": None}
    yield server
    close_connections()
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)
    server.stop()


class Holders:
    """Locks taken on ``alias`` one after another until ``stop`` is set: per
    key, until when the holder counts on it."""

    def __init__(self, alias: str, stop: threading.Event) -> None:
        self.alias, self.stop = alias, stop
        self.valid_until: dict[str, float] = {}
        self.sent_at: dict[str, float] = {}
        self.errors = 0
        self.mutex = threading.Lock()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            lock = Lock(f"{self.alias}-{n}", cache=self.alias, expire=EXPIRE)
            sent = time.monotonic()
            try:
                assert lock.acquire()
            except LockBackendError:
                self.errors += 1  # a pause outlasted the client's timeout
                continue
            acq = lock.acquisition
            assert acq is not None and acq.valid_until is not None
            with self.mutex:
                self.valid_until[acq.key] = acq.valid_until
                self.sent_at[acq.key] = sent
            self.stop.wait(0.03)

    def taken(self) -> list[str]:
        with self.mutex:
            return list(self.valid_until)


def pause_at_random(server: Memcached, stop: threading.Event, paused: list) -> None:
    """SIGSTOP the server for 0.05-1.2 s every 1-3 s: each pause makes its
    clock's next tick late."""
    chance = random.Random(20261127)
    assert server.process is not None
    while not stop.wait(chance.uniform(1, 3)):
        server.process.send_signal(signal.SIGSTOP)
        span = chance.uniform(0.05, 1.2)
        time.sleep(span)
        server.process.send_signal(signal.SIGCONT)
        paused.append(span)


@pytest.mark.slow
def test_no_lock_goes_before_its_sure_life_on_a_server_whose_clock_ticks_late(
    server,
):
    host, port = server.address.split(":")
    watcher = Client((host, int(port)), timeout=30)
    stop = threading.Event()
    holders = [Holders(alias, stop) for alias in ALIASES]
    paused: list[float] = []
    threads = [threading.Thread(target=h.run) for h in holders]
    threads.append(
        threading.Thread(target=pause_at_random, args=(server, stop, paused))
    )
    for thread in threads:
        thread.start()
    gone: dict[str, float] = {}  # key: when first seen gone (after it went)
    try:
        watch_until = time.monotonic() + SECONDS
        while True:
            now = time.monotonic()
            if now > watch_until:
                stop.set()
            live = [k for h in holders for k in h.taken() if k not in gone]
            if stop.is_set() and not live:
                break
            found = watcher.get_many(live) if live else {}
            seen_at = time.monotonic()
            gone.update((k, seen_at) for k in live if k not in found)
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        watcher.close()
    early: dict[str, float] = {}
    lives: list[float] = []
    for holder in holders:
        for key, until in holder.valid_until.items():
            lives.append(gone[key] - holder.sent_at[key])
            if gone[key] < until:
                early[key] = round(until - gone[key], 3)
    below = sum(life < math.ceil(EXPIRE) - 1 for life in lives)
    assert early == {}, (
        f"{len(early)} of {len(lives)} locks went before their sure life ran "
        f"out (seconds early): {early}; shortest life {min(lives):.3f}s"
    )
    assert len(paused) >= 5 and all(len(h.valid_until) > 100 for h in holders)
    # The pauses did move the clock: some lock lived less than n - 1 seconds,
    # which a sure life of n - 1 (this package's before) would have promised.
    assert below > 0, f"no lock lived less than {EXPIRE - 1}s: {min(lives):.3f}s"


def test_the_sure_life_on_memcached_is_two_seconds_short_of_the_expiry(server):
    for alias in ALIASES:
        backend = backend_for(alias)
        assert [backend.shortest_life(e) for e in (1, 2, 2.5, 3, 4, 60)] == [
            0.0,
            0.0,
            1.0,
            1.0,
            2.0,
            58.0,
        ]
