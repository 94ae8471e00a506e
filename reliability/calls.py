"""Fault cases 18-22: duplicates stopped at ``.delay()`` (``mode="until_finished"``),
over real ``celery worker`` processes on a private Redis broker: a storm of
duplicates, a worker killed mid-call, a message nobody consumes, a publish that
fails, and a broker delivering a running call's message again."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from reliability.faults import Row
from tests.conftest import wait_until
from tests.services import Redis
from tests.workers import overlaps, start_workers, stop_workers


def _broker(redis: Redis) -> dict[str, str]:
    from tests.celery_app import app
    from tests.conftest import use_redis_broker

    os.environ["TASKLOCK_TEST_REDIS"] = redis.url
    return {**use_redis_broker(app, redis.url), "TASKLOCK_TEST_REDIS": redis.url}


def _free(lock_id: str) -> bool:
    from django_tasklock.status import lock_status

    return not lock_status(lock_id).held


def storm(keys: int, sends: int) -> Row:
    """``sends`` sends per key, back to back, of a 0.3 s call; every send either
    publishes or joins a pending or running call. Overlaps: runs of one key at
    once; wrong: a published call that did not run once, a caller whose result
    is not the result of the run it joined."""
    from django_tasklock import lock_id_for
    from tests import tasks

    results = []
    for key in range(keys):
        results += [tasks.finish_once.delay(f"storm-{key}", 0.3) for _ in range(sends)]
    outcomes = [result.get(timeout=120) for result in results]
    published = {result.id for result in results}
    runs = [run for key in range(keys) for run in tasks.runs(f"storm-{key}")]
    overlapping = sum(
        overlaps([(run["start"], run["end"]) for run in tasks.runs(f"storm-{key}")])
        for key in range(keys)
    )
    ran = sorted(str(run["task_id"]) for run in runs)
    wrong = int(ran != sorted(published))
    wrong += sum(
        outcome != f"storm-{n // sends}:{result.id}"
        for n, (result, outcome) in enumerate(zip(results, outcomes, strict=True))
    )
    wrong += sum(not _free(lock_id_for(tasks.finish_once, f"storm-{k}", 0.3))
                 for k in range(keys))  # fmt: skip
    row = Row("18. duplicates at .delay(), until_finished", len(results),
              overlapping, wrong)  # fmt: skip
    row.figures.append(
        f"{len(results)} sends, {len(published)} published, {len(runs)} ran, "
        f"{len(results) - len(published)} joined a pending or running call"
    )
    return row


def killed_mid_call(tries: int) -> Row:
    """SIGKILL the pool process running a call (expire 3 s): the key must be
    free within the expiry, and no run of the call started before the kill."""
    from django_tasklock import lock_id_for
    from tests import tasks

    attempts = overlapping = wrong = 0
    frees: list[float] = []
    for attempt in range(tries):
        attempts += 1
        key = f"killed-call-{attempt}"
        lock_id = lock_id_for(tasks.finish_killable, key, 30.0)
        tasks.finish_killable.delay(key, 30.0)
        wait_until(lambda key=key: tasks.runs(key), 60)
        os.kill(int(tasks.runs(key)[0]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        killed_at = time.monotonic()
        try:
            frees.append(wait_until(lambda lock_id=lock_id: _free(lock_id), 10))
        except AssertionError:
            wrong += 1
            continue
        wrong += frees[-1] > 3 + 1  # memcached: whole seconds
        overlapping += sum(
            float(run["start"]) > killed_at  # type: ignore[arg-type]
            for run in tasks.runs(key)[1:]
        )
    row = Row("19. worker SIGKILLed mid-call (expire 3s)", attempts, overlapping, wrong)
    row.figures.append(
        f"key free {min(frees, default=0):.1f}-{max(frees, default=0):.1f}s after "
        "the kill"
    )
    return row


def never_consumed(tries: int) -> Row:
    """A call sent to a queue nobody reads (QUEUE_EXPIRE 2 s): its key must be
    free within 2 s (+1, whole seconds), and not before 1 s."""
    from django.test import override_settings

    from django_tasklock import lock_id_for
    from tests import tasks

    attempts = wrong = 0
    frees: list[float] = []
    with override_settings(TASKLOCK={"LOCK_EXPIRE": 60, "QUEUE_EXPIRE": 2}):
        for attempt in range(tries):
            attempts += 1
            key = f"lost-message-{attempt}"
            lock_id = lock_id_for(tasks.finish_once, key)
            sent_at = time.monotonic()
            tasks.finish_once.apply_async((key,), queue="nobody-consumes")
            try:
                wait_until(lambda lock_id=lock_id: _free(lock_id), 10)
            except AssertionError:
                wrong += 1
                continue
            frees.append(time.monotonic() - sent_at)
            wrong += not 1 <= frees[-1] <= 3
    row = Row("20. message never consumed (QUEUE_EXPIRE 2s)", attempts, 0, wrong)
    row.figures.append(
        f"key free {min(frees, default=0):.1f}-{max(frees, default=0):.1f}s after "
        "the send"
    )
    return row


def publish_fails(tries: int) -> Row:
    """The broker is down at ``.delay()``: the caller gets the error, and the
    key is left free (the lock taken for the publish is rolled back)."""
    from kombu.exceptions import OperationalError

    from django_tasklock import lock_id_for
    from tests import tasks
    from tests.celery_app import app
    from tests.conftest import reset_publisher

    attempts = raised = left = 0
    dead = Redis().start()
    working = app.conf.broker_url
    app.conf.broker_url = dead.url
    reset_publisher(app)
    dead.stop()
    try:
        for attempt in range(tries):
            attempts += 1
            key = f"no-broker-{attempt}"
            try:
                tasks.finish_once.apply_async((key,), retry=False)
            except OperationalError:
                raised += 1
            left += not _free(lock_id_for(tasks.finish_once, key))
    finally:
        app.conf.broker_url = working
        reset_publisher(app)
    row = Row("21. broker down at .delay()", attempts, 0, left + attempts - raised)
    row.figures.append(f"error raised {raised}/{attempts}; keys left held {left}")
    return row


def redelivered(broker: dict[str, str], tries: int) -> Row:
    """Workers with acks_late and a 2 s visibility timeout run a 6 s call: the
    broker delivers it again while it runs. Attempts: second deliveries seen
    (dropped, each logged); overlaps: runs of one call at once."""
    from tests import tasks

    logdir = Path(tempfile.mkdtemp(prefix="redeliver-"))
    workers = start_workers(
        broker,
        ["fault-redeliver-1", "fault-redeliver-2"],
        extra_env={"TASKLOCK_TEST_VISIBILITY": "2"},
        logdir=logdir,
    )
    marker = f"second delivery of {tasks.finish_once.name}"
    overlapping = wrong = 0
    try:
        for attempt in range(tries):
            key = f"redelivered-{attempt}"
            result = tasks.finish_once.delay(key, 6.0)
            wrong += result.get(timeout=60) != f"{key}:{result.id}"
            holds = [(r["start"], r["end"]) for r in tasks.runs(key)]
            overlapping += overlaps(holds)  # type: ignore[arg-type]
    finally:
        stop_workers(workers)
    drops = sum(log.read_text().count(marker) for log in logdir.glob("*.log"))
    row = Row("22. message redelivered while it runs", drops, overlapping, wrong)
    row.figures.append(
        f"{tries} calls of 6 s, visibility timeout 2 s; second deliveries "
        f"dropped {drops}"
    )
    return row


def run(redis: Redis, quick: bool) -> list[Row]:
    from tests import tasks

    broker = _broker(redis)
    tasks.forget_runs()
    workers = start_workers(broker, ["fault-calls-1", "fault-calls-2"])
    try:
        rows = [storm(3 if quick else 10, 8 if quick else 40)]
        rows.append(killed_mid_call(1 if quick else 3))
    finally:
        stop_workers(workers)
    rows.append(never_consumed(1 if quick else 3))
    rows.append(publish_fails(2 if quick else 10))
    rows.append(redelivered(broker, 1 if quick else 3))
    return rows
