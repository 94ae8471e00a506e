"""Tasks the tests run, in-process and in real worker processes.

Every run records when it started and ended, and with what, in the test session's
private Redis, so tests measure overlaps instead of assuming them.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery.signals import task_postrun, task_prerun

from django_tasklock import Lock, current_lock, rate_limited, single_instance
from django_tasklock.signals import call_parked
from tests.celery_app import app


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"][:-2] + "/2")


def record(run_key: str, started: float, **details: object) -> None:
    """Store one run of ``run_key``: its start, its end (now), pid and details."""
    entry = {"start": started, "end": time.monotonic(), "pid": os.getpid(), **details}
    with _redis() as client:
        client.rpush(f"runs:{run_key}", json.dumps(entry))


def runs(run_key: str) -> list[dict[str, object]]:
    with _redis() as client:
        return [json.loads(item) for item in client.lrange(f"runs:{run_key}", 0, -1)]


def ignored() -> list[str]:
    """Task ids of the runs that ended with Celery's Ignore (dropped copies)."""
    with _redis() as client:
        return [item.decode() for item in client.lrange("ignored", 0, -1)]


@task_postrun.connect
def _record_ignored(task_id: str | None = None, state: str | None = None, **_):
    if state == "IGNORED" and task_id and os.environ.get("TASKLOCK_TEST_REDIS"):
        with _redis() as client:
            client.rpush("ignored", task_id)


def deliveries(task_ids: list[str]) -> tuple[int, int]:
    """(deliveries begun, deliveries ended) of the calls ``task_ids``, in
    every worker process: a call sent again is delivered once more."""
    with _redis() as client:
        begun = client.hmget("delivered", task_ids)
        ended = client.hmget("ended", task_ids)
    return sum(int(n or 0) for n in begun), sum(int(n or 0) for n in ended)


@task_prerun.connect
def _count_delivery(task_id: str | None = None, **_):
    if task_id and os.environ.get("TASKLOCK_TEST_REDIS"):
        with _redis() as client:
            client.hincrby("delivered", task_id, 1)


@task_postrun.connect
def _count_end(task_id: str | None = None, **_):
    if task_id and os.environ.get("TASKLOCK_TEST_REDIS"):
        with _redis() as client:
            client.hincrby("ended", task_id, 1)


def forget_runs() -> None:
    with _redis() as client:
        client.flushdb()


@app.task(bind=True)
@single_instance(expire=60)
def import_feed(self, feed_url, seconds=0.3, tag=""):
    """Skip duplicates (the default)."""
    started = time.monotonic()
    time.sleep(seconds)
    record(feed_url, started, tag=tag, task=self.name)
    return feed_url


@app.task(bind=True, max_retries=200)
@single_instance(key="feed_url", on_contention="retry", countdown=0.1, expire=60)
def refresh_feed(self, feed_url, call, seconds=0.2):
    """Every call runs once: duplicates come back later (key ignores ``call``)."""
    started = time.monotonic()
    time.sleep(seconds)
    record(feed_url, started, call=call, retries=self.request.retries)
    return call


@app.task(bind=True, max_retries=2)
@single_instance(key="feed_url", on_contention="retry", countdown=0)
def refresh_limited(self, feed_url):
    """Gives up after two retries, as its own max_retries says."""
    return feed_url


@app.task
@single_instance(key=["feed_url"], on_contention="wait", timeout=60, expire=60)
def wait_feed(feed_url, call, seconds=0.2):
    """Every call runs once: duplicates wait for the lock."""
    started = time.monotonic()
    time.sleep(seconds)
    record(feed_url, started, call=call)
    return call


