"""Fault cases 12-14: a process forked while it holds a lock, a reply lost after
the store acted, and a store paused until the caller gave up."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import TYPE_CHECKING

from reliability.faults import Row, use_cache
from tests.helpers import LONGER
from tests.services import stop_and_wait
from tests.workers import fork

if TYPE_CHECKING:
    from tests.services import Memcached, Redis

ROUNDS = 200


def _child_reads(lock: object, write_fd: int) -> None:
    """In the child: read the parent's lock ROUNDS times, try to release and extend
    it, unwind a with-block; report what went wrong."""
    from django_tasklock import Lock, LockUsageError

    assert isinstance(lock, Lock)
    bad = 0
    for _ in range(ROUNDS):
        try:
            ttl, owned = lock.ttl(), lock.owned()
            bad += not (ttl is not None and 50 <= ttl <= 60 + LONGER and owned)
        except Exception:
            bad += 1
    touched = 0
    for call in (lock.release, lock.extend):
        try:
            call()
            touched += 1
        except LockUsageError:
            pass
    lock.__exit__(None, None, None)
    with os.fdopen(write_fd, "w") as pipe:
        json.dump({"bad": bad, "touched": touched}, pipe)


def forked(memcached: Memcached, tries: int) -> Row:
    """Parent and child use one Lock object at once after a fork."""
    from django_tasklock import Lock

    attempts = overlapping = wrong = bad_replies = touched = 0
    with use_cache(memcached.address, timeout=5):
        for attempt in range(tries):
            attempts += 1
            lock = Lock(f"fault-fork-{attempt}", expire=60)
            assert lock.acquire()
            pid, read_fd = fork(functools.partial(_child_reads, lock))
            parent_bad = 0
            for _ in range(ROUNDS):
                try:
                    ttl = lock.ttl()
                    parent_bad += not (ttl is not None and 50 <= ttl <= 60 + LONGER)
                    parent_bad += not lock.owned()
                except Exception:
                    parent_bad += 1
            with os.fdopen(read_fd) as pipe:
                report = json.loads(pipe.read() or '{"bad": -1, "touched": -1}')
            os.waitpid(pid, 0)
            rival = Lock(f"fault-fork-{attempt}")
            overlapping += rival.acquire()
            bad_replies += parent_bad + max(report["bad"], 0)
            touched += report["touched"]
            wrong += parent_bad + report["bad"] + report["touched"]
            wrong += not lock.release()
    row = Row("12. fork while holding, both use the lock", attempts, overlapping, wrong)
    row.figures.append(
        f"wrong replies {bad_replies} of {2 * ROUNDS * attempts} reads each side; "
        f"child released or extended the parent's lock {touched} times"
    )
    return row


def lost_reply(redis: Redis, tries: int) -> Row:
    """The reply to an acquire that Redis carried out is lost on the way back."""
    from django_tasklock import Lock
    from tests.faultproxy import FaultProxy

    proxy = FaultProxy(redis.port)
    attempts = overlapping = wrong = own = held_after = 0
    try:
        with use_cache(f"redis://{proxy.address}/0", "redis"):
            warm = Lock("fault-warm-up")
            assert warm.acquire()
            assert warm.release()
            for attempt in range(tries):
                attempts += 1
                lock_id = f"fault-lost-reply-{attempt}"
                before = proxy.dropped
                proxy.drop_replies(lock_id.encode())
                lock = Lock(lock_id)
                taken = lock.acquire()
                if proxy.dropped != before + 1:
                    raise AssertionError("no reply was lost: the case did not happen")
                overlapping += Lock(lock_id).acquire()
                own += taken
                wrong += not taken or not lock.release()
                left = Lock(lock_id).locked()
                held_after += left
                wrong += left
    finally:
        proxy.close()
    row = Row(
        "13. Redis reply lost after the acquire ran", attempts, overlapping, wrong
    )
    row.figures.append(
        f"replies lost {proxy.dropped}; the caller took its own lock "
        f"{own}/{attempts}; left held after release {held_after}"
    )
    return row


def paused_store(memcached_factory: type[Memcached], tries: int) -> Row:
    """memcached is SIGSTOPped while an acquire waits on it; the caller times out
    and is told; the store resumes and carries the acquire out: how long does that
    lock with no holder live?"""
    from django_tasklock import Lock, LockBackendError, orphans

    attempts = overlapping = wrong = removed_by_watch = 0
    survived: list[float] = []
    for attempt in range(tries):
        attempts += 1
        server = memcached_factory().start()
        try:
            with use_cache(server.address, timeout=0.5, connect_timeout=0.5):
                warm = Lock("fault-warm-up")
                assert warm.acquire()
                assert warm.release()
                lock_id = f"fault-paused-{attempt}"
                key = warm.acquisition.key.replace("fault-warm-up", lock_id)  # type: ignore[union-attr]
                removed = orphans.removed_count()
                assert server.process is not None
                stop_and_wait(server.process.pid)
                try:
                    try:
                        Lock(lock_id).acquire()
                        wrong += 1  # a paused store must not look free or held
                    except LockBackendError:
                        pass
                finally:
                    server.process.send_signal(signal.SIGCONT)
                resumed = time.monotonic()
                # The store takes the lock some moment after it resumes; the watch
                # removes it: its life is at most the time until the removal.
                deadline = resumed + 10
                while (
                    orphans.removed_count() == removed and time.monotonic() < deadline
                ):
                    time.sleep(0.001)
                survived.append(time.monotonic() - resumed)
                while orphans.watched_count() and time.monotonic() < deadline:
                    time.sleep(0.01)
                found = orphans.removed_count() - removed
                wrong += server.raw(b"mg " + key.encode() + b" v").startswith(b"VA")
                removed_by_watch += found
                wrong += found != 1 or survived[-1] >= 1.0
                first, second = Lock(lock_id), Lock(lock_id)
                got_first, got_second = first.acquire(), second.acquire()
                overlapping += got_first and got_second
                wrong += not got_first  # still held, by nobody
                first.release_quietly()
                second.release_quietly()
        finally:
            server.stop()
    row = Row(
        "14. memcached paused past an acquire's timeout", attempts, overlapping, wrong
    )
    row.figures.append(
        f"the lock the resumed store took for nobody was removed by the watch "
        f"{removed_by_watch}/{attempts}, {min(survived) * 1000:.0f}-{max(survived) * 1000:.0f} ms "
        "after SIGCONT (its whole life)"
    )
    return row


def run(main: Memcached, redis: Redis, quick: bool) -> list[Row]:
    from tests.services import Memcached as MemcachedServer

    return [
        forked(main, 2 if quick else 10),
        lost_reply(redis, 2 if quick else 20),
        paused_store(MemcachedServer, 1 if quick else 5),
    ]
