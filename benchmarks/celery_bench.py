"""Tasks of the end-to-end benchmark: the same body with and without a lock, and
under the libraries users would pick instead (celery_once's ``QueueOnce`` and
celery-singleton's ``Singleton``, both deduplicating at ``.delay()``).

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
from celery_once import QueueOnce  # noqa: E402
from celery_singleton import Singleton  # noqa: E402

from django_tasklock import single_instance  # noqa: E402

DONE = "bench:done"
_PEERS = os.environ.get("TASKLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")[:-2] + "/5"
app = Celery("bench", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("TASKLOCK_BENCH_BROKER", "memory://"),
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # celery_once and celery-singleton keep their locks in Redis (database 5).
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": _PEERS, "default_timeout": 600},
    },
    singleton_backend_url=_PEERS,
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


@app.task
@single_instance(cache="redis")
def locked_redis(n: int) -> None:
    work()


@app.task(base=QueueOnce, once={"graceful": True})
def once(n: int) -> None:
    work()


@app.task(base=Singleton)
def singleton(n: int) -> None:
    work()


@task_postrun.connect
def count_done(sender: Any = None, **kwargs: Any) -> None:
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"][:-2] + "/2")
    _counter.incr(DONE)
