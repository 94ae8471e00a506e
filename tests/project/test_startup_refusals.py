"""Where Django's system checks do not run (a Celery worker, a beat, a
leadership), what they would refuse is refused at start-up with the check's
message: a lock store each process has its own of, and a retry on contention
with no bound task to retry. A test isolation, or
TASKLOCK['ALLOW_PER_PROCESS'], allows the per-process store."""

from __future__ import annotations

import os
import subprocess

import pytest
from django.core.checks import run_checks

from django_tasklock import Leadership, LockConfigurationError
from django_tasklock.testing import Isolation
from tests.services import celery_worker

LOCMEM = {"TASKLOCK": {"CACHE": "locmem"}}


def worker_refusal(**env: str) -> str:
    """What a worker started with ``env`` printed as it exited; fails if it
    was still running 90 s later (not refused)."""
    process = celery_worker(
        "tests.celery_app",
        "refused",
        1,
        {**os.environ, **env},
        stderr=subprocess.PIPE,
    )
    try:
        _, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("the worker started: nothing refused it")
    assert process.returncode != 0, err
    return err.decode()


@pytest.mark.slow
def test_a_worker_on_a_per_process_store_does_not_start():
    said = worker_refusal(TASKLOCK_TEST_CACHE="locmem")
    assert "refuses to start this worker" in said, said
    assert "CACHES['locmem']" in said and "LocMemCache" in said, said
    assert "ALLOW_PER_PROCESS" in said, said


@pytest.mark.slow
def test_a_worker_with_an_unbound_retry_task_does_not_start():
    said = worker_refusal(TASKLOCK_TEST_UNBOUND_RETRY="1")
    assert "refuses to start this worker" in said, said
    assert "on_contention='retry' needs a bound Celery task" in said, said
    assert "tests.unbound_retry.refresh_unbound" in said, said
    assert "LocMemCache" not in said, said


def test_a_leadership_on_a_per_process_store_is_refused(settings):
    settings.TASKLOCK = {"CACHE": "locmem"}
    leadership = Leadership("refused-here")
    with pytest.raises(LockConfigurationError, match="every process lead at once"):
        leadership.start()
    other = Leadership("refused-named", cache="locmem")
    settings.TASKLOCK = {}
    with pytest.raises(LockConfigurationError, match=r"CACHES\['locmem'\]"):
        other.start()


@pytest.mark.parametrize("how", ["setting", "isolation"])
def test_a_per_process_store_is_allowed_in_tests(settings, how):
    settings.TASKLOCK = {"CACHE": "locmem", "ALLOW_PER_PROCESS": how == "setting"}
    isolation = Isolation()
    if how == "isolation":
        isolation.start()
    try:
        with Leadership("allowed-here") as leadership:
            assert leadership.wait(10)
    finally:
        if how == "isolation":
            isolation.stop()
    # Outside the isolation, refused again.
    if how == "isolation":
        with pytest.raises(LockConfigurationError):
            Leadership("allowed-here").start()


def test_allow_per_process_is_a_checked_setting(settings):
    settings.TASKLOCK = {"ALLOW_PER_PROCESS": "yes"}
    assert "django_tasklock.E024" in {m.id for m in run_checks()}
    settings.TASKLOCK = {"ALLOW_PER_PROCESS": True}
    assert "django_tasklock.W006" in {m.id for m in run_checks()}
    settings.TASKLOCK = {}
    assert not {"django_tasklock.W006", "django_tasklock.E024"} & {
        m.id for m in run_checks()
    }


def test_a_leader_beat_on_a_per_process_store_is_refused(settings, tmp_path):
    from celery import Celery

    from django_tasklock.integrations.celery.beat import LeaderScheduler

    settings.TASKLOCK = {"CACHE": "locmem"}
    app = Celery("beat-refused", set_as_current=False)
    app.conf.update(broker_url="memory://", beat_schedule={})
    with pytest.raises(LockConfigurationError, match="celery-beat-beat-refused"):
        LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))


def test_a_misspelt_tasklock_setting_is_named(settings):
    settings.TASK_LOCK = {"CACHE": "default"}
    found = [m for m in run_checks() if m.id == "django_tasklock.W007"]
    assert len(found) == 1 and "settings.TASK_LOCK" in found[0].msg
    del settings.TASK_LOCK
    assert not [m for m in run_checks() if m.id == "django_tasklock.W007"]


def test_an_unreachable_memcached_server_is_named_by_the_check(settings):
    from tests.services import free_port

    address = f"127.0.0.1:{free_port()}"
    settings.CACHES = {
        **settings.CACHES,
        "gone": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": address,
        },
    }
    settings.TASKLOCK = {"CACHE": "gone"}
    found = [m for m in run_checks() if m.id == "django_tasklock.W008"]
    assert len(found) == 1 and address in found[0].msg, found
    settings.TASKLOCK = {}  # the default alias, on a running server
    assert not [m for m in run_checks() if m.id == "django_tasklock.W008"]
