"""The enqueue-time modes under an in-process worker (Celery's test worker, a
thread pool): the same worker-side paths as test_calls_workers.py, in this
process, on the private Redis broker. Each test counts runs and publishes."""

from __future__ import annotations

import time

import pytest
from celery.contrib.testing.worker import start_worker

from django_tasklock import LockNotAcquired, lock_id_for
from django_tasklock.calls import QUEUE_SUFFIX, call_of
from django_tasklock.status import lock_status
from tests import tasks
from tests.celery_app import app
from tests.conftest import wait_until
from tests.test_celery_workers import broker  # noqa: F401
from tests.workers import overlaps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(broker):  # noqa: F811
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"
    ) as running:
        yield running


@pytest.fixture(autouse=True)
def _memcached_locks(settings):
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60}


def held(lock_id: str) -> tuple[str, str] | None:
    status = lock_status(lock_id)
    return call_of(status.value) if status.held else None


def test_until_finished_joins_and_frees(worker):
    results = [tasks.finish_once.delay("ip-a", 0.5) for _ in range(5)]
    assert {r.id for r in results} == {results[0].id}
    assert [r.get(timeout=30) for r in results] == [f"ip-a:{results[0].id}"] * 5
    assert len(tasks.runs("ip-a")) == 1
    wait_until(lambda: held(lock_id_for(tasks.finish_once, "ip-a", 0.5)) is None, 5)


def test_sent_again_with_its_id_while_running_is_dropped(worker):
    lock_id = lock_id_for(tasks.finish_once, "ip-again", 1.0)
    first = tasks.finish_once.delay("ip-again", 1.0)
    wait_until(lambda: held(lock_id) == ("running", first.id), 30)
    again = tasks.finish_once.apply_async(("ip-again", 1.0), task_id=first.id)
    assert again.id == first.id
    assert held(lock_id) == ("running", first.id), "the running call lost its lock"
    assert first.get(timeout=30) == f"ip-again:{first.id}"
    time.sleep(0.5)  # the second copy, dropped, records nothing
    assert len(tasks.runs("ip-again")) == 1


def test_retry_and_autoretry_keep_the_call(worker):
    retried = tasks.finish_retrying.delay("ip-retry", 1, 0.1, 0.3)
    assert tasks.finish_retrying.delay("ip-retry", 1, 0.1, 0.3).id == retried.id
    assert retried.get(timeout=30) == 1
    auto = tasks.finish_autoretry.delay("ip-auto", 1)
    assert auto.get(timeout=30) == 1
    failing = tasks.finish_autoretry.delay("ip-auto-fail", 5)
    with pytest.raises(ValueError, match="failure 2"):
        failing.get(timeout=30)
    assert [r["retries"] for r in tasks.runs("ip-retry")] == [0, 1]
    assert [r["retries"] for r in tasks.runs("ip-auto")] == [0, 1]
    assert [r["retries"] for r in tasks.runs("ip-auto-fail")] == [0, 1, 2]
    for lock_id in (
        lock_id_for(tasks.finish_retrying, "ip-retry", 1, 0.1, 0.3),
        lock_id_for(tasks.finish_autoretry, "ip-auto", 1),
        lock_id_for(tasks.finish_autoretry, "ip-auto-fail", 5),
    ):
        wait_until(lambda lock_id=lock_id: held(lock_id) is None, 5)


def test_coalesce_and_debounce(worker):
    lock_id = lock_id_for(tasks.coalesced, "ip-co", 1.0)
    first = tasks.coalesced.delay("ip-co", 1.0)
    wait_until(lambda: held(lock_id) == ("running", first.id), 30)
    during = [tasks.coalesced.delay("ip-co", 1.0) for _ in range(5)]
    assert len({d.id for d in during}) == 1
    assert held(lock_id + QUEUE_SUFFIX) == ("queued", during[0].id)
    assert during[0].get(timeout=30) == f"ip-co:{during[0].id}"
    runs = tasks.runs("ip-co")
    assert [r["task_id"] for r in runs] == [first.id, during[0].id]
    assert overlaps([(r["start"], r["end"]) for r in runs]) == 0

    debounced = [
        tasks.debounced.apply_async(("ip-deb", 0.2), countdown=0.5) for _ in range(5)
    ]
    assert len({d.id for d in debounced}) == 1
    assert debounced[0].get(timeout=30) == f"ip-deb:{debounced[0].id}"
    assert len(tasks.runs("ip-deb")) == 1


def test_a_chain_link_meeting_a_held_lock_fails(worker):
    from celery import chain

    lock_id = lock_id_for(tasks.skip_duplicate, "ip-ch", 2.0)
    holder = tasks.skip_duplicate.delay("ip-ch", 2.0)
    wait_until(lambda: held(lock_id) == ("running", holder.id), 30)
    blocked = chain(tasks.skip_duplicate.si("ip-ch", 2.0), tasks.add_one.s())()
    with pytest.raises(LockNotAcquired):
        blocked.get(timeout=30)
    holder.get(timeout=30)
