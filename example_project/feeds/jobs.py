"""The feed import as a django.tasks async task (Django 6 and later): one run
at a time per feed.

``@single_instance`` on an ``async def`` function takes the run's lock on the
event loop, holds it while the import is awaited and releases it after; a run
that finds the feed being imported by another is skipped (``None``). The
import itself (HTTP fetch, parsing, the ORM) is blocking work, handed to an
executor thread, while the lock stays the loop's. Its writes carry the lock's
fencing token, as the Celery tasks' do.

Imported only where ``django.tasks`` exists (``example_project.job_demo``
says so on Django 5.2).
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import connection
from django.tasks import task

from django_tasklock import Lock, current_lock, single_instance

from .tasks import _import_and_record

#: How the imports this task makes are recorded (ImportRun.task_name).
JOB_NAME = "example_project.feeds.jobs.refresh_job"


@task
@single_instance(on_contention="skip")
async def refresh_job(feed_url: str) -> str | None:
    """Import ``feed_url`` now: its url, or None if another run imports it."""
    lock = current_lock()
    assert isinstance(lock, Lock)  # (a Semaphore with limit=; none here)
    fence = await lock.afence()
    return await sync_to_async(_import, thread_sensitive=False)(feed_url, fence)


def _import(feed_url: str, fence: int | None) -> str:
    """The import, on an executor thread, whose database connection is closed
    after it: the thread may end with its loop (ImmediateBackend runs each
    task in a loop of its own) and would leave the connection open."""
    try:
        return _import_and_record(feed_url, JOB_NAME, fence)
    finally:
        connection.close()
