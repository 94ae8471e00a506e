"""@single_instance under real Celery workers, on a real broker (private Redis).

An in-process worker (celery.contrib.testing, thread pool) and two real
``celery worker`` processes with the prefork pool. Every run records its start
and end; the tests measure overlaps instead of assuming them.
"""

from __future__ import annotations

import time

import pytest
from celery.contrib.testing.worker import start_worker

from tests import tasks
from tests.celery_app import app
from tests.helpers import intervals, send_storm
from tests.workers import overlaps, start_workers, stop_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("memcached_locks")]


def pairs_overlap(first, second):
    return any(a0 < b1 and b0 < a1 for a0, a1 in first for b0, b1 in second)


def test_in_process_worker_duplicates_skip_and_distinct_run_in_parallel(broker):
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"
    ):
        calls = [
            (tasks.import_feed, (f"feed-{n % 2}",), {"seconds": 0.4}) for n in range(24)
        ]
        results = send_storm(calls)
        outcomes = [result.get(timeout=60) for result in results]
    ran = {key: intervals(key) for key in ("feed-0", "feed-1")}
    for key, holds in ran.items():
        assert holds, f"{key} never ran"
        assert overlaps(holds) == 0, f"{key} ran twice at once"
    assert outcomes.count(None) == 24 - sum(len(h) for h in ran.values()), (
        "a call vanished"
    )
    assert outcomes.count(None) > 0, (
        "no duplicate was ever refused: no contention tested"
    )
    assert pairs_overlap(ran["feed-0"], ran["feed-1"]), (
        "distinct feeds never ran together"
    )


@pytest.fixture(scope="module")
def prefork_workers(broker):
    """Two `celery worker` processes, prefork pool, two child processes each."""
    processes = start_workers(broker, ["tasklock-test-1", "tasklock-test-2"])
    yield processes
    stop_workers(processes)


def test_prefork_storm_of_duplicates(prefork_workers):
    feeds = [f"https://feeds.example/{n}.xml" for n in range(3)]
    calls = [(tasks.import_feed, (feed,), {"seconds": 0.3}) for feed in feeds * 12]
    outcomes = [result.get(timeout=120) for result in send_storm(calls)]
    ran = {feed: intervals(feed) for feed in feeds}
    for feed, holds in ran.items():
        assert holds, f"{feed} never ran"
        assert overlaps(holds) == 0, f"{feed} ran twice at once"
    assert len(outcomes) == len(calls)
    assert outcomes.count(None) == len(calls) - sum(len(h) for h in ran.values())
    assert outcomes.count(None) > 0, "no duplicate was refused: no contention tested"
    pids = {run["pid"] for feed in feeds for run in tasks.runs(feed)}
    assert len(pids) >= 2, "all runs in one process: not a multi-process test"
    assert any(pairs_overlap(ran[a], ran[b]) for a in feeds for b in feeds if a < b), (
        "distinct feeds never ran in parallel"
    )


def test_prefork_retry_runs_every_call_once(prefork_workers):
    feeds = ["retry-a", "retry-b"]
    calls = [(tasks.refresh_feed, (feed, n), {}) for n in range(6) for feed in feeds]
    outcomes = [result.get(timeout=120) for result in send_storm(calls)]
    assert sorted(outcomes) == sorted(n for n in range(6) for _ in feeds)
    for feed in feeds:
        runs = tasks.runs(feed)
        assert sorted(run["call"] for run in runs) == list(range(6)), (
            "a call ran twice or never"
        )
        assert overlaps([(run["start"], run["end"]) for run in runs]) == 0
    assert any(run["retries"] > 0 for feed in feeds for run in tasks.runs(feed)), (
        "no call was ever retried: no contention tested"
    )


def test_prefork_wait_runs_every_call_once(prefork_workers):
    feeds = ["wait-a", "wait-b"]
    calls = [(tasks.wait_feed, (feed, n), {}) for n in range(4) for feed in feeds]
    outcomes = [result.get(timeout=120) for result in send_storm(calls)]
    assert sorted(outcomes) == sorted(n for n in range(4) for _ in feeds)
    for feed in feeds:
        runs = tasks.runs(feed)
        assert sorted(run["call"] for run in runs) == list(range(4))
        assert overlaps([(run["start"], run["end"]) for run in runs]) == 0


