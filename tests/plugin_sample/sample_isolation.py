"""A project's test module as a user would write it with the plugin: run
twice in one pytest run in random order by ``tests/testing/test_testing.py``. Each test
leaves state behind that would break another (or its own second run) if it
leaked: a held lock, a used-up rate limit, a full semaphore, a pending call."""

from __future__ import annotations

import os

import pytest
from django.test import SimpleTestCase

from django_tasklock import Lock, RateLimiter, Semaphore
from django_tasklock.testing import Isolation, TaskLockTestMixin

if os.environ.get("SAMPLE_CONTROL"):
    # The control: the same tests with a fixture that records and checks but
    # does not isolate; the run must fail.
    class _Shared(Isolation):
        def _isolate(self) -> None:
            pass

    @pytest.fixture
    def tasklock():
        shared = _Shared()
        shared.start()
        yield shared
        shared.stop()


@pytest.fixture(autouse=True)
def lock_cache(settings):
    settings.TASKLOCK = {"CACHE": os.environ["SAMPLE_CACHE"], "LOCK_EXPIRE": 60}


def test_leaves_a_lock_held_on_purpose(tasklock):
    lock = Lock("sample-shared")
    assert lock.acquire()
    tasklock.assert_held("sample-shared", by=lock)
    tasklock.allow_held("sample-shared")


def test_finds_the_lock_free(tasklock):
    tasklock.assert_free("sample-shared")
    with Lock("sample-shared"):
        tasklock.assert_held("sample-shared")
        assert not Lock("sample-shared").acquire()
    tasklock.assert_refused("sample-shared", times=1)


def test_uses_up_a_rate_limit(tasklock):
    limiter = RateLimiter("sample-limit", "1/h")
    assert limiter.admit()
    assert not limiter.admit()
    tasklock.assert_rate_limited("sample-limit", retry_after=3600, within=5, times=1)


def test_fills_a_semaphore(tasklock):
    first, second = Semaphore("sample-slots", 2), Semaphore("sample-slots", 2)
    assert first.acquire() and second.acquire()
    assert not Semaphore("sample-slots", 2).acquire()
    tasklock.allow_held()


def test_a_pending_call_is_joined(tasklock):
    from tests.tasks import queue_long_when_told

    first = queue_long_when_told.delay("sample-call")
    again = queue_long_when_told.delay("sample-call")
    assert again.id == first.id
    tasklock.assert_deduplicated(queue_long_when_told, action="joined", times=1)


class SampleCase(TaskLockTestMixin, SimpleTestCase):
    def setUp(self):
        from django.test import override_settings

        tasklock = {"CACHE": os.environ["SAMPLE_CACHE"], "LOCK_EXPIRE": 60}
        chosen = override_settings(TASKLOCK=tasklock)
        chosen.enable()
        self.addCleanup(chosen.disable)
        super().setUp()

    def test_leaves_a_lock_held_on_purpose(self):
        assert Lock("sample-case").acquire()
        self.tasklock.allow_held("sample-case")

    def test_finds_the_lock_free(self):
        self.tasklock.assert_free("sample-case")
        with Lock("sample-case"):
            self.tasklock.assert_held("sample-case")
