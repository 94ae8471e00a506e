"""``@single_instance`` and ``@rate_limited`` on ``async def`` functions: the
wrapper is a coroutine function, its lock is held while the body is awaited
(before, the sync wrapper released it before the coroutine ran), waits sleep
on the loop, and what an async function cannot have is refused when it is
decorated."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from django_tasklock import (
    Lock,
    LockNotAcquired,
    RateLimited,
    RateLimiter,
    current_admission,
    current_lock,
    lock_id_for,
    rate_limited,
    single_instance,
)
from tests.helpers import run, waited_until


@single_instance(key="report_id", expire=30)
async def build(report_id, gate, seen):
    """Runs until ``gate`` is set; notes the current lock it ran under."""
    seen.append(current_lock())
    await gate.wait()
    return f"built {report_id}"


@single_instance(key="report_id", expire=30, on_contention="raise")
async def build_or_raise(report_id, gate):
    await gate.wait()
    return report_id


@single_instance(key="report_id", expire=30, on_contention="wait", timeout=10)
async def build_in_turn(report_id, gate, order):
    order.append(("start", report_id))
    await gate.wait()
    order.append(("end", report_id))
    return report_id


@single_instance(
    key="report_id", expire=30, on_contention="wait", timeout=0.2, on_timeout="raise"
)
async def build_briefly(report_id, gate):
    await gate.wait()


@single_instance(key="tenant", limit=2, expire=30)
async def export(tenant, n, gate):
    await gate.wait()
    return n


def test_an_async_function_holds_its_lock_while_awaited(store):
    assert inspect.iscoroutinefunction(build)

    async def scenario():
        gate, seen = asyncio.Event(), []
        first = asyncio.ensure_future(build(7, gate, seen))
        await waited_until(lambda: len(seen) == 1)
        # The first is inside its body: its lock is held, by a Lock of its own.
        lock_id = lock_id_for(build, 7, gate, seen)
        assert Lock(lock_id).locked() and seen[0].lock_id == lock_id
        assert await build(7, gate, seen) is None  # skipped: held
        assert Lock(lock_id).acquire() is False  # a sync caller is refused too
        other = asyncio.ensure_future(build(8, gate, seen))  # other arguments run
        await waited_until(lambda: len(seen) == 2)
        gate.set()
        assert await first == "built 7" and await other == "built 8"
        assert not Lock(lock_id).locked()
        assert current_lock() is None  # outside a body

    run(scenario)


def test_a_body_that_raises_releases_and_a_sync_holder_makes_it_skip():
    @single_instance(expire=30)
    async def fails():
        raise ValueError("boom")

    async def scenario():
        with pytest.raises(ValueError, match="boom"):
            await fails()
        assert not Lock(lock_id_for(fails)).locked()
        holder = Lock(lock_id_for(fails), expire=30)
        assert holder.acquire()
        assert await fails() is None  # skipped, the body never ran
        assert holder.release()

    run(scenario)


def test_raise_wait_and_on_timeout_policies():
    async def scenario():
        gate, order = asyncio.Event(), []
        first = asyncio.ensure_future(build_or_raise(1, gate))
        await waited_until(lambda: Lock(lock_id_for(build_or_raise, 1, gate)).locked())
        with pytest.raises(LockNotAcquired):
            await build_or_raise(1, gate)
        gate.set()
        assert await first == 1

        gate = asyncio.Event()
        runs = [asyncio.ensure_future(build_in_turn(2, gate, order)) for _ in range(3)]
        await waited_until(lambda: order == [("start", 2)])
        await asyncio.sleep(0.1)
        assert order == [("start", 2)]  # the others wait on the loop
        gate.set()
        assert await asyncio.gather(*runs) == [2, 2, 2]
        # One after the other, never two at once.
        assert order == [("start", 2), ("end", 2)] * 3

        gate = asyncio.Event()
        holder = asyncio.ensure_future(build_briefly(3, gate))
        await waited_until(lambda: Lock(lock_id_for(build_briefly, 3, gate)).locked())
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            await build_briefly(3, gate)
        assert 0.2 <= time.monotonic() - started < 5
        gate.set()
        await holder

    run(scenario)


def test_a_limit_lets_that_many_run_at_once():
    async def scenario():
        gate = asyncio.Event()
        calls = [asyncio.ensure_future(export("acme", n, gate)) for n in range(3)]
        await waited_until(lambda: any(call.done() for call in calls))
        await asyncio.sleep(0.1)
        done = [call for call in calls if call.done()]
        assert len(done) == 1 and done[0].result() is None  # the third skipped
        gate.set()
        results = await asyncio.gather(*calls)
        assert sorted(r for r in results if r is not None) == sorted(
            n for n, call in enumerate(calls) if call is not done[0]
        )

    run(scenario)


def test_a_nested_call_of_the_same_lock_never_waits_for_itself():
    @single_instance(key="name", expire=30, on_contention="wait", timeout=30)
    async def outer(name, depth):
        if depth == 0:
            return await outer(name, 1)
        return "inner ran"

    async def scenario():
        started = time.monotonic()
        with pytest.raises(LockNotAcquired, match="cannot wait for its own caller"):
            await outer("nested", 0)
        assert time.monotonic() - started < 5
        assert not Lock(lock_id_for(outer, "nested", 0)).locked()

    run(scenario)


@pytest.mark.parametrize("mode", ["until_started", "until_finished", "coalesce"])
def test_a_publishing_mode_called_in_place_runs_as_while_running(mode):
    """Awaited in place (no published call), every mode holds the lock while
    the body is awaited and skips a call that meets it (the worker's side is
    tests/integrations/test_django_tasks.py's)."""

    @single_instance(mode=mode, key="name", expire=30)
    async def published(name):
        return Lock(lock_id_for(published, name)).locked()

    async def scenario():
        assert await published("in-place") is True
        assert not Lock(lock_id_for(published, "in-place")).locked()
        holder = Lock(lock_id_for(published, "in-place"), expire=30)
        assert await holder.aacquire()
        try:
            assert await published("in-place") is None  # held: skipped
        finally:
            await holder.arelease()

    run(scenario)


def test_what_an_async_function_cannot_have_is_refused_when_decorated():
    with pytest.raises(TypeError, match="nothing can send a call of it again"):

        @single_instance(on_contention="retry")
        async def retried(self, x): ...

    with pytest.raises(TypeError, match="nothing can send a call of it again"):

        @rate_limited("1/s", on_limit="retry")
        async def limited_retry(self, x): ...


@rate_limited("2/10s", name="async-decorated-raise", on_limit="raise")
async def call_partner(n):
    admission = current_admission()
    assert admission is not None
    await asyncio.sleep(0)
    return n, admission.at


@rate_limited("2/1s", name="async-decorated-wait", on_limit="wait", timeout=5)
async def call_in_turn(n):
    return n


@rate_limited("1/10s", name="async-decorated-skip", on_limit="skip")
async def call_or_skip(n):
    return n


@rate_limited("1/10s", name="async-decorated-default")
async def call_by_default(n):
    return n


def test_rate_limited_async_functions(store):
    for name in ("raise", "wait", "skip", "default"):
        RateLimiter(f"async-decorated-{name}", "1/s").reset()
    assert inspect.iscoroutinefunction(call_partner)

    async def scenario():
        first, second = await call_partner(1), await call_partner(2)
        assert [first[0], second[0]] == [1, 2] and abs(first[1] - time.time()) < 5
        with pytest.raises(RateLimited) as refused:
            await call_partner(3)
        assert 0 < refused.value.retry_after <= 10
        started = time.monotonic()
        assert [await call_in_turn(n) for n in range(3)] == [0, 1, 2]
        assert 0.3 < time.monotonic() - started < 5  # the third waited its turn
        assert await call_or_skip(1) == 1 and await call_or_skip(2) is None
        assert await call_by_default(1) == 1
        # The default on_limit ("retry") cannot send a plain call again: it
        # raises rather than lose it.
        with pytest.raises(RateLimited):
            await call_by_default(2)

    run(scenario)
