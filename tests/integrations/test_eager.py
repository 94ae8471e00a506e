"""Eager and in-place calls (``task_always_eager``, ``task.apply()``) behave
as a worker's calls do, for every mode and contention policy, on the real
stores: the lock taken and freed, a duplicate of a pending call joined or
refused as ``on_duplicate`` says, and a call of the same lock id from inside
a run (nested) given a clear outcome at once, never a wait on itself nor a
lock or mark left behind. The ``tasklock`` fixture (the project's plugin) fails
any test here that leaves a lock held."""

from __future__ import annotations

import time

import pytest
from celery.result import AsyncResult, EagerResult

from django_tasklock import AlreadyQueued, LockNotAcquired, RateLimited, lock_id_for
from django_tasklock.calls import QUEUE_SUFFIX
from tests import eager_tasks as tasks

STORES = pytest.mark.parametrize(
    "cache", ["default", "redis"], ids=["memcached", "redis"]
)


@pytest.fixture(autouse=True)
def on_store(request, settings):
    cache = request.node.callspec.params.get("cache", "default")
    settings.TASKLOCK = {"CACHE": cache, "LOCK_EXPIRE": 60}
    tasks.ran.clear()
    return cache


@pytest.fixture
def isolated(settings, on_store, tasklock):
    """The plugin's fixture, started after the store is chosen."""
    return tasklock


def pending(task, key):
    """A call of ``task`` sent to the broker and not run yet (another
    process's call waiting for a worker): eager mode off for its send."""
    tasks.app.conf.task_always_eager = False
    try:
        return task.delay(key)
    finally:
        tasks.app.conf.task_always_eager = True


MODES = [tasks.skip, tasks.until_finished, tasks.until_started, tasks.coalesce]


@STORES
@pytest.mark.parametrize("task", MODES, ids=lambda task: task.name)
def test_an_eager_call_runs_holding_its_lock_and_frees_it(cache, task, isolated):
    result = task.delay("a")
    assert isinstance(result, EagerResult) and result.get() == "ran a"
    lock_id = lock_id_for(task, "a")
    isolated.assert_free(lock_id)
    isolated.assert_free(lock_id + QUEUE_SUFFIX)
    # Held while the body ran (until_started: the run's own lock, named
    # after the call): its acquire is on record, and its release.
    taken = [e["lock_id"] for e in isolated.named("lock_acquired")]
    freed = [e["lock_id"] for e in isolated.named("lock_released")]
    assert len(taken) == 1 and taken[0].startswith(lock_id) and freed == taken


@STORES
def test_an_eager_duplicate_of_a_pending_call_joins_it(cache, isolated):
    """As a worker's caller would: the pending call's result, not a new run."""
    first = pending(tasks.until_finished, "b")
    again = tasks.until_finished.delay("b")
    assert isinstance(again, AsyncResult) and not isinstance(again, EagerResult)
    assert again.id == first.id
    assert tasks.ran == []
    isolated.assert_deduplicated(tasks.until_finished, action="joined", times=1)
    # So does apply(), Celery's other way to run a call in place.
    applied = tasks.until_finished.apply(("b",))
    assert applied.id == first.id and tasks.ran == []


@STORES
def test_an_eager_duplicate_is_refused_when_on_duplicate_says_raise(cache, isolated):
    first = pending(tasks.until_finished_raise, "c")
    with pytest.raises(AlreadyQueued) as raised:
        tasks.until_finished_raise.delay("c")
    assert raised.value.task_id == first.id and tasks.ran == []
    isolated.assert_deduplicated(action="raised", times=1)


@STORES
def test_an_eager_call_with_a_task_id_of_its_own_is_never_merged(cache, isolated):
    """As when sent: it runs in place and meets the pending call's lock
    (skipped, the until_finished default)."""
    pending(tasks.until_finished, "d")
    result = tasks.until_finished.apply_async(("d",), task_id="mine")
    assert result.id == "mine" and result.get() is None and tasks.ran == []
    isolated.assert_refused(lock_id_for(tasks.until_finished, "d"), times=1)


@STORES
def test_an_eager_retry_keeps_the_calls_lock_and_frees_it_at_the_end(cache, isolated):
    """Celery runs an eager retry in place, at once (with
    task_eager_propagates it raises Retry instead, with or without a lock)."""
    tasks.app.conf.task_eager_propagates = False
    try:
        result = tasks.flaky.delay("e", failures=2)
    finally:
        tasks.app.conf.task_eager_propagates = True
    assert result.get() == 2
    assert tasks.ran == [("eager.flaky", "e", "ran after 2 retries")]
    isolated.assert_free(lock_id_for(tasks.flaky, "e", failures=2))


