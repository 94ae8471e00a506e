import os

import pytest


@pytest.fixture(scope="session")
def celery_worker_in_process():
    """With PROJ_EAGER=0, a real Celery worker in this process (threads), so
    that it runs with each test's settings, the tasklock fixture's too."""
    if os.environ.get("PROJ_EAGER") == "1":
        yield None
        return
    from celery.contrib.testing.worker import start_worker
    from proj.celery import app

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        yield app


@pytest.fixture
def run(celery_worker_in_process):
    """Call a task and return its result, eagerly or through the worker."""

    def call(task, *args, **kwargs):
        return task.delay(*args, **kwargs).get(timeout=30)

    return call
