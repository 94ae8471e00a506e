"""A frozen memcached cannot shorten a lock behind its holder's back (the
review's F4).

A memcached stopped as a whole (SIGSTOP here; a frozen VM or container in the
field) keeps its clock where it stopped. On SIGCONT its worker threads carry out
the commands queued on open connections before the clock catches up, so an item
stored with a relative expiry then goes as much sooner as the stall lasted:
4 s locks sent late in a 3 s stall went 0.8-1.6 s before their holders'
``valid_until``. Each stall here (0.5, 1, 2, 3 and 5 s) gets locks sent at
random points in it, on connections opened before it, and a watcher sees when
each goes: none may go before its holder's ``valid_until``.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time

import pytest
from pymemcache.client.base import Client

from django_tasklock import Lock
from tests.helpers import close_connections
from tests.services import Memcached

pytestmark = pytest.mark.slow

EXPIRE = 8  # a sure life (6 s) past the longest stall: no take answered late
STALLS = (0.5, 1, 2, 3, 5)
SENDERS = 4


@pytest.fixture
def server(settings):
    server = Memcached().start()
    settings.CACHES = {
        **settings.CACHES,
        "frozen": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": server.address,
            # Longer than any stall: a send waits the stall out.
            "OPTIONS": {"timeout": 30},
        },
    }
    settings.TASKLOCK = {
        "CACHE": "frozen",
        "LOCK_EXPIRE": EXPIRE,
        "LIVENESS": None,
        "SOCKET_TIMEOUT": 30,
    }
    yield server
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)
    server.stop()


class Sender(threading.Thread):
    """A thread with a connection of its own, opened (and its server's run
    and clock learnt) before any stall: it takes the locks it is handed."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.lock_name = name
        self.orders: queue.Queue[tuple[str, float] | None] = queue.Queue()
        self.taken: dict[str, tuple[float, float]] = {}  # id: (sent, valid_until)
        self.ready = threading.Event()

    def run(self) -> None:
        warm = Lock(f"{self.lock_name}-warm")
        assert warm.acquire() and warm.release()
        self.ready.set()
        try:
            while (order := self.orders.get()) is not None:
                lock_id, at = order
                time.sleep(max(at - time.monotonic(), 0))
                lock = Lock(lock_id, expire=EXPIRE)
                sent = time.monotonic()
                assert lock.acquire()
                acq = lock.acquisition
                assert acq is not None and acq.valid_until is not None
                self.taken[lock_id] = (sent, acq.valid_until)
        finally:
            close_connections()


def test_no_lock_sent_during_a_stall_goes_before_its_valid_until(server):
    chance = random.Random(int(os.environ.get("TASKLOCK_FROZEN_SEED", "20261128")))
    senders = [Sender(f"sender-{n}") for n in range(SENDERS)]
    for sender in senders:
        sender.start()
        assert sender.ready.wait(10)
    host, port = server.address.split(":")
    watcher = Client((host, int(port)), timeout=30)
    assert watcher.version()  # its connection open before the stalls
    gone: dict[str, float] = {}
    sent_in: dict[str, tuple[float, float]] = {}  # id: (stall, point in it)
    assert server.process is not None
    try:
        for stall in STALLS:
            ids = []
            server.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            for n, sender in enumerate(senders):
                lock_id = f"frozen-{stall}-{n}"
                point = chance.uniform(0.05, stall * 0.95)
                sender.orders.put((lock_id, stopped + point))
                sent_in[lock_id] = (stall, point)
                ids.append(lock_id)
            time.sleep(stall)  # the stall itself: what is measured
            server.process.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + EXPIRE + stall + 10
            while len([i for i in ids if i in gone]) < len(ids):
                assert time.monotonic() < deadline, "locks never went"
                # Only locks taken (their holders answered): a send late in
                # the stall may not have reached the server yet.
                held = {i for sender in senders for i in list(sender.taken)}
                live = [i for i in ids if i in held and i not in gone]
                found = watcher.get_many([f":1:{i}" for i in live])
                seen = time.monotonic()
                gone.update((i, seen) for i in live if f":1:{i}" not in found)
                time.sleep(0.01)
    finally:
        for sender in senders:
            sender.orders.put(None)
        for sender in senders:
            sender.join(10)
        watcher.close()
    taken = {k: v for sender in senders for k, v in sender.taken.items()}
    assert set(taken) == set(sent_in), "a send was lost"
    early = {
        lock_id: (*sent_in[lock_id], round(valid_until - gone[lock_id], 3))
        for lock_id, (_sent, valid_until) in taken.items()
        if gone[lock_id] < valid_until
    }
    assert early == {}, f"(stall, sent at, seconds early): {early}"
    # Each lock did live out its sure life from its send (and the sends did
    # wait out their stall: sent at the point, answered after it).
    lives = {i: gone[i] - taken[i][0] for i in taken}
    assert min(lives.values()) >= EXPIRE - 2, lives
    for stall in STALLS:  # what docs/explanation/guarantees.rst reports
        margins = [gone[i] - taken[i][1] for i in taken if sent_in[i][0] == stall]
        print(
            f"stall {stall}s: gone {min(margins):.3f}-{max(margins):.3f}s after valid_until"
        )


