"""A broker delivering a running call's message again (Redis' visibility
timeout with ``acks_late``): the second delivery is dropped, never run beside
the first. Real ``celery worker`` processes; kombu is told to look for overdue
messages every second (by default it looks every 100 s)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from django_tasklock import lock_id_for
from django_tasklock.calls import call_of
from django_tasklock.status import lock_status
from tests import tasks
from tests.helpers import wait_until
from tests.workers import overlaps, start_workers, stop_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("memcached_locks")]


@pytest.fixture(scope="module")
def redelivering(broker):
    """Workers with acks_late and a 2 s visibility timeout, kombu looking for
    overdue messages every second: a 6 s call is delivered again while it runs."""
    logdir = Path(tempfile.mkdtemp(prefix="redeliver-"))
    processes = start_workers(
        broker,
        ["redeliver-1", "redeliver-2"],
        extra_env={"TASKLOCK_TEST_VISIBILITY": "2"},
        logdir=logdir,
    )
    yield logdir
    stop_workers(processes)


def dropped_copies(logdir: Path, task) -> int:
    """How many second deliveries of ``task`` the workers logged as dropped."""
    marker = f"second delivery of {task.name}"
    return sum(log.read_text().count(marker) for log in logdir.glob("*.log"))


@pytest.mark.parametrize("task_name", ["finish_once", "skip_duplicate"])
def test_a_redelivered_call_never_runs_beside_itself(redelivering, task_name):
    task = getattr(tasks, task_name)
    key = f"redeliver-{task_name}"

    def drops() -> int:
        return dropped_copies(redelivering, task)

    before = drops()
    result = task.delay(key, 6.0)
    assert result.get(timeout=60) == f"{key}:{result.id}"
    wait_until(lambda: drops() > before, 10)
    runs = [run for run in tasks.runs(key) if run["task_id"] == result.id]
    # A copy restored just as the run ends may run after it: never beside it.
    assert overlaps([(run["start"], run["end"]) for run in runs]) == 0


@pytest.mark.parametrize("task_name", ["debounced", "coalesced"])
def test_until_started_and_coalesce_drop_a_copy_delivered_during_the_run(
    redelivering, task_name
):
    """until_started: a newer call has replaced the started mark by the time
    the copy comes, so only the run's own lock tells it apart. coalesce: the
    copy must not wait for the run lock and then run the body again."""
    task = getattr(tasks, task_name)
    key = f"redeliver-{task_name}"

    def drops() -> int:
        return dropped_copies(redelivering, task)

    before = drops()
    result = task.delay(key, 6.0)
    if task_name == "debounced":
        # A newer call, queued while the first runs: it takes the started mark.
        lock_id = lock_id_for(task, key, 6.0)
        wait_until(
            lambda: call_of(lock_status(lock_id).value) == ("started", result.id), 10
        )
        newer = task.apply_async((key, 6.0), countdown=1)
        assert newer.id != result.id
        assert call_of(lock_status(lock_id).value) == ("queued", newer.id)
    assert result.get(timeout=60) == f"{key}:{result.id}"
    wait_until(lambda: drops() > before, 10)
    runs = [run for run in tasks.runs(key) if run["task_id"] == result.id]
    assert len(runs) == 1, runs
    if task_name == "debounced":
        assert newer.get(timeout=60) == f"{key}:{newer.id}"