def test_prefork_soft_time_limit_releases_the_lock(prefork_workers):
    from celery.exceptions import SoftTimeLimitExceeded

    from django_tasklock import Lock, lock_id_for

    result = tasks.overruns_soft_limit.delay("soft")
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=30)
    assert len(tasks.runs("soft")) == 1
    assert not Lock(lock_id_for(tasks.overruns_soft_limit, "soft")).locked()


def test_prefork_hard_time_limit_leaves_lock_no_longer_than_expiry(prefork_workers):
    from celery.exceptions import TimeLimitExceeded

    from django_tasklock import Lock, lock_id_for

    lock = Lock(lock_id_for(tasks.overruns_hard_limit, "hard"))
    result = tasks.overruns_hard_limit.delay("hard")
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30)
    assert len(tasks.runs("hard")) == 1
    started = tasks.runs("hard")[0]["start"]
    # Celery terminates the child (SIGTERM, which runs the release, then SIGKILL if
    # it hangs); whichever way it dies, memcached drops the lock at its expiry
    # (5 s, counted in whole seconds from the acquire) at the latest.
    while lock.locked():
        assert time.monotonic() - started < 5 + 1.5, "lock outlived its expiry"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("task_name", "renewed"), [("long_renewed", True), ("long_unrenewed", False)]
)
def test_prefork_long_task_keeps_its_lock_only_when_renewed(
    prefork_workers, task_name, renewed
):
    """A 7 s task with a 3 s lock; duplicates arrive after the expiry. Renewed, they
    are skipped; not renewed (the control), they run beside it."""
    from django_tasklock import Lock, lock_id_for

    task = getattr(tasks, task_name)
    name = f"long-{task_name}"
    lock = Lock(lock_id_for(task, name, 7, 0), expire=60)
    first = task.delay(name, 7, 0)
    deadline = time.monotonic() + 30
    while not lock.locked():
        assert time.monotonic() < deadline, "the long task never took its lock"
        time.sleep(0.05)
    time.sleep(4.5)  # past the 3 s expiry (and its whole-second rounding)
    duplicates = [task.delay(name, 0.2, n) for n in range(1, 4)]
    outcomes = [result.get(timeout=60) for result in duplicates]
    assert first.get(timeout=60) == 0
    holds = intervals(name)
    if renewed:
        assert outcomes == [None, None, None], "a duplicate ran while the lock was kept"
        assert len(holds) == 1
        assert not lock.locked(), "the lock outlived the task"
    else:
        assert any(outcome is not None for outcome in outcomes)
        assert overlaps(holds) > 0, (
            "the control shows no overlap: the test proves nothing"
        )


def test_prefork_limited_task_runs_at_most_two_at_once(prefork_workers):
    from tests.workers import most_at_once

    calls = [(tasks.export_for, ("tenant-a", n), {}) for n in range(10)]
    outcomes = [result.get(timeout=180) for result in send_storm(calls)]
    assert sorted(outcomes) == list(range(10)), "a call ran twice or never"
    runs = tasks.runs("tenant-a")
    assert sorted(run["call"] for run in runs) == list(range(10))
    holds = [(run["start"], run["end"]) for run in runs]
    # Four worker processes, ten calls: two at once, never three.
    assert most_at_once(holds) == 2
    assert any(run["retries"] > 0 for run in runs), "never full: nothing tested"
    assert len({run["pid"] for run in runs}) >= 2


@pytest.mark.parametrize("kind", ["backend", "lost"])
def test_prefork_exceptions_reach_the_caller_with_their_type(prefork_workers, kind):
    """Through the JSON result serializer on Redis: ``except LockBackendError``
    around ``result.get()`` matches, and the attributes are there."""
    from django_tasklock import LockBackendError, LockLost

    expected = {"backend": LockBackendError, "lost": LockLost}[kind]
    result = tasks.raise_lock_error.delay(kind, f"worker-{kind}")
    with pytest.raises(expected) as caught:
        result.get(timeout=60)
    assert caught.value.lock_id == f"worker-{kind}"
    if kind == "lost":
        assert caught.value.held_for == 3.5
    else:
        assert caught.value.store == "s"
