"""``Semaphore``'s async twins (``aacquire``, ``async with``) on every store:
at most ``limit`` holders, sync and async alike, waits that leave the loop
free, cancellation that leaves no slot behind, and a dead holder's slot
taken as the sync semaphore takes it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from django_tasklock import Lock, LockNotAcquired, LockUsageError, Semaphore
from django_tasklock.aio import async_backend_for
from django_tasklock.semaphores import slot_id
from tests.async_storm import Ticks, all_until
from tests.helpers import run
from tests.processes import process_context
from tests.workers import most_at_once


def held_slots(name: str, limit: int) -> list[int]:
    return [slot for slot in range(limit) if Lock(slot_id(name, slot)).locked()]


def test_async_semaphore_admits_at_most_limit_with_sync_holders(store):
    sync_holder = Semaphore("async-slots", 3, expire=30)
    assert sync_holder.acquire()

    async def scenario():
        first, second = Semaphore("async-slots", 3), Semaphore("async-slots", 3)
        assert await first.aacquire() and await second.aacquire()
        assert len({sync_holder.slot, first.slot, second.slot}) == 3
        assert not await Semaphore("async-slots", 3).aacquire()
        with pytest.raises(LockNotAcquired):
            async with Semaphore("async-slots", 3):
                pass
        freed = first.slot
        assert await first.arelease()
        with pytest.raises(LockUsageError):  # as release() twice
            await first.arelease()
        async with Semaphore("async-slots", 3, expire=30) as third:
            assert third.slot == freed and third.owned()
            assert await third.acheck()
            assert await third.aextend(40)
        assert freed not in held_slots("async-slots", 3)
        assert await second.arelease()

    run(scenario)
    assert held_slots("async-slots", 3) == [sync_holder.slot]
    assert sync_holder.release()


def test_async_semaphore_reads_the_slots_natively(store):
    """The slots are read with the loop's own connections where the store has
    an async client here (no thread for the read)."""
    from tests.helpers import NATIVE

    async def scenario():
        backend = async_backend_for(store.alias, store.protocol)
        holder = Semaphore("async-read", 4, expire=30)
        assert await holder.aacquire()
        keys = [backend.sync.keys_for(slot_id("async-read", n))[0] for n in range(4)]
        held = await backend.held_many(keys)
        assert held == [n == holder.slot for n in range(4)]
        await holder.arelease()
        assert await backend.held_many(keys) == [False] * 4
        return backend.native

    assert run(scenario) is (store.name in NATIVE)


def test_a_blocking_async_semaphore_waits_on_the_loop(store):
    async def scenario():
        holder = Semaphore("async-slot-wait", 1, expire=30)
        assert await holder.aacquire()
        ticking = Ticks()
        started = time.monotonic()
        waiter = Semaphore("async-slot-wait", 1)
        assert not await waiter.aacquire(blocking=True, timeout=1.0)
        assert time.monotonic() - started >= 1.0
        # The loop ran others while it waited: ~100 ticks of 10 ms on an idle
        # machine; waits slept in the loop (10 ms, doubling up to 500 ms) would
        # let it tick once between tries, 7 times. (A loaded matrix session
        # ticked twice in a 0.3 s wait.)
        assert ticking.count >= 15
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter.aacquire(blocking=True), 0.3)
        assert not waiter.held

        async def let_go_soon():
            await asyncio.sleep(0.2)
            assert await holder.arelease()

        releasing = asyncio.ensure_future(let_go_soon())
        assert await waiter.aacquire(blocking=True, timeout=30)
        await releasing
        ticking.stop()
        assert await waiter.arelease()

    run(scenario)
    assert held_slots("async-slot-wait", 1) == []


def test_async_semaphore_cancelled_at_any_point_leaves_no_slot(store):
    """Cancelled while reading the slots, while taking one, or after: whatever
    it got is released. The cancel comes later after each cancelled try and
    sooner after each that took a slot, so the tries gather around the moment
    the take lands, whatever the machine's speed."""

    async def scenario():
        delay, got, cancelled = 0.001, 0, 0
        for _ in range(300):
            if got >= 5 and cancelled >= 5:
                break
            semaphore = Semaphore("async-slot-cancel", 2, expire=30)
            task = asyncio.ensure_future(semaphore.aacquire(blocking=True))
            if delay > 0.0005:  # else cancelled before its first round trip
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            asked = task.cancel()  # False: it had ended already
            try:
                took = await task
            except asyncio.CancelledError:
                cancelled += 1
                delay *= 1.5
            else:
                # A cancel asked of a running acquire must end it; one lost
                # (asyncio.wait_for before 3.12 lost a cancel that came as a
                # reply did) left a blocking acquire waiting for the lock.
                assert not asked, "the acquire ran on through its cancel"
                got += took
                delay /= 1.5
            if semaphore.held:
                assert await semaphore.arelease()
        # Cancelled releases and takes finish in the background first.
        for _ in range(200):
            if held_slots("async-slot-cancel", 2) == []:
                break
            await asyncio.sleep(0.01)
        return got, cancelled

    got, cancelled = run(scenario)
    assert got >= 5 and cancelled >= 5, (got, cancelled)
    assert held_slots("async-slot-cancel", 2) == []


