"""A task that asks to retry on contention but is not bound: the worker of
tests/project/test_startup_refusals.py refuses to start with it registered (imported
by tests/celery_app.py only when TASKLOCK_TEST_UNBOUND_RETRY is set)."""

from __future__ import annotations

from django_tasklock import single_instance
from tests.celery_app import app


@app.task
@single_instance(on_contention="retry")
def refresh_unbound(url):
    return url
