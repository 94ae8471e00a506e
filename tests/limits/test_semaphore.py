"""``Semaphore``: at most ``limit`` holders, every slot owned, against the real
stores and many processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from django_tasklock import (
    Lock,
    LockNotAcquired,
    LockUsageError,
    Semaphore,
    current_lock,
    single_instance,
)
from django_tasklock.semaphores import slot_id
from tests.helpers import drop, in_thread
from tests.processes import process_context
from tests.workers import (
    Storms,
    hammer,
    most_at_once,
    overlaps,
    semaphore_holder,
    storm,
)

pytestmark = pytest.mark.long(seconds=90)


def test_at_most_limit_holders(any_store):
    holders = [Semaphore("pool", 3) for _ in range(3)]
    assert all(holder.acquire() for holder in holders)
    assert sorted(holder.slot for holder in holders) == [0, 1, 2]  # type: ignore[type-var]
    assert Semaphore("pool", 3).acquire() is False
    with pytest.raises(LockNotAcquired), Semaphore("pool", 3):
        pytest.fail("a fourth holder ran")
    assert holders[1].release()
    newcomer = Semaphore("pool", 3)
    assert newcomer.acquire() and newcomer.slot == holders[1].slot
    for holder in (holders[0], holders[2], newcomer):
        assert holder.owned() and holder.release()


def test_each_acquisition_draws_a_larger_fence_for_its_slot(any_store):
    first = Semaphore("fenced-pool", 1 + 1)
    assert first.acquire()
    fence, slot = first.fence, first.slot
    assert first.release()
    again = Semaphore("fenced-pool", 2)
    assert again.acquire()
    if again.slot == slot:
        assert again.fence > fence  # type: ignore[operator]
    assert again.release()
    assert fence is not None


def test_a_release_frees_only_its_own_slot(store):
    a, b = Semaphore("owned", 2), Semaphore("owned", 2)
    assert a.acquire() and b.acquire()
    # a's slot expires (deleted, as its expiry would) and a newcomer takes it.
    drop(store.alias, slot_id("owned", a.slot))  # type: ignore[arg-type]
    newcomer = Semaphore("owned", 2)
    assert newcomer.acquire() and newcomer.slot == a.slot
    assert a.release() is False and a.lost  # told, and left the newcomer alone
    assert newcomer.owned() and b.owned()
    assert a.extend() is False
    assert newcomer.owned() and b.owned()
    assert newcomer.release() and b.release()


def test_lowering_the_limit_leaves_no_more_than_the_new_limit(any_store):
    old = [Semaphore("resized", 5) for _ in range(5)]
    assert all(holder.acquire() for holder in old)
    by_slot = {holder.slot: holder for holder in old}
    # The next deploy says limit=2; the old holders run on.
    assert Semaphore("resized", 2).acquire() is False
    for slot in (2, 3, 4):  # the slots above the new limit finish
        assert by_slot[slot].release()
    assert Semaphore("resized", 2).acquire() is False, "more than 2 would run"
    assert by_slot[0].release()
    newcomer = Semaphore("resized", 2)
    assert newcomer.acquire() and newcomer.slot == 0
    running = [slot for slot in range(5) if Lock(slot_id("resized", slot)).locked()]
    assert running == [0, 1]
    assert newcomer.release() and by_slot[1].release()


def test_blocking_acquire_waits_for_a_slot(any_store):
    holder = Semaphore("queue", 1 + 1)
    other = Semaphore("queue", 2)
    assert holder.acquire() and other.acquire()
    started = time.monotonic()
    assert Semaphore("queue", 2).acquire(blocking=True, timeout=0.3) is False
    assert time.monotonic() - started >= 0.3
    assert holder.release()
    waiter = Semaphore("queue", 2)
    assert waiter.acquire(blocking=True, timeout=5)
    assert waiter.release() and other.release()


def test_misuse_and_bad_limits_are_clear():
    with pytest.raises(TypeError, match="limit must be an int"):
        Semaphore("x", 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from 1 to"):
        Semaphore("x", 0)
    with pytest.raises(ValueError, match="expire"):
        Semaphore("x", 2, expire=-1)
    with pytest.raises(LockUsageError, match="acquire"):
        Semaphore("x", 2).release()


def test_single_instance_limit_runs_at_most_n(any_store):
    @single_instance(key="tenant", limit=2)
    def export(tenant, n):
        semaphore = current_lock()
        assert isinstance(semaphore, Semaphore) and semaphore.fence is not None
        return n

    assert export("acme", 1) == 1
    from django_tasklock import lock_id_for

    name = lock_id_for(export, "acme", 0)
    held = [Semaphore(name, 2), Semaphore(name, 2)]
    assert all(holder.acquire() for holder in held)
    assert export("acme", 2) is None  # both slots taken: skipped
    assert export("other", 3) == 3  # another key, another semaphore
    assert held[0].release()
    assert export("acme", 4) == 4
    assert held[1].release()


def test_status_command_shows_the_holders(store):
    from io import StringIO

    from django.core.management import call_command

    holders = [Semaphore("watched", 3) for _ in range(2)]
    assert all(holder.acquire() for holder in holders)
    out = StringIO()
    call_command("tasklock", "status", "watched", "--limit", "3", stdout=out)
    text = out.getvalue()
    assert "Held:       2 of 3 slots" in text
    for holder in holders:
        assert str(holder.token) in text
        assert slot_id("watched", holder.slot) in text  # type: ignore[arg-type]
    out = StringIO()
    call_command("tasklock", "status", "watched", "--limit", "3", "--json", stdout=out)
    import json

    data = json.loads(out.getvalue())
    assert data["held"] == 2 and len(data["slots"]) == 3
    assert {slot["owner"] for slot in data["slots"] if slot["held"]} == {
        holder.token for holder in holders
    }
    for holder in holders:
        assert holder.release()


@pytest.fixture(scope="module")
def storms():
    """The storms' processes, started once for every store's."""
    with Storms(16) as pool:
        yield pool


@pytest.mark.slow
def test_sixteen_processes_never_exceed_the_limit(store, storms):
    results = storm(
        hammer, 16, 2000, (store.tasklock, "sixteen"), ("lock", 3), storms=storms
    )
    holds = [hold for process_holds, _ in results for hold in process_holds]
    refused = sum(count for _, count in results)
    assert len(holds) >= 2000, f"only {len(holds)} acquisitions"
    assert refused > 0, "never full: no contention tested"
    assert most_at_once(holds) == 3


def test_the_concurrency_meter_sees_more_than_the_limit_without_one():
    # The control for the test above: without a lock the meter counts them all.
    now = time.monotonic()
    assert (
        most_at_once([(now, now + 1), (now + 0.5, now + 2), (now + 0.6, now + 3)]) == 3
    )
    assert most_at_once([(now, now + 1), (now + 1, now + 2)]) == 1
    assert overlaps([(now, now + 1), (now + 0.5, now + 2)]) == 1
    assert callable(hammer)


HOLDER_EXPIRE = 5


@pytest.mark.slow
def test_sigkilled_holders_free_only_their_own_slots(store):
    context = process_context()
    queue = context.Queue()
    processes = [
        context.Process(
            # 5 s, renewed every third of it: memcached may drop a 5 s item
            # after 4 s (whole seconds), so only a 2.3 s stall loses it.
            target=semaphore_holder,
            args=(store.tasklock, "killed", 3, queue, HOLDER_EXPIRE),
        )
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    try:
        slot_of = dict(queue.get(timeout=60) for _ in processes)
        mine = Semaphore("killed", 3, expire=60)
        assert mine.acquire()
        extra = Semaphore("killed", 3)
        if extra.acquire():
            # A holder's heartbeat starved past its slot's sure life before the
            # kill (seen beside two CPU hogs): what must hold then is that it
            # was told, by a renewal that came too late.
            extra.release()
            assert queue.get(timeout=30)[::2] == ("lost", True)
            print("a holder's heartbeat starved past its slot's life; told")
            return
        victim, survivor = processes
        os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed_at = time.monotonic()
        newcomer = Semaphore("killed", 3, expire=60)
        while not newcomer.acquire():
            assert time.monotonic() - killed_at < HOLDER_EXPIRE + 3, "never freed"
            time.sleep(0.02)
        assert newcomer.slot == slot_of[victim.pid]
        # The survivor's slot is still its own (renewed), and ours is ours.
        survivor_slot = slot_of[survivor.pid]
        assert Lock(slot_id("killed", survivor_slot)).locked()
        time.sleep(HOLDER_EXPIRE + 0.5)  # past the survivor's expiry: renewed
        if not Lock(slot_id("killed", survivor_slot)).locked():
            # Its heartbeat starved past the slot's sure life (two CPU hogs
            # beside the suite): what must hold then is that the survivor was
            # told, by a renewal that came too late, not by one in time.
            assert queue.get(timeout=10) == ("lost", survivor.pid, True)
            print("the survivor's heartbeat starved past its slot's life; told")
        assert mine.owned() and newcomer.owned()
        assert mine.release() and newcomer.release()
    finally:
        for process in processes:
            process.kill()
            process.join()


def test_semaphore_in_a_thread_closes_nothing_of_others(any_store):
    holder = Semaphore("threads", 2)
    assert holder.acquire()

    def other() -> bool:
        mine = Semaphore("threads", 2)
        got = mine.acquire()
        full = Semaphore("threads", 2).acquire()
        mine.release()
        return got and not full

    assert in_thread(other)
    assert holder.owned() and holder.release()


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_round_trips_per_acquire_and_release(settings, memcached, redis_server, kind):
    from tests.helpers import counted_cache

    proxy = counted_cache(settings, memcached, redis_server, kind)
    try:
        warm = Semaphore("counted", 3)  # connects, loads the scripts
        assert warm.acquire() and warm.release()
        counts = {}
        holders = []
        for step in ("acquire", "acquire", "acquire", "full", "release"):
            before = proxy.requests
            if step == "release":
                assert holders.pop().release()
            else:
                holder = Semaphore("counted", 3)
                assert holder.acquire() is (step == "acquire")
                if step == "acquire":
                    holders.append(holder)
            counts.setdefault(step, []).append(proxy.requests - before)
        # Full: the slots read, then each held slot tried and its holder looked
        # at (locks.recovery; all alive here).
        assert counts == {"acquire": [2, 2, 2], "full": [7], "release": [1]}
        for holder in holders:
            holder.release()
    finally:
        proxy.close()
        from tests.helpers import close_connections

        close_connections()
