"""Tasks of the end-to-end benchmark: the same body with and without the lock.

Every finished task (run or skipped) counts itself in Redis, so the benchmark
knows when the queue has drained.
"""

from __future__ import annotations

import os
import time
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.signals import task_postrun  # noqa: E402

from django_tasklock import single_instance  # noqa: E402

DONE = "bench:done"
app = Celery("bench", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("TASKLOCK_BENCH_BROKER", "memory://"),
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
_counter: redis.Redis | None = None


def work() -> None:
    time.sleep(0.005)  # a short task: lock overhead shows most here


@app.task
def plain(n: int) -> None:
    work()


@app.task
@single_instance
def locked(n: int) -> None:
    work()


@task_postrun.connect
def count_done(sender: Any = None, **kwargs: Any) -> None:
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"][:-2] + "/2")
    _counter.incr(DONE)