# -- nested: a call of the same lock id from inside a run ----------------------


@STORES
@pytest.mark.parametrize("task", [tasks.skip, tasks.until_started])
def test_a_nested_call_that_would_skip_or_run_does_so(cache, task, isolated):
    """while_running skips it (None, as a worker's duplicate run); an
    until_started call runs (the outer call has started: a new one may)."""
    outer = task.delay("f", nested=True).get()
    inner = EagerResult(outer["id"], None, "SUCCESS")
    kinds = [what for _name, _key, what in tasks.ran]
    if task is tasks.skip:
        assert kinds == ["outer"]
        isolated.assert_refused(lock_id_for(task, "f"), times=1)
    else:
        assert kinds == ["ran", "outer"]
    assert inner.id != outer["outer"]
    isolated.assert_free(lock_id_for(task, "f"))


@STORES
def test_a_nested_until_finished_call_joins_the_running_call(cache, isolated):
    """As in a worker: the running call's result, its own id."""
    outer = tasks.until_finished.delay("g", nested=True).get()
    assert outer["id"] == outer["outer"]
    assert [what for _name, _key, what in tasks.ran] == ["outer"]
    isolated.assert_deduplicated(tasks.until_finished, action="joined", times=1)
    isolated.assert_free(lock_id_for(tasks.until_finished, "g"))


@STORES
@pytest.mark.parametrize("task", [tasks.wait, tasks.retry, tasks.coalesce])
def test_a_nested_call_that_would_wait_fails_at_once(cache, task, isolated):
    """It cannot wait for its own caller (30 s here) nor be sent again: it
    raises LockNotAcquired at once, saying why, and leaves no pending mark."""
    started = time.monotonic()
    outer = task.delay("h", nested=True).get()
    assert time.monotonic() - started < 20  # far less than the 30 s wait
    assert outer["raised"] == "LockNotAcquired", outer
    assert "cannot wait for its own caller" in outer["message"]
    lock_id = lock_id_for(task, "h")
    isolated.assert_free(lock_id)
    isolated.assert_free(lock_id + QUEUE_SUFFIX)


@STORES
def test_an_eager_coalesce_call_that_waits_in_vain_fails_visibly(
    cache, isolated, settings
):
    """Held by another process past its wait, a worker's coalesce call goes
    back to the broker; an eager one cannot, and raises instead of running
    again in place (and again)."""
    from django_tasklock import Lock

    task = tasks.coalesce_briefly  # (waits 2 s, where coalesce waits 30)
    other = Lock(lock_id_for(task, "i"), expire=60)
    assert other.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(LockNotAcquired, match="cannot be sent back"):
            task.apply_async(("i",), kwargs={}, countdown=0).get()
        assert time.monotonic() - started >= 2  # it waited first
    finally:
        assert other.release()
    isolated.assert_free(lock_id_for(task, "i") + QUEUE_SUFFIX)
    assert tasks.ran == []


# -- rate limits and the test's clock ---------------------------------------------


@STORES
def test_an_eager_call_over_its_rate_limit_raises_until_the_clock_moves(
    cache, isolated
):
    """An eager call has no queue to wait in: refused, it raises RateLimited
    (the call did not run; retry_after says when it may). The test moves the
    clock instead of sleeping an hour, on the client's clock (memcached) and
    on Redis's own (the limit's Lua script)."""
    assert tasks.limited.delay("j").get() == "ran j"
    with pytest.raises(RateLimited) as refused:
        tasks.limited.delay("j")
    assert 3590 < refused.value.retry_after <= 3600
    isolated.assert_rate_limited(retry_after=3600, within=10, times=1)
    isolated.advance(refused.value.retry_after - 5)
    with pytest.raises(RateLimited) as still:
        tasks.limited.delay("j")
    assert 0 < still.value.retry_after <= 6
    isolated.advance(6)
    assert tasks.limited.delay("j").get() == "ran j"
    assert [what for _name, _key, what in tasks.ran] == ["ran", "ran"]


@STORES
def test_expire_ends_a_lock_as_its_expiry_would(cache, isolated):
    from django_tasklock import Lock

    holder = Lock("expiring", expire=3600)
    assert holder.acquire()
    isolated.expire("expiring")
    isolated.assert_free("expiring")
    taker = Lock("expiring", expire=60)
    assert taker.acquire()
    assert not holder.release()  # the holder finds it lost, as after an expiry
    assert taker.release()
