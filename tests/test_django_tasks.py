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
