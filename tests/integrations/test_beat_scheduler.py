"""LeaderScheduler in this process, on a real broker and the real lock store:
what a leader's send carries, and what a leader that lost its leadership
between recording a run and publishing it does (skips it, logged). The
processes' tests are tests/integrations/test_beat.py."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.signals import before_task_publish
from django.core.cache import caches
from django.core.checks import run_checks

from django_tasklock import Lock, LockConfigurationError, conf
from django_tasklock.calls import store as lock_store
from django_tasklock.integrations.celery.beat import FENCE, RUN, LeaderScheduler


@pytest.fixture
def published(redis_server) -> Iterator[list[dict]]:
    """The headers of every message this process publishes."""
    seen: list[dict] = []

    def record(sender=None, headers=None, **_):
        seen.append(dict(headers or {}))

    before_task_publish.connect(record)
    yield seen
    before_task_publish.disconnect(record)


@pytest.fixture
def scheduler(store, redis_server, tmp_path) -> Iterator[LeaderScheduler]:
    app = Celery("beat-unit", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url.rsplit("/", 1)[0] + "/10",
        beat_schedule={"e": {"task": "beat-unit.tick", "schedule": 1.0}},
    )
    beat = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    try:
        assert beat.leadership.wait(30), "never became leader"
        yield beat
    finally:
        beat.close()
        caches[store.alias].delete(beat._key("e"))


def send(beat: LeaderScheduler) -> None:
    """One run of entry "e", as beat's tick sends a due one."""
    entry = beat.schedule["e"]
    beat.reserve(entry)
    beat.apply_entry(entry, producer=beat.producer)


def test_each_send_carries_its_run_and_the_leaders_fence(scheduler, published):
    send(scheduler)
    send(scheduler)
    runs = [h[RUN] for h in published]
    assert len(runs) == 2 and runs[0] < runs[1], published
    assert {h[FENCE] for h in published} == {scheduler.leadership.fence}
    # The run is the time stored for the entry: the next leader's start.
    backend, _alias = lock_store(None)
    peek = backend.peek(backend.keys_for(scheduler._key("e"))[0])
    assert peek is not None and int(str(peek.value)) == runs[1]


def test_a_leader_that_lost_the_role_after_recording_a_run_skips_it(
    scheduler, published, store, caplog
):
    send(scheduler)  # leading: sent
    assert len(published) == 1
    claim = scheduler._claim

    def claim_then_robbed(entry):
        run = claim(entry)
        # Between the claim and the publish, another process takes the role
        # (as when this one is paused past its liveness); this one learns it
        # at its next word with the store.
        lock = scheduler.leadership._lock
        assert lock is not None
        caches[store.alias].delete(lock.lock_id)
        assert Lock(lock.lock_id).acquire()
        assert lock.extend() is False
        return run

    scheduler._claim = claim_then_robbed  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        send(scheduler)
    assert len(published) == 1, "a run was published by a beat no longer leading"
    assert "lost its leadership while recording the run" in caplog.text


def overdue(beat: LeaderScheduler, seconds: float) -> None:
    """Entry "e" last ran ``seconds`` ago (by any leader): its next run fell
    due before this beat became leader, while no beat led."""
    entry = beat.schedule["e"]
    entry.last_run_at = entry.default_now() - datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("missed", ["skip", {"e": "skip", "other": "send"}])
def test_a_run_that_fell_due_while_no_beat_led_is_skipped_where_asked(
    scheduler, published, settings, store, caplog, missed
):
    settings.TASKLOCK = {**store.tasklock, "BEAT_MISSED": missed}
    overdue(scheduler, 30)
    with caplog.at_level(logging.INFO, logger="django_tasklock"):
        send(scheduler)
    assert published == [], "a missed run was sent"
    assert "fell due" in caplog.text and "while no beat led" in caplog.text
    # Recorded all the same: no other beat sends it either, and the next run,
    # due a period after, is sent.
    backend, _alias = lock_store(None)
    peek = backend.peek(backend.keys_for(scheduler._key("e"))[0])
    assert peek is not None
    assert abs(int(str(peek.value)) / 1000 - time.time()) < 30
    send(scheduler)
    assert len(published) == 1


@pytest.mark.parametrize("missed", [None, "send", {"other": "skip"}])
def test_a_run_that_fell_due_while_no_beat_led_is_sent_late_by_default(
    scheduler, published, settings, store, missed
):
    if missed is not None:
        settings.TASKLOCK = {**store.tasklock, "BEAT_MISSED": missed}
    overdue(scheduler, 30)
    send(scheduler)
    assert len(published) == 1


def test_a_run_due_while_this_beat_led_is_sent_whatever_the_choice(
    scheduler, published, settings, store
):
    settings.TASKLOCK = {**store.tasklock, "BEAT_MISSED": "skip"}
    assert scheduler.leadership.since is not None
    scheduler.leadership.since -= 60  # it has led for a minute
    overdue(scheduler, 5)  # a late tick of its own
    send(scheduler)
    assert len(published) == 1


@pytest.mark.parametrize(
    "bad", ["later", None, {"e": "never"}, {1: "skip"}, ["e"]], ids=repr
)
def test_a_bad_beat_missed_setting_says_what_to_write(settings, bad):
    settings.TASKLOCK = {"CACHE": "default", "BEAT_MISSED": bad}
    with pytest.raises(LockConfigurationError, match=r"BEAT_MISSED.*skip"):
        conf.settings.beat_missed("e")
    errors = [m for m in run_checks() if m.id == "django_tasklock.E023"]
    assert len(errors) == 1 and "BEAT_MISSED" in errors[0].msg
