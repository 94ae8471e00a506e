"""The Celery app of the tests: broker from the environment, tasks in tests.tasks.

Worker processes started by the tests import this module (``celery -A
tests.celery_app worker``), so it sets Django up itself.
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from celery import Celery  # noqa: E402

app = Celery("tests", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("TASKLOCK_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("TASKLOCK_TEST_RESULTS") or None,
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
if os.environ.get("TASKLOCK_TEST_VISIBILITY"):
    # Redelivery: a message not acked within the visibility timeout goes back
    # to the queue, and kombu looks for such messages every second.
    app.conf.task_acks_late = True
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["TASKLOCK_TEST_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if os.environ.get("TASKLOCK_TEST_REJECT_ON_LOST"):
    # A pool process killed mid-call (an OOM kill): its message goes back to
    # the queue and runs again.
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True
if os.environ.get("TASKLOCK_TEST_BEAT"):
    app.conf.beat_schedule = {
        "often": {
            "task": "tests.tasks.finish_once",
            "schedule": float(os.environ["TASKLOCK_TEST_BEAT"]),
            "args": ("beat",),
            "kwargs": {"seconds": 1.0},
        }
    }
app.autodiscover_tasks(["tests"], related_name="tasks", force=True)
if os.environ.get("TASKLOCK_TEST_UNBOUND_RETRY"):
    app.conf.include = ["tests.unbound_retry"]
