"""@single_instance under Django's own @task (django.tasks, Django 6 and later)."""

from __future__ import annotations

import django
import pytest

from django_tasklock import Lock, LockNotAcquired

pytestmark = pytest.mark.skipif(
    django.VERSION < (6, 0), reason="django.tasks exists from Django 6.0 on"
)


@pytest.fixture(autouse=True)
def _immediate_tasks(settings):
    settings.TASKS = {
        "default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}
    }
    settings.TASKLOCK = {"CACHE": "default"}


def lock_id(function, *args, **kwargs):
    from django_tasklock import lock_id_for

    return lock_id_for(function, *args, **kwargs)


def test_django_task_runs_and_skips_duplicates():
    from tests import djtasks

    assert djtasks.count_words.enqueue("a b c").return_value == 3
    held = lock_id(djtasks.count_words, "a b c")
    assert held == lock_id(djtasks.count_words.func, "a b c")
    assert held.startswith(f"{djtasks.count_words.module_path}-lock-")
    with Lock(held):
        result = djtasks.count_words.enqueue("a b c")
        assert result.status == "SUCCESSFUL"
        assert result.return_value is None  # skipped: another run holds the lock
        assert djtasks.count_words.enqueue("other words").return_value == 2


def test_django_task_context_is_not_part_of_the_key():
    from tests import djtasks

    result = djtasks.with_context.enqueue("hello")
    assert list(result.return_value) == [1, "hello"]
    # The context is left out like Celery's bound self: the key is the text's.
    key = lock_id(djtasks.with_context, "hello")
    assert key == lock_id(djtasks.with_context, text="hello")
    assert key.startswith(f"{djtasks.with_context.module_path}-lock-")
    with Lock(key):
        failed = djtasks.with_context.enqueue("hello")
        assert failed.status == "FAILED"
        assert failed.errors[0].exception_class is LockNotAcquired


@pytest.fixture
def dummy_tasks(settings):
    """A backend that stores calls and never runs them: calls stay pending."""
    settings.TASKS = {
        "default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}
    }
    yield
    from django.tasks import default_task_backend

    default_task_backend.clear()


def test_enqueue_of_a_pending_call_returns_its_result(dummy_tasks):
    from django_tasklock.calls import call_of
    from django_tasklock.status import lock_status
    from tests import djtasks

    first = djtasks.summarize.enqueue("a b")
    again = djtasks.summarize.enqueue("a b")
    assert again.id == first.id
    status = lock_status(lock_id(djtasks.summarize, "a b"))
    assert call_of(status.value) == ("queued", first.id)
    assert djtasks.summarize.enqueue("other").id != first.id


def test_enqueue_of_a_pending_call_can_raise(dummy_tasks):
    from django_tasklock import AlreadyQueued
    from tests import djtasks

    first = djtasks.summarize_once.enqueue("x")
    with pytest.raises(AlreadyQueued) as raised:
        djtasks.summarize_once.enqueue("x")
    assert raised.value.task_id == first.id


def test_the_run_takes_over_its_own_call_and_frees_it_at_the_end():
    from django_tasklock.status import lock_status
    from tests import djtasks

    result = djtasks.summarize.enqueue("a b")
    assert result.status == "SUCCESSFUL"
    assert result.return_value == ["running", result.id]
    assert not lock_status(lock_id(djtasks.summarize, "a b")).held


def test_a_duplicate_of_a_running_call_is_refused_with_its_id():
    from django_tasklock.status import lock_status
    from tests import djtasks

    result = djtasks.summarize_once.enqueue("y")
    assert result.status == "SUCCESSFUL", result.errors
    own, refused = result.return_value
    assert own == result.id
    assert refused == result.id  # ImmediateBackend cannot look results up
    assert not lock_status(lock_id(djtasks.summarize_once, "y")).held


def test_replace_is_refused_under_django_tasks():
    from django_tasklock import LockUsageError
    from tests import djtasks

    with pytest.raises(LockUsageError, match="revoke"):
        djtasks.replaced.enqueue("z")


def test_a_nested_call_that_would_wait_for_its_caller_fails_at_once():
    """ImmediateBackend runs a call in place: one enqueued from inside a run
    of the same lock id cannot wait for it (30 s here), and fails at once."""
    import time

    from django_tasklock.status import lock_status
    from tests import djtasks

    started = time.monotonic()
    result = djtasks.waits_for_itself.enqueue("w", nested=True)
    assert time.monotonic() - started < 20
    assert result.status == "SUCCESSFUL", result.errors
    assert result.return_value == ["FAILED", ["LockNotAcquired"]]
    assert not lock_status(lock_id(djtasks.waits_for_itself, "w")).held


def test_async_django_tasks_hold_their_lock_and_rate_limit_while_awaited():
    from django_tasklock import RateLimiter
    from tests import djtasks

    assert djtasks.count_letters.enqueue("abcd").return_value == [4, True]
    with Lock(lock_id(djtasks.count_letters, "abcd")):
        skipped = djtasks.count_letters.enqueue("abcd")
        assert skipped.status == "SUCCESSFUL" and skipped.return_value is None
    RateLimiter("djtasks-async-limited", "1/10s").reset()
    assert djtasks.ping_partner.enqueue(1).return_value == 1
    assert djtasks.ping_partner.enqueue(2).return_value is None  # over the limit