def test_a_clock_read_before_a_stalled_server_caught_up_never_replaces_a_better_one():
    """A stalled memcached answers ``stats`` before its clock catches up: such
    a read lags by the stall. It never lowers the best read of the run; a
    first read of a run that lags this host's clock by more than two seconds
    is suspect (read again); a slow read tells nothing."""
    from django_tasklock.backends.memcached.wire import (
        CLOCK_READ_MOST,
        _clocks,
        clock_suspect,
        observe_clock,
    )

    server = ("192.0.2.1", 1)  # a name only: nothing connects
    now = int(time.time())
    try:
        assert clock_suspect(now - 5)
        assert not clock_suspect(now)
        assert observe_clock(server, now, 100.0, 100.01)
        best = _clocks[server]
        # Much later, a read that lags by a 5 s stall: the best one holds.
        assert observe_clock(server, now + 3600 - 5, 3700.0, 3700.01)
        assert _clocks[server] == best
        # A read that ran ahead (the server's clock is faster): taken.
        assert observe_clock(server, now + 3601, 3700.0, 3700.01)
        assert _clocks[server] == best + 1
        # Too slow to tell: not taken.
        assert not observe_clock(
            server, now + 3700, 3700.0, 3700.0 + CLOCK_READ_MOST * 2
        )
        assert _clocks[server] == best + 1
    finally:
        _clocks.pop(server, None)


def test_a_record_write_held_up_past_its_timeout_never_ends_a_later_one(settings):
    """A liveness record's write that timed out may still land: held in the
    network, or queued in a stalled server (the soak's four robberies: a
    paused server resumed and carried out a write its writer had given up on
    after a later write of the same record). Its end, counted from its send,
    is earlier than the later write's; landing last, it would end the record
    sooner than its holder counts, and a contender would take a live
    holder's lock. The proxy holds the first write's store command until the
    second write (straight to the server) is done, then lets it through: the
    record must keep the second write's end."""
    from django_tasklock.backends import backend_for
    from tests.faultproxy import FaultProxy

    server = Memcached().start()
    proxy = FaultProxy(server.port)
    config = {"BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache"}
    settings.CACHES = {
        **settings.CACHES,
        "via-proxy": {**config, "LOCATION": proxy.address},
        "direct": {**config, "LOCATION": server.address},
    }
    settings.TASKLOCK = {"CACHE": "direct", "SOCKET_TIMEOUT": 1}
    raw = Client(("127.0.0.1", server.port))
    try:
        slow, fast = backend_for("via-proxy"), backend_for("direct")
        slow_place, fast_place = slow.record_places()[0], fast.record_places()[0]
        slow.write_record(slow_place, "rec", "warm", 60)  # (connections, clocks)
        wire_key = fast.key_for("rec").encode()
        # Every store command of the record: set, add, cas or a meta set.
        proxy.hold(
            *(verb + b" " + wire_key for verb in (b"set", b"add", b"cas", b"ms"))
        )
        with pytest.raises(slow.errors):
            slow.write_record(slow_place, "rec", "stale", 3)  # times out, held
        assert proxy.held == 1
        fast.write_record(fast_place, "rec", "fresh", 30)
        proxy.let_go()
        # Whatever the held write does, it does within a moment; the record
        # must end as the fresh write said (30 s), never as the stale (3 s).
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            reply = raw.raw_command(b"mg " + wire_key + b" t v", b"\r\n")
            assert reply.startswith(b"VA"), reply
            left = int(reply.split(b" t")[1].split()[0])
            assert left > 20, f"the stale write ended the record: {left}s left"
            time.sleep(0.05)
    finally:
        raw.close()
        close_connections()
        proxy.close()
        server.stop()
