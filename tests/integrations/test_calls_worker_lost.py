"""A call whose pool process died mid-run (an OOM kill, SIGKILL) with
``acks_late`` and ``task_reject_on_worker_lost``: Celery puts its message back,
and the copy must run, not be dropped as a second delivery of a call that no
longer runs. Real ``celery worker`` processes; the only workers of this module
(a worker of another module could take the message and not requeue it)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from django_tasklock import lock_id_for
from django_tasklock.calls import call_of
from django_tasklock.status import lock_status
from tests import tasks
from tests.helpers import wait_until
from tests.workers import start_workers, stop_workers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("memcached_locks")]


@pytest.fixture(scope="module")
def rejecting(broker):
    """A worker with acks_late and task_reject_on_worker_lost: a call whose
    pool process is killed goes back to the queue."""
    processes = start_workers(
        broker, ["reject-on-lost"], extra_env={"TASKLOCK_TEST_REJECT_ON_LOST": "1"}
    )
    yield processes
    stop_workers(processes)


@pytest.mark.parametrize("task_name", ["finish_when_told", "skip_when_told"])
def test_a_call_whose_pool_process_was_killed_runs_again_at_once(rejecting, task_name):
    """The copy Celery redelivers meets the dead run's lock (60 s left), which
    still names its task id: the dead process is seen dead, and the copy runs."""
    task = getattr(tasks, task_name)
    key = f"killed-{task_name}"
    lock_id = lock_id_for(task, key)
    result = task.delay(key)
    wait_until(lambda: len(tasks.runs(key)) == 1, 30)
    owner = lock_status(lock_id).owner
    assert owner is not None and owner.alive, owner
    assert call_of(lock_status(lock_id).value) == ("running", result.id)
    os.kill(owner.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: len(tasks.runs(key)) == 2, 30)
    tasks.let_go(key)
    assert result.get(timeout=30) == f"{key}:{result.id}"
    took = time.monotonic() - killed_at
    assert took < 30, f"the copy waited for the dead lock to expire ({took:.0f}s)"
    starts = [run for run in tasks.runs(key) if run.get("phase") == "start"]
    assert [run["task_id"] for run in starts] == [result.id, result.id]
    assert starts[0]["pid"] != starts[1]["pid"]
    wait_until(lambda: not lock_status(lock_id).held, 10)
