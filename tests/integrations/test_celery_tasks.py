"""@single_instance on Celery tasks, called in this process (no worker)."""

from __future__ import annotations

import hashlib
import time

import pytest
from celery.exceptions import MaxRetriesExceededError

from django_tasklock import Lock, LockLost, LockNotAcquired, current_lock, lock_id_for
from tests import tasks
from tests.helpers import background

pytestmark = pytest.mark.usefixtures("memcached_locks")


def test_bound_task_lock_id_uses_task_name():
    lock_id = lock_id_for(tasks.import_feed, "https://example.com/a.xml")
    assert lock_id.startswith("tests.tasks.import_feed-lock-")
    assert tasks.import_feed.name == "tests.tasks.import_feed"
    assert lock_id == lock_id_for(
        tasks.import_feed, feed_url="https://example.com/a.xml"
    )


def test_bound_task_skips_while_locked_and_runs_after():
    url = "https://example.com/a.xml"
    with Lock(lock_id_for(tasks.import_feed, url, seconds=0)):
        assert tasks.import_feed(url, seconds=0) is None
        # Other arguments are another call, with a lock of its own.
        assert tasks.import_feed(url, seconds=0, tag="other") == url
    assert tasks.import_feed(url, seconds=0) == url
    assert [run["tag"] for run in tasks.runs(url)] == ["other", ""]


def test_key_str_matches_cookbook_for_celery_task():
    url = "https://example.com/feed"
    cookbook = f"{tasks.refresh_feed.name}-lock-{hashlib.md5(url.encode()).hexdigest()}"
    assert lock_id_for(tasks.refresh_feed, url, 7) == cookbook


def test_unbound_task_uses_celery_name_and_raises():
    lock_id = lock_id_for(tasks.rebuild_index)
    assert lock_id.startswith(f"{tasks.rebuild_index.name}-lock-")
    with Lock(lock_id), pytest.raises(LockNotAcquired):
        tasks.rebuild_index()
    assert tasks.rebuild_index() == "rebuilt"


def test_celery_argument_checking_still_works():
    with pytest.raises(TypeError):
        tasks.import_feed.delay()  # feed_url missing: refused before sending
    with pytest.raises(TypeError):
        tasks.import_feed.delay("u", nonsense=1)


def test_retry_inside_body_releases_the_lock_first():
    """Eager retries run at once, inside retry(): they must not meet their own lock."""
    result = tasks.retries_itself.apply(args=("self-retry",))
    assert result.get() == "done"
    assert [run["retries"] for run in tasks.runs("self-retry")] == [0, 1]
    assert not Lock(lock_id_for(tasks.retries_itself, "self-retry")).locked()


def test_retry_on_contention_honours_max_retries():
    url = "https://example.com/busy"
    with Lock(lock_id_for(tasks.refresh_limited, url)):
        result = tasks.refresh_limited.apply(args=(url,))
    assert result.failed()
    with pytest.raises(MaxRetriesExceededError):
        result.get()


def test_retry_on_contention_runs_once_free():
    url = "https://example.com/free"
    with Lock(lock_id_for(tasks.refresh_limited, url)):
        pass
    assert tasks.refresh_limited.apply(args=(url,)).get() == url


def test_renewing_task_sees_its_lock_and_max_hold_from_time_limit():
    fence = tasks.lifecycle("renewing", seconds=0)
    (run,) = tasks.runs("renewing")
    assert run["renewing"] is True
    assert run["max_hold"] == 32  # the task's time_limit, and two seconds
    later = tasks.lifecycle("renewing", seconds=0)
    assert later > fence
    assert current_lock() is None


def test_max_hold_from_app_time_limit_and_none_without(settings):
    assert tasks.limited_by_app("x") is None
    tasks.app.conf.task_time_limit = 45
    try:
        assert tasks.limited_by_app("x") == 47
    finally:
        tasks.app.conf.task_time_limit = None


@pytest.mark.slow
def test_renewing_task_raises_lock_lost_at_check_after_a_steal():
    from django.core.cache import caches

    lock_id = lock_id_for(tasks.lifecycle, "stolen-run")
    # Its 3 s lock is surely kept 1 s: on a loaded machine the first take
    # (connection and all) can be answered later than that, and is then
    # rightly refused and the run skipped. A skipped run is started again.
    for _ in range(5):
        body, outcome = background(tasks.lifecycle, "stolen-run", 5)
        deadline = time.monotonic() + 5
        while not Lock(lock_id).locked() and body.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        if body.is_alive():
            break
        assert outcome == {"result": None}, outcome  # skipped, not failed
    assert Lock(lock_id).locked(), "five runs in a row were refused their take"
    time.sleep(2.5)  # past its 2 s expiry: the heartbeat kept it
    assert Lock(lock_id).locked()
    caches["default"].delete(lock_id)
    body.join(timeout=10)
    assert isinstance(outcome.get("error"), LockLost)
    assert tasks.runs("stolen-run") == [], "the body went on after LockLost"


@pytest.mark.parametrize("how", ["direct", "apply"])
def test_inner_retry_releases_only_its_own_runs_lock(how):
    # The outer run processes two children in this thread; each retries, which
    # must release the child's lock and leave the outer run's alone.
    outcome = tasks.process_tree("root", ["leaf-a", "leaf-b"], how)
    assert outcome == {"owned": True, "taken_by_rival": False}
    for item in ("root", "leaf-a", "leaf-b"):
        assert not Lock(lock_id_for(tasks.process_tree, item)).locked()
