"""Tasks of the end-to-end benchmark: the same body with and without a lock, and
under the libraries users would pick instead (celery_once's ``QueueOnce`` and
celery-singleton's ``Singleton``, both deduplicating at ``.delay()``).

Every finished task (run or skipped) counts itself in Redis, so the benchmark
knows when the queue has drained, and every body that runs records its start and
end there, so overlaps of one argument are counted, not assumed. The ``*_retry``
tasks retry themselves once: each call must run twice.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

import redis  # noqa: E402
from celery import Celery  # noqa: E402
from celery.signals import task_postrun, task_prerun  # noqa: E402
from celery_once import QueueOnce  # noqa: E402
from celery_singleton import Singleton  # noqa: E402

from django_tasklock import rate_limited, single_instance  # noqa: E402

DONE = "bench:done"
RUNS = "bench:runs"
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


def _counter_client() -> redis.Redis:
    global _counter
    if _counter is None:
        _counter = redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"][:-2] + "/2")
    return _counter


def work(n: int = 0) -> None:
    started = time.monotonic()
    time.sleep(0.005)  # a short task: lock overhead shows most here
    _counter_client().rpush(RUNS, json.dumps([n, started, time.monotonic()]))


@app.task
def plain(n: int) -> None:
    work(n)


@app.task
@single_instance
def locked(n: int) -> None:
    work(n)


@app.task
@single_instance(cache="redis")
def locked_redis(n: int) -> None:
    work(n)


@app.task(bind=True)
@single_instance(mode="until_finished")
def until_finished(self: Any, n: int) -> None:
    work(n)


@app.task(bind=True)
@single_instance(mode="until_finished", cache="redis")
def until_finished_redis(self: Any, n: int) -> None:
    work(n)


@app.task(base=QueueOnce, once={"graceful": True})
def once(n: int) -> None:
    work(n)


@app.task(base=Singleton)
def singleton(n: int) -> None:
    work(n)


def _retry_once(task: Any, n: int) -> None:
    work(n)
    if task.request.retries == 0:
        raise task.retry(countdown=0.05, max_retries=1)


@app.task(bind=True)
def plain_retry(self: Any, n: int) -> None:
    _retry_once(self, n)


@app.task(bind=True)
@single_instance(mode="until_finished")
def until_finished_retry(self: Any, n: int) -> None:
    _retry_once(self, n)


@app.task(bind=True, base=QueueOnce, once={"graceful": True})
def once_retry(self: Any, n: int) -> None:
    _retry_once(self, n)


@app.task(bind=True, base=Singleton)
def singleton_retry(self: Any, n: int) -> None:
    _retry_once(self, n)


# The killed-worker probe (bench.measure_killed): a call whose pool process is
# SIGKILLed mid-run. The peers' lock timeouts are cut from their defaults (an
# hour for celery_once, none for celery-singleton) so that the probe ends.
STUCK = "bench:stuck"
STUCK_TIMEOUT = int(os.environ.get("TASKLOCK_BENCH_STUCK_TIMEOUT", "30"))


def stuck(n: int) -> None:
    """Record the run (argument, pid, start), then sit until SIGKILLed."""
    started = time.monotonic()
    _counter_client().rpush(STUCK, json.dumps([n, os.getpid(), started]))
    time.sleep(600)


@app.task(bind=True)
@single_instance(mode="until_finished", expire=600)
def until_finished_stuck(self: Any, n: int) -> None:
    stuck(n)


@app.task(base=QueueOnce, once={"graceful": True, "timeout": STUCK_TIMEOUT})
def once_stuck(n: int) -> None:
    stuck(n)


@app.task(base=Singleton, lock_expiry=STUCK_TIMEOUT)
def singleton_stuck(n: int) -> None:
    stuck(n)


@task_postrun.connect
def count_done(sender: Any = None, state: str | None = None, **kwargs: Any) -> None:
    if state != "RETRY":  # a retried call counts once, when it is over
        _counter_client().incr(DONE)


# Rate limits (benchmarks/rates.py): every real pool process hammering one
# limit; calls over a limit sent again when it says; Celery's own rate_limit.
ADMITTED = "bench:admitted"
RATE_RUNS = "bench:rate-runs"


@app.task
def hammer_limit(
    limiter: list[Any], start_at: float, wanted: int, give_up: float
) -> int:
    """Admit under one limit until ``wanted`` admissions between every process
    doing this (counted in Redis), each refusal followed by a sleep of the time
    it names; every admission's time (ms) goes to a Redis list."""
    from django_tasklock import RateLimiter

    limit_id, rate, kind, burst, cache = limiter
    rate_limiter = RateLimiter(limit_id, rate, kind=kind, burst=burst, cache=cache)
    counter = _counter_client()
    while time.time() < start_at:
        time.sleep(0.005)
    admitted = 0
    ends = time.monotonic() + give_up
    count = f"{ADMITTED}:{limit_id}:count"
    # Looked at before each admission: a process that slept through the last
    # ones must not take one more from a period nobody else is using.
    while time.monotonic() < ends and int(counter.get(count) or 0) < wanted:
        admission = rate_limiter.admit()
        if admission:
            admitted += 1
            counter.rpush(f"{ADMITTED}:{limit_id}", round(admission.at * 1000))
            counter.incr(count)
        else:
            time.sleep(min(admission.retry_after, 1.0))
    return admitted


def _ran(kind: str, n: int) -> None:
    """Record a run: its argument and when its body started (the same for
    Celery's rate_limit and @rate_limited, so their busiest seconds compare)."""
    _counter_client().rpush(f"{RATE_RUNS}:{kind}", json.dumps([n, time.time()]))


#: Deliveries of the calls of the rate-limit benchmark, by kind: a call sent
#: again for its turn is delivered once more.
DELIVERIES = "bench:rate-deliveries"
_DELIVERED_KINDS = {
    "benchmarks.celery_bench.calls_window": "window",
    "benchmarks.celery_bench.calls_smooth": "smooth",
    "benchmarks.celery_bench.limiter_beside_celery": "limiter",
    "benchmarks.celery_bench.celery_rate_limited": "celery",
}


@task_prerun.connect
def count_delivery(sender: Any = None, **kwargs: Any) -> None:
    kind = _DELIVERED_KINDS.get(getattr(sender, "name", ""))
    if kind is not None:
        _counter_client().incr(f"{DELIVERIES}:{kind}")


@app.task(bind=True, max_retries=0)
@rate_limited("20/s", name="bench-calls-window")
def calls_window(self: Any, n: int) -> None:
    _ran("window", n)


@app.task(bind=True, max_retries=0)
@rate_limited("20/s", name="bench-calls-smooth", kind="smooth", burst=5)
def calls_smooth(self: Any, n: int) -> None:
    _ran("smooth", n)


@app.task(rate_limit="10/s")
def celery_rate_limited(n: int) -> None:
    _ran("celery", n)


@app.task(bind=True, max_retries=0)
@rate_limited("10/s", name="bench-calls-beside-celery")
def limiter_beside_celery(self: Any, n: int) -> None:
    _ran("limiter", n)