# The test database is SQLite in memory, whose connections Django will not
# close (that would drop the database): those of the task's threads are
# collected, and their warning ignored, within this test.
@pytest.mark.filterwarnings("ignore:unclosed database:ResourceWarning")
@pytest.mark.django_db(transaction=True)
def test_the_example_projects_async_task_imports_each_feed_once_at_a_time(capsys):
    """The demo's django.tasks step (example_project/job_demo.py): 8 enqueues
    of one feed at once, each run in a thread and event loop of its own
    (ImmediateBackend), the feed server slow: the feed imported, never two
    imports at once (measured from the recorded runs), the others skipped
    while one imported. (One feed: the test database, SQLite in memory,
    refuses two writers at once, which the demo's file does not.)"""
    import gc
    import re

    from example_project import job_demo
    from example_project.feedserver import FeedServer

    server = FeedServer(delay=0.3).start()
    try:
        urls = server.feed_urls()[:1]
        results = job_demo.enqueue_all(urls, 8)
        passed = job_demo.report(results)
    finally:
        server.stop()
        gc.collect()
    out = capsys.readouterr().out
    assert passed, out
    counts = re.search(r"(\d+) runs imported, (\d+) skipped", out)
    assert counts, out
    imported, skipped = map(int, counts.groups())
    assert imported + skipped == 8 and imported >= 1 and skipped >= 1, out


def test_async_tasks_run_as_their_publishing_mode_says():
    """``@single_instance`` on async django.tasks tasks, each published mode:
    until_finished takes its lock over from its own queued mark (the lock
    names the call running), until_started marks its call started and holds
    a lock named after it, coalesce clears its pending mark and holds the
    running lock; every lock is free after."""
    from django_tasklock.calls import QUEUE_SUFFIX
    from django_tasklock.keys import RUN_MARK
    from django_tasklock.status import lock_status
    from tests import djtasks

    finished = djtasks.asummarize.enqueue("a b")
    assert finished.status == "SUCCESSFUL", finished.errors
    assert finished.return_value == ["running", finished.id]
    started = djtasks.astarted.enqueue("s")
    assert started.status == "SUCCESSFUL", started.errors
    run_lock = lock_id(djtasks.astarted, "s") + RUN_MARK + started.id
    assert started.return_value == [["started", started.id], run_lock, True]
    coalesced = djtasks.acoalesced.enqueue("k")
    assert coalesced.status == "SUCCESSFUL", coalesced.errors
    assert coalesced.return_value == [False, ["running", coalesced.id]]
    for held in (
        lock_id(djtasks.asummarize, "a b"),
        lock_id(djtasks.astarted, "s"),
        run_lock,
        lock_id(djtasks.acoalesced, "k"),
        lock_id(djtasks.acoalesced, "k") + QUEUE_SUFFIX,
    ):
        assert not lock_status(held).held, held


def test_an_async_tasks_pending_call_is_joined(dummy_tasks):
    from django_tasklock.calls import call_of
    from django_tasklock.status import lock_status
    from tests import djtasks

    first = djtasks.asummarize.enqueue("c d")
    assert djtasks.asummarize.enqueue("c d").id == first.id
    status = lock_status(lock_id(djtasks.asummarize, "c d"))
    assert call_of(status.value) == ("queued", first.id)


def test_a_second_delivery_of_a_running_async_call_is_dropped(caplog):
    """Two deliveries of one call (the same result id) of an async
    until_finished task: the second meets the lock the first holds, which
    names this very call of a live process, and is dropped (None) while the
    first runs on."""
    import asyncio

    from django_tasklock.integrations.django_tasks import _running_result
    from django_tasklock.status import lock_status
    from tests import djtasks

    held = lock_id(djtasks.alinger, "twice", 30)

    async def scenario():
        reset = _running_result.set("call-twice")
        try:
            first = asyncio.ensure_future(djtasks.alinger.func("twice", 30))
            while not lock_status(held).held:
                await asyncio.sleep(0.01)
            second = await djtasks.alinger.func("twice", 30)
            status = lock_status(held)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            return second, list(status.call or ())
        finally:
            _running_result.reset(reset)

    with caplog.at_level("WARNING", logger="django_tasklock"):
        second, call = asyncio.run(scenario())
    assert second is None
    assert call == ["running", "call-twice"]
    assert "Dropped a second delivery" in caplog.text
    assert not lock_status(held).held  # the cancelled first released it


def test_single_instance_above_django_task_is_refused_at_decoration():
    from django.tasks import task

    from django_tasklock import single_instance

    made = task(words)
    with pytest.raises(TypeError, match="Put @single_instance under"):
        single_instance(key="text")(made)


def words(text):
    """A plain function (django.tasks takes only module-level ones)."""
    return len(text.split())