@app.task(bind=True, max_retries=3)
@single_instance
def retries_itself(self, name):
    """Calls self.retry() once from inside the locked body."""
    started = time.monotonic()
    record(name, started, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return "done"


@app.task
@single_instance(on_contention="raise")
def rebuild_index():
    return "rebuilt"


# The limits leave the lock's acquire (a fresh child's first: its connections,
# the restart check) a few seconds on a loaded machine: at 0.5 s and 1 s a CI run
# beside five other suites hit them before the body had recorded its start.
@app.task(bind=True, soft_time_limit=3)
@single_instance(expire=60)
def overruns_soft_limit(self, name):
    """Runs into its soft time limit; the lock must go with the exception."""
    record(name, time.monotonic())
    time.sleep(30)


@app.task(bind=True, time_limit=3)
@single_instance(expire=5)
def overruns_hard_limit(self, name):
    """Killed at its hard time limit: the lock stays only until it expires."""
    record(name, time.monotonic())
    time.sleep(30)


@app.task
@single_instance(key="name", expire=3)
def hold_for(name, seconds):
    """Holds its lock for ``seconds``; the fault suite kills it midway."""
    record(name, time.monotonic())
    time.sleep(seconds)


@app.task(bind=True, time_limit=30)
@single_instance(key="name", expire=3, renew=True, on_lost="raise")
def lifecycle(self, name, seconds=0.0):
    """Reports what its lock looks like from inside the body."""
    lock = current_lock()
    assert lock is not None
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        lock.check()  # raises LockLost once the heartbeat found the lock gone
        time.sleep(0.05)
    record(name, started, renewing=lock.renewing, max_hold=lock.max_hold)
    return lock.fence


@app.task(bind=True)
@single_instance(expire=60)
def limited_by_app(self, name):
    lock = current_lock()
    return None if lock is None else lock.max_hold


@app.task
@single_instance(key="name", expire=3, renew=True)
def long_renewed(name, seconds, call):
    """Runs well past its 3 s expiry; renewal keeps its lock."""
    started = time.monotonic()
    time.sleep(seconds)
    record(name, started, call=call)
    return call


@app.task
@single_instance(key="name", expire=3)
def long_unrenewed(name, seconds, call):
    """The same without renewal: the control of the test that uses both."""
    started = time.monotonic()
    time.sleep(seconds)
    record(name, started, call=call)
    return call


@app.task(bind=True, max_retries=0)
@single_instance(key="item", expire=60)
def process_tree(self, item, children=(), how="direct"):
    """Processes ``item``: a leaf retries; a parent runs each child in this thread
    (a direct call, or eager ``apply()``) and then reports whether its own lock
    is still held, as another worker would find it."""
    from celery.exceptions import MaxRetriesExceededError, Retry

    if not children:
        raise self.retry(countdown=0)
    for child in children:
        try:
            if how == "direct":
                process_tree(child)
            else:
                process_tree.apply(args=(child,))
        except (Retry, MaxRetriesExceededError):
            pass
    lock = current_lock()
    assert lock is not None
    rival = Lock(lock.lock_id)
    taken_by_rival = rival.acquire()
    if taken_by_rival:
        rival.release()
    return {"owned": lock.owned(), "taken_by_rival": taken_by_rival}


@app.task(bind=True, max_retries=500)
@single_instance(
    key="tenant", limit=2, expire=60, on_contention="retry", countdown=0.05
)
def export_for(self, tenant, call, seconds=0.3):
    """At most two exports per tenant at once; every call runs once, later."""
    started = time.monotonic()
    time.sleep(seconds)
    record(tenant, started, call=call, retries=self.request.retries)
    return call


# -- enqueue-time modes (tests/integrations/test_calls.py) ---------------------------------------


def _ran(self, key: str, started: float, **details: object) -> str:
    record(key, started, task_id=self.request.id, **details)
    return f"{key}:{self.request.id}"


@app.task(bind=True)
@single_instance(mode="until_finished", expire=60)
def finish_once(self, key, seconds=0.3):
    """Not sent while an identical call is pending or running."""
    started = time.monotonic()
    time.sleep(seconds)
    return _ran(self, key, started)


@app.task(bind=True)
@single_instance(mode="until_finished", on_duplicate="raise", expire=60)
def finish_once_or_raise(self, key):
    return _ran(self, key, time.monotonic())


@app.task(bind=True)
@single_instance(mode="until_finished", key="key", on_duplicate="replace", expire=60)
def latest_wins(self, key, version):
    """The key ignores ``version``: a pending call is replaced by a newer one."""
    record(key, time.monotonic(), version=version)
    return version


@app.task(bind=True, max_retries=3)
@single_instance(mode="until_finished", expire=60)
def finish_retrying(self, key, failures=2, seconds=0.2, countdown=0.5):
    """Retries itself ``failures`` times; then succeeds (or runs out)."""
    started = time.monotonic()
    time.sleep(seconds)
    record(key, started, task_id=self.request.id, retries=self.request.retries)
    if self.request.retries < failures:
        raise self.retry(countdown=countdown)
    return self.request.retries


@app.task(
    bind=True,
    autoretry_for=(ValueError,),
    max_retries=2,
    retry_kwargs={"countdown": 0.5},
)
@single_instance(mode="until_finished", expire=60)
def finish_autoretry(self, key, failures=1):
    """Fails with ValueError ``failures`` times; autoretry_for retries it."""
    record(key, time.monotonic(), task_id=self.request.id, retries=self.request.retries)
    if self.request.retries < failures:
        raise ValueError(f"failure {self.request.retries}")
    return self.request.retries


@app.task(bind=True)
@single_instance(mode="coalesce", expire=60, timeout=60)
def coalesced(self, key, seconds=1.0):
    """Work that arrives while a run is in progress is picked up by one more."""
    started = time.monotonic()
    time.sleep(seconds)
    return _ran(self, key, started)


@app.task(bind=True)
@single_instance(mode="until_started", expire=60)
def debounced(self, key, seconds=0.5):
    """At most one pending call; a started one no longer counts."""
    started = time.monotonic()
    time.sleep(seconds)
    return _ran(self, key, started)


@app.task(bind=True)
@single_instance(mode="until_finished", expire=3)
def finish_killable(self, key, seconds=30.0):
    """Runs long with a 3 s lock; a test SIGKILLs its worker midway."""
    record(key, time.monotonic(), task_id=self.request.id, phase="start")
    time.sleep(seconds)
    return _ran(self, key, time.monotonic())


@app.task(bind=True)
@single_instance(expire=60)
def skip_duplicate(self, key, seconds=0.0):
    """The default mode, for canvas members that meet a held lock."""
    time.sleep(seconds)
    return _ran(self, key, time.monotonic())


@app.task
def add_one(value):
    """A chain's next link: fails on None."""
    return value + "+1"


@app.task
def gather(results):
    """A chord's callback."""
    return results


@app.task
def raise_lock_error(kind: str, lock_id: str) -> None:
    """Fail with one of django_tasklock's exceptions, for the result backend."""
    from django_tasklock import LockBackendError, LockLost

    if kind == "backend":
        raise LockBackendError("Could not take the lock", lock_id=lock_id, store="s")
    raise LockLost(lock_id, 3.5)


@app.task(bind=True)
@single_instance(mode="until_finished", expire=60)
def finish_with_options(self, name, options):
    """until_finished with a dict argument (int keys turn to str in JSON)."""
    return _ran(self, name, time.monotonic(), keys=sorted(options))


def _go_flag(key: str) -> str:
    return f"go:{key}"


def let_go(key: str) -> None:
    """Let every run of ``finish_when_told``/``skip_when_told`` for ``key`` end."""
    with _redis() as client:
        client.set(_go_flag(key), 1)


def _wait_to_be_told(key: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    with _redis() as client:
        while not client.exists(_go_flag(key)) and time.monotonic() < deadline:
            time.sleep(0.05)


def _run_until_told(self, key: str, **details: object) -> str:
    """Record the run's start, wait until the test lets ``key`` go, record its end."""
    started = time.monotonic()
    record(key, started, task_id=self.request.id, phase="start", **details)
    _wait_to_be_told(key)
    return _ran(self, key, started)


@app.task(bind=True)
@single_instance(mode="until_finished", expire=60)
def finish_when_told(self, key):
    """until_finished, running until the test lets it go."""
    return _run_until_told(self, key)


@app.task(bind=True)
@single_instance(expire=60)
def skip_when_told(self, key):
    """while_running, running until the test lets it go."""
    return _run_until_told(self, key)


# Crash recovery (tests/locks/test_recovery_workers.py): locks that would last ten
# minutes, held by runs a test SIGKILLs.


@app.task(bind=True)
@single_instance(expire=600)
def hold_long_when_told(self, key):
    """while_running with a 600 s lock, running until the test lets it go."""
    return _run_until_told(self, key)


@app.task(bind=True)
@single_instance(mode="until_finished", expire=600)
def queue_long_when_told(self, key):
    """until_finished with a 600 s lock, running until the test lets it go."""
    return _run_until_told(self, key)


@app.task(bind=True)
@single_instance(key="key", limit=2, expire=600)
def slot_long_when_told(self, key, n):
    """Two at a time per key, 600 s slots, running until the test lets it go."""
    return _run_until_told(self, key, n=n)


@app.task(bind=True)
@single_instance(expire=600, on_contention="wait")
def wait_long_when_told(self, key):
    """Waits for a 600 s lock held elsewhere, then runs until told."""
    return _run_until_told(self, key)


# Rate limits (tests/limits/test_limits_workers.py): every call runs once, at the
# limit's pace, though each task allows no retries of its own.


def _limited(self, key: str, n: int) -> int:
    from django_tasklock import current_admission

    admission = current_admission()
    assert admission is not None
    record(
        key,
        time.monotonic(),
        task_id=self.request.id,
        n=n,
        at=round(admission.at * 1000),
        retries=self.request.retries,
    )
    return n


@app.task(bind=True, max_retries=0)
@rate_limited("4/s", name="tests.limited-window")
def limited_window(self, key, n):
    return _limited(self, key, n)


@app.task(bind=True, max_retries=0)
@rate_limited("4/s", name="tests.limited-smooth", kind="smooth", burst=2, cache="redis")
def limited_smooth(self, key, n):
    return _limited(self, key, n)


@app.task(bind=True, max_retries=0)
@rate_limited("10/s", name="tests.limited-backlog")
def limited_backlog(self, key, n):
    return _limited(self, key, n)


@app.task(bind=True, max_retries=0)
@rate_limited("2/s", name="tests.limited-until-finished")
@single_instance(mode="until_finished", expire=60)
def limited_until_finished(self, key, n):
    """A rate limit above an enqueue-time lock: a call sent again for its turn
    keeps its place (the lock is handed to the message that carries it)."""
    return _limited(self, key, n)


# -- park and promote (tests/integrations/test_park_workers.py) ---------------------


def _parked_run(self, key: str, n: int, seconds: float) -> str:
    started = time.monotonic()
    time.sleep(seconds)
    return _ran(self, key, started, n=n)


@app.task(bind=True)
@single_instance(key="key", on_contention="park", park=50, expire=60)
def parked_one(self, key, n, seconds=0.3):
    """One run per key at once; the rest park in line."""
    return _parked_run(self, key, n, seconds)


@app.task(bind=True)
@single_instance(key="key", on_contention="park", limit=2, park=50, expire=60)
def parked_two(self, key, n, seconds=0.3):
    """Two runs per key at once (limit=2); up to 50 parked."""
    return _parked_run(self, key, n, seconds)


@app.task(bind=True)
@single_instance(key="key", on_contention="park", park=3, expire=60)
def parked_refusing(self, key, n, seconds=0.3):
    """A line of 3: a fourth parked call is refused (ParkFull)."""
    return _parked_run(self, key, n, seconds)


@app.task(bind=True)
@single_instance(
    key="key", on_contention="park", park=2, on_park_full="drop_oldest", expire=60
)
def parked_dropping(self, key, n, seconds=0.3):
    """A line of 2 that drops its oldest call for a newer one."""
    return _parked_run(self, key, n, seconds)


@app.task(bind=True)
@single_instance(key="key", on_contention="park", park=50, expire=3)
def parked_killable(self, key, n, seconds=0.3):
    """As parked_one with a 3 s lock; a test SIGKILLs a worker running it."""
    started = time.monotonic()
    record(key, started, task_id=self.request.id, n=n, phase="start")
    time.sleep(seconds)
    return _ran(self, key, started, n=n)


@app.task(bind=True)
@single_instance(key="key", on_contention="park", limit=2, park=50, expire=60)
def parked_bench(self, key, n, seconds=0.05):
    """benchmarks/park.py's call: two at once per key, 50 parked, the rest
    refused; its start written down first (a run killed midway has one)."""
    started = time.monotonic()
    record(key, started, task_id=self.request.id, n=n, phase="start")
    return _parked_run(self, key, n, seconds)


def _record_park(sender=None, lock_id="", task_id="", action="", by="", ticket=0, **_):
    if os.environ.get("TASKLOCK_TEST_REDIS"):
        with _redis() as client:
            client.rpush(f"park:{lock_id}", json.dumps([action, task_id, by, ticket]))


def park_steps(lock_id: str) -> list[list[str]]:
    """The steps of the parked calls of ``lock_id``, in the order the
    workers said them (``call_parked``): ``[action, task id, by, ticket]``."""
    with _redis() as client:
        return [json.loads(item) for item in client.lrange(f"park:{lock_id}", 0, -1)]


call_parked.connect(_record_park, weak=False, dispatch_uid="tests.park")
