"""Many coroutines in one event loop contending for a few lock ids with the
async API, run in the test process and in spawned processes beside it (for
tests/test_async_lock.py and benchmarks/asyncio_locks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any


class Ticks:
    """A coroutine of its own counting its 10 ms sleeps, from when this is
    made in a running loop until ``stop()``: how often the loop ran others."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.count += 1

    def stop(self) -> int:
        self._task.cancel()
        return self.count


async def contend(
    ids: int, coroutines: int, wanted: int, give_up: float, start_at: float
) -> dict[str, Any]:
    """``coroutines`` coroutines take (waiting: ``aacquire(blocking=True)``)
    and release locks ``async-storm-0`` to
    ``async-storm-<ids-1>`` (each its own id, ``i % ids``) until they have held
    them ``wanted`` times between them, or ``give_up`` seconds passed. Every
    hold's (lock id, enter, exit) on CLOCK_MONOTONIC (shared by the processes
    of one machine), how many holds waited for the lock, and the loop's lag: how much later
    than asked a 5 ms sleep of a probe coroutine woke, at most."""
    from django_tasklock import Lock

    holds: list[tuple[int, float, float]] = []
    waited = 0
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            asked = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - asked - 0.005)

    async def one(number: int) -> None:
        nonlocal waited
        lock_id = number % ids
        while not done.is_set():
            # An expiry no hold can reach here, however busy the machine: a
            # lock that expired while held would be lost, not robbed.
            lock = Lock(f"async-storm-{lock_id}", expire=600)
            asked = time.monotonic()
            if not await lock.aacquire(blocking=True, timeout=1.0):
                continue
            entered = time.monotonic()
            waited += entered - asked > 0.001
            await asyncio.sleep(0)  # others run while it is held
            exited = time.monotonic()
            assert await lock.arelease(), "lost a lock nobody else could take"
            holds.append((lock_id, entered, exited))
            if len(holds) >= wanted:
                done.set()

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    probing = asyncio.ensure_future(probe())
    try:
        with contextlib.suppress(asyncio.TimeoutError):  # the count then says so
            await all_until(done, [one(n) for n in range(coroutines)], give_up)
    finally:
        await probing
    return {"holds": holds, "waited": waited, "lag": max(lags, default=0.0)}


async def all_until(done: asyncio.Event, coroutines: list[Any], give_up: float) -> None:
    """Run ``coroutines`` until they end, for at most ``give_up`` seconds; then,
    or when one fails, ``done`` is set and the rest are ended before this
    returns (before the loop's connections close)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), give_up)
    finally:
        done.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def in_process(
    tasklock: dict[str, object],
    ids: int,
    coroutines: int,
    wanted: int,
    give_up: float,
    start_at: float,
) -> dict[str, Any]:
    """``contend`` in a new event loop of a (spawned) process, Django set up."""
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock.aio import close_loop_connections

    settings.TASKLOCK = tasklock

    async def main() -> dict[str, Any]:
        try:
            return await contend(ids, coroutines, wanted, give_up, start_at)
        finally:
            await close_loop_connections()

    return asyncio.run(main())