def test_a_dead_holders_slot_is_taken_by_an_async_acquire(store, holders, settings):
    settings.TASKLOCK = {**store.tasklock, "LIVENESS": 3.0}
    live = holders(store.alias, "async-dead-slots", limit=2)
    dead = holders(store.alias, "async-dead-slots", limit=2)

    async def scenario():
        assert not await Semaphore("async-dead-slots", 2).aacquire()
        dead.kill()
        taker = Semaphore("async-dead-slots", 2, expire=30)
        assert await taker.aacquire(blocking=True, timeout=5)
        assert await taker.arelease()

    run(scenario)
    assert live.ask("check") == "check True False"


async def _contend_for_slots(
    limit: int, coroutines: int, wanted: int, start_at: float
) -> list[tuple[float, float]]:
    """``coroutines`` coroutines hold one semaphore of ``limit`` slots, each
    hold one loop turn or two, until they have held it ``wanted`` times."""
    holds: list[tuple[float, float]] = []
    done = asyncio.Event()

    async def one() -> None:
        while not done.is_set():
            semaphore = Semaphore("async-slot-storm", limit, expire=600)
            if not await semaphore.aacquire(blocking=True, timeout=1.0):
                continue
            entered = time.monotonic()
            for _ in range(random.randint(1, 2)):
                await asyncio.sleep(0)
            exited = time.monotonic()
            assert await semaphore.arelease(), "lost a slot nobody could take"
            holds.append((entered, exited))
            if len(holds) >= wanted:
                done.set()

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    await all_until(done, [one() for _ in range(coroutines)], 120)
    return holds


def _slot_storm(tasklock: dict[str, object], start_at: float) -> list:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock.aio import close_loop_connections

    settings.TASKLOCK = tasklock

    async def main():
        try:
            return await _contend_for_slots(3, 100, 60, start_at)
        finally:
            await close_loop_connections()

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("store_name", ["memcached-meta", "redis"])
def test_coroutines_in_two_processes_never_hold_more_than_the_limit(
    store_name, settings
):
    from tests.helpers import SHARED_STORES
    from tests.services import unmeasured

    chosen = next(s for s in SHARED_STORES if s.name == store_name)
    settings.TASKLOCK = chosen.tasklock
    with unmeasured():
        pool = process_context().Pool(1)
    with pool:
        start_at = time.monotonic() + 5.0
        other = pool.apply_async(_slot_storm, (chosen.tasklock, start_at))
        here = _slot_storm(chosen.tasklock, start_at)
        results = [here, other.get(timeout=300)]
    assert [len(holds) >= 60 for holds in results] == [True] * 2
    holds = [hold for result in results for hold in result]
    # All three slots were in use at once, and never a fourth.
    assert most_at_once(holds) == 3
