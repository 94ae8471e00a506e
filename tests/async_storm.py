"""Many coroutines in one event loop contending for a few lock ids with the
async API, run in the test process and in spawned processes beside it (for
tests/aio/test_async_lock.py and benchmarks/asyncio_locks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator


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


@contextlib.contextmanager
def longest_step() -> Iterator[dict[str, Any]]:
    """While inside: how long the event loop was blocked at most, by this
    thread's CPU clock (not stretched by other processes): ``step``, the
    longest one callback of the loop took (a coroutine's step, a timer's),
    less the garbage collector's pauses inside it, and ``what`` that callback
    was (a task's step by its coroutine's name); ``gc``, the longest such
    pause (the interpreter's, whatever runs). Times ``asyncio.Handle._run``,
    which asyncio's own loop calls for every callback (uvloop does not)."""
    import gc
    from asyncio import events

    original = events.Handle._run
    longest: dict[str, Any] = {"step": 0.0, "gc": 0.0, "what": ""}
    clock = time.thread_time
    collecting = [0.0, 0.0]  # the pause under way's start; all pauses so far

    def timed(handle: Any) -> None:
        started, paused = clock(), collecting[1]
        try:
            original(handle)
        finally:
            spent = clock() - started - (collecting[1] - paused)
            if spent > longest["step"]:
                longest["step"], longest["what"] = spent, _named(handle)

    def pauses(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[0] = clock()
            return
        pause = clock() - collecting[0]
        collecting[1] += pause
        longest["gc"] = max(longest["gc"], pause)

    events.Handle._run = timed  # type: ignore[method-assign]
    gc.callbacks.append(pauses)
    try:
        yield longest
    finally:
        gc.callbacks.remove(pauses)
        events.Handle._run = original  # type: ignore[method-assign]


def _named(handle: Any) -> str:
    """What an event loop's callback runs: a task's step by its coroutine."""
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        return f"a step of {task.get_coro().__qualname__}"  # type: ignore[union-attr]
    return getattr(callback, "__qualname__", repr(callback))


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
    with longest_step() as step:
        try:
            with contextlib.suppress(asyncio.TimeoutError):  # the count says so
                await all_until(done, [one(n) for n in range(coroutines)], give_up)
        finally:
            await probing
    return {
        "holds": holds,
        "waited": waited,
        "lag": max(lags, default=0.0),
        "step": step["step"],
        "what": step["what"],
        "gc": step["gc"],
    }


async def all_until(done: asyncio.Event, coroutines: list[Any], give_up: float) -> None:
    """Run ``coroutines`` until they end, for at most ``give_up`` seconds; then,
    or when one fails, ``done`` is set and the rest are ended before this
    returns (before the loop's connections close)."""
    tasks = []
    for number, coroutine in enumerate(coroutines, 1):
        tasks.append(asyncio.ensure_future(coroutine))
        if number % 50 == 0:  # a thousand at once would hold the loop itself
            await asyncio.sleep(0)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), give_up)
    finally:
        done.set()
        for number, task in enumerate(tasks, 1):
            task.cancel()
            if number % 50 == 0:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)


def in_process(
    tasklock: dict[str, object],
    ids: int,
    coroutines: int,
    wanted: int,
    give_up: float,
    start_at: float,
    *,
    freeze: bool = False,
) -> dict[str, Any]:
    """``contend`` in a new event loop of a (spawned) process, Django set up;
    with ``freeze``, what the process holds then is kept out of the garbage
    collector's passes (``gc.freeze()``, as a server does after its start-up),
    so that they walk only what the storm made."""
    import gc

    from tests.workers import setup_django

    setup_django()
    if freeze:
        gc.collect()
        gc.freeze()
    from django.conf import settings

    from django_tasklock.aio import close_loop_connections

    settings.TASKLOCK = tasklock

    async def main() -> dict[str, Any]:
        try:
            return await contend(ids, coroutines, wanted, give_up, start_at)
        finally:
            await close_loop_connections()

    return asyncio.run(main())
