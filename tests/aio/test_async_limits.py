"""``RateLimiter.aadmit()``: the async twin of ``admit()`` and, with
``timeout``, of ``wait()``, on every store: the same count as the sync API,
waits that sleep on the loop, and natively async round trips on memcached
and Redis (no executor thread)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from django_tasklock import LockBackendError, RateLimiter
from django_tasklock.signals import rate_limit_refused
from tests.async_storm import Ticks, all_until
from tests.helpers import NATIVE, run
from tests.limits_helpers import smooth_violations, window_violations


class CountingExecutor(ThreadPoolExecutor):
    """The loop's executor, counting the work handed to its threads."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("kind", ["window", "smooth"])
def test_aadmit_counts_with_admit(store, kind):
    limiter = RateLimiter(f"async-count-{kind}", "3/10s", kind=kind)
    limiter.reset()
    refusals = []

    def refused(sender, **details):
        refusals.append(details["retry_after"])

    rate_limit_refused.connect(refused)

    async def scenario():
        executor = CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        admitted = [bool(await limiter.aadmit())]  # connects (a thread may learn
        connected = executor.submitted  # which run of memcached it reached)
        admitted.append(bool(await limiter.aadmit()))
        admitted.append(bool(limiter.admit()))  # a sync caller shares the count
        refusal = await limiter.aadmit()
        # No thread was needed where the store has an async client here.
        return admitted, refusal, executor.submitted > connected

    try:
        admitted, refusal, threads = run(scenario)
    finally:
        rate_limit_refused.disconnect(refused)
    assert admitted == [True, True, True]
    assert not refusal and 0 < refusal.retry_after <= 10
    assert abs(refusal.at - time.time()) < 5
    assert refusals == [refusal.retry_after]
    assert not limiter.admit()
    assert threads is (store.name not in NATIVE)


def test_aadmit_with_a_timeout_waits_on_the_loop(store):
    # A window long enough that the quick refusal's round trips, slow on a
    # loaded machine (0.77 s in one CI run), stay inside it.
    limiter = RateLimiter("async-wait", "2/4s")
    limiter.reset()

    async def scenario():
        ticking = Ticks()
        assert await limiter.aadmit() and await limiter.aadmit()
        started = time.monotonic()
        quick = await limiter.aadmit(timeout=0.05)  # less than the refusal says
        assert not quick and time.monotonic() - started < quick.retry_after
        admission = await limiter.aadmit(timeout=10)
        waited = time.monotonic() - started
        return admission, waited, ticking.stop()

    admission, waited, ticks = run(scenario)
    assert admission and 0.2 < waited < 10
    assert ticks >= 10  # the loop ran others while it waited


def test_an_aadmit_cancelled_while_waiting_ends_at_once():
    limiter = RateLimiter("async-cancel", "1/60s")
    limiter.reset()

    async def scenario():
        assert await limiter.aadmit()
        task = asyncio.ensure_future(limiter.aadmit(timeout=120))
        await asyncio.sleep(0.2)
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - cancelled_at

    assert run(scenario) < 1.0
    assert not limiter.admit()


def test_aadmit_misuse_and_an_unreachable_store_are_clear(own_memcached_alias):
    limiter = RateLimiter("async-down", "5/s")

    async def scenario():
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            await limiter.aadmit(timeout=-1)
        assert await limiter.aadmit()
        own_memcached_alias.stop()
        with pytest.raises(LockBackendError, match="Could not admit"):
            await limiter.aadmit()

    try:
        run(scenario)
    finally:
        own_memcached_alias.start()


async def _admit_until(
    limiter, coroutines: int, stop: threading.Event, wanted: int
) -> list[int]:
    """``coroutines`` coroutines admitting under ``limiter``, coming back when
    each refusal says, until ``stop`` is set and they have had ``wanted``
    admissions between them (on a busy machine the loop's share of a storm can
    be small: it goes on alone after the storm, still under the one limit);
    the admission times (ms)."""
    times: list[int] = []
    done = asyncio.Event()

    async def one() -> None:
        while not (stop.is_set() and len(times) >= wanted):
            admission = await limiter.aadmit()
            if admission:
                times.append(round(admission.at * 1000))
            else:
                await asyncio.sleep(min(admission.retry_after, 1.0))

    await all_until(done, [one() for _ in range(coroutines)], 300)
    return times


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window", "smooth"])
@pytest.mark.parametrize("store_name", ["memcached-meta", "redis"])
def test_many_coroutines_never_exceed_the_rate(store_name, kind, settings):
    """50 coroutines of one loop, beside a sync storm of 2 processes, from
    before it starts until it has had 200 admissions (on the stores with an
    async client here: the others' async path is their sync one, in threads)."""
    from tests.helpers import SHARED_STORES
    from tests.limits_helpers import admission_storm

    store = next(s for s in SHARED_STORES if s.name == store_name)
    settings.TASKLOCK = store.tasklock

    limiter = RateLimiter(f"async-storm-{kind}", "40/0.5s", kind=kind, burst=10)
    limiter.reset()
    stop, here = threading.Event(), []
    thread = threading.Thread(
        target=lambda: here.extend(run(_admit_until, limiter, 50, stop, 50))
    )
    thread.start()
    try:
        spec = (limiter.limit_id, "40/0.5s", {"kind": kind, "burst": 10})
        others = admission_storm(store.tasklock, spec, 2, 200)
    finally:
        stop.set()
        thread.join(60)
    assert len(here) >= 50 and len(others) >= 200
    # The loop's admissions interleave the processes': they did contend.
    assert min(here) < max(others) and min(others) < max(here)
    times = sorted(here + others)
    if kind == "window":
        assert window_violations(times, 40, 500) == 0
    else:
        assert smooth_violations(times, 40, 500, 10) == 0
