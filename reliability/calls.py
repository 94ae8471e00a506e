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

from reliability import recovery
from reliability.faults import Row
from tests.helpers import wait_until
from tests.services import Redis
from tests.workers import overlaps, start_workers, stop_workers


def _broker(redis: Redis) -> dict[str, str]:
    from tests.celery_app import app
    from tests.helpers import use_redis_broker

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
    from django_tasklock.signals import call_deduplicated
    from tests import tasks

    joined: list[str] = []

    def count(sender: object, action: str, task_id: str, **_: object) -> None:
        if action == "joined":
            joined.append(task_id)

    call_deduplicated.connect(count)
    results = []
    try:
        for key in range(keys):
            results += [
                tasks.finish_once.delay(f"storm-{key}", 0.3) for _ in range(sends)
            ]
    finally:
        call_deduplicated.disconnect(count)
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
    wrong += sum(
        not _free(lock_id_for(tasks.finish_once, f"storm-{k}", 0.3))
        for k in range(keys)
    )
    row = Row(
        "18. duplicates at .delay(), until_finished", len(results), overlapping, wrong
    )
    # Every send that was not published was joined to a call that ran.
    wrong += len(joined) != len(results) - len(published)
    wrong += not set(joined) <= published
    row.figures.append(
        f"{len(results)} sends, {len(published)} published, {len(runs)} ran, "
        f"{len(joined)} joined a pending or running call"
    )
    return row


def killed_mid_call(tries: int) -> Row:
    """SIGKILL the pool process running a call (expire 3 s): the key must be
    free within the expiry, and no run of the call started before the kill."""
    from django_tasklock import lock_id_for
    from tests import tasks

    attempts = wrong = 0
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
        wrong += time.monotonic() - killed_at < 0  # (the clock is monotonic)
    # No second run of the call exists (no redelivery here): nothing to overlap.
    row = Row("19. worker SIGKILLed mid-call (expire 3s)", attempts, None, wrong)
    row.figures.append(
        f"key free {min(frees, default=0):.1f}-{max(frees, default=0):.1f}s after "
        "the kill"
    )
    return row


def never_consumed(tries: int) -> Row:
    """A call sent to a queue nobody reads (QUEUE_EXPIRE 2 s): its key must be
    free within 2 s + 3 (an expiry on the server's own clock, read in whole
    seconds, may end up to 3 s late: docs/explanation/guarantees.rst), and
    not before 1 s."""
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
            wrong += not 1 <= frees[-1] <= 2 + 3
    row = Row("20. message never consumed (QUEUE_EXPIRE 2s)", attempts, None, wrong)
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
    from tests.helpers import reset_publisher

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
    row = Row("21. broker down at .delay()", attempts, None, left + attempts - raised)
    row.figures.append(f"error raised {raised}/{attempts}; keys left held {left}")
    return row


def _drops(logdir: Path, task: object) -> int:
    marker = f"second delivery of {task.name}"  # type: ignore[attr-defined]
    return sum(log.read_text().count(marker) for log in logdir.glob("*.log"))


def _runs_of(key: str, task_id: str) -> list[tuple[float, float]]:
    from tests import tasks

    return [
        (float(r["start"]), float(r["end"]))  # type: ignore[arg-type]
        for r in tasks.runs(key)
        if r.get("task_id") == task_id
    ]


def redelivered(broker: dict[str, str], tries: int) -> list[Row]:
    """Workers with acks_late and a 2 s visibility timeout run 6 s calls: the
    broker delivers each again while it runs. Attempts: second deliveries seen
    (dropped, each logged); overlaps: runs of one call at once; wrong: a call
    whose result is not its own, or that ran more or less than once.
    until_started: a newer call is sent (and takes the call's mark) while the
    first runs; coalesce: the copy must not wait for the run lock and run again."""
    from django_tasklock import lock_id_for
    from django_tasklock.calls import call_of
    from django_tasklock.status import lock_status
    from tests import tasks

    logdir = Path(tempfile.mkdtemp(prefix="redeliver-"))
    workers = start_workers(
        broker,
        ["fault-redeliver-1", "fault-redeliver-2"],
        extra_env={"TASKLOCK_TEST_VISIBILITY": "2"},
        logdir=logdir,
    )
    cases = [
        ("22. message redelivered while it runs", tasks.finish_once),
        ("25. until_started copy after a newer call", tasks.debounced),
        ("26. coalesce copy while it runs", tasks.coalesced),
    ]
    rows = []
    try:
        for case, task in cases:
            overlapping = wrong = 0
            newer_sent = 0
            counts: list[int] = []
            for attempt in range(tries):
                key = f"redelivered-{task.name}-{attempt}"
                result = task.delay(key, 6.0)
                if task is tasks.debounced:
                    lock_id = lock_id_for(task, key, 6.0)
                    started = ("started", result.id)
                    wait_until(
                        lambda i=lock_id, s=started: call_of(lock_status(i).value) == s,
                        30,
                    )
                    # The same call (same arguments), sent while the first runs.
                    newer = task.apply_async((key, 6.0), countdown=1)
                    took = call_of(lock_status(lock_id).value) == ("queued", newer.id)
                    newer_sent += took
                    wrong += not took
                    wrong += newer.get(timeout=60) != f"{key}:{newer.id}"
                wrong += result.get(timeout=60) != f"{key}:{result.id}"
                holds = _runs_of(key, result.id)
                overlapping += overlaps(holds)
                counts.append(len(holds))
                wrong += len(holds) != 1
            drops = _drops(logdir, task)
            row = Row(case, drops, overlapping, wrong)
            row.figures.append(
                f"second deliveries dropped {drops}; runs per call "
                f"{min(counts, default=0)}-{max(counts, default=0)}"
            )
            if task is tasks.debounced:
                row.figures.append(
                    f"newer calls that took the mark {newer_sent}/{tries}"
                )
            rows.append(row)
    finally:
        stop_workers(workers)
    return rows


def killed_and_redelivered(broker: dict[str, str], tries: int) -> Row:
    """``task_acks_late`` and ``task_reject_on_worker_lost``: the pool process
    running a call is SIGKILLed and Celery puts its message back. The copy must
    run at once (the dead run's lock has most of its 60 s left), never before
    the kill. Overlaps: a copy that started while the first run still lived."""
    from django_tasklock import lock_id_for
    from django_tasklock.status import lock_status
    from tests import tasks

    workers = start_workers(
        broker, ["fault-reject-1"], extra_env={"TASKLOCK_TEST_REJECT_ON_LOST": "1"}
    )
    attempts = overlapping = wrong = 0
    after: list[float] = []
    left: list[float] = []
    try:
        for attempt in range(tries):
            attempts += 1
            key = f"killed-redelivered-{attempt}"
            lock_id = lock_id_for(tasks.finish_when_told, key)
            result = tasks.finish_when_told.delay(key)
            wait_until(lambda key=key: len(tasks.runs(key)) == 1, 60)
            left.append(lock_status(lock_id).ttl or 0.0)
            os.kill(int(tasks.runs(key)[0]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
            killed_at = time.monotonic()
            try:
                wait_until(lambda key=key: len(tasks.runs(key)) == 2, 60)
            except AssertionError:
                wrong += 1  # the copy never ran: the call was lost
                continue
            second = float(tasks.runs(key)[1]["start"])  # type: ignore[arg-type]
            after.append(second - killed_at)
            overlapping += second < killed_at
            tasks.let_go(key)
            wrong += result.get(timeout=60) != f"{key}:{result.id}"
            wrong += after[-1] > left[-1]  # it waited for the dead lock to expire
    finally:
        stop_workers(workers)
    row = Row("23. pool process killed, call redelivered", attempts, overlapping, wrong)
    row.figures.append(
        f"the copy ran {min(after, default=0):.1f}-{max(after, default=0):.1f}s "
        f"after the kill, the dead run's lock having {min(left, default=0):.0f}-"
        f"{max(left, default=0):.0f}s left"
    )
    return row


def publish_timed_out(tries: int) -> Row:
    """memcached paused (SIGSTOP) at ``.delay()`` past the client's timeout,
    then resumed: the mark's write lands for a call no broker saw. It must be
    removed once the store answers, and the same call sent again published."""
    from django_tasklock import LockBackendError, lock_id_for, orphans
    from django_tasklock.status import lock_status
    from reliability.faults import use_cache
    from tests import tasks
    from tests.services import Memcached, stop_and_wait

    server = Memcached().start()
    attempts = raised = removed = published = 0
    gone: list[float] = []
    try:
        with use_cache(server.address, timeout=0.5, connect_timeout=0.5):
            tasks.finish_once.apply_async(("warm-up",), queue="fault-paused")
            for attempt in range(tries):
                attempts += 1
                key = f"paused-publish-{attempt}"
                lock_id = lock_id_for(tasks.finish_once, key)
                before = orphans.removed_count()
                stop_and_wait(server.process.pid)  # type: ignore[union-attr]
                try:
                    tasks.finish_once.apply_async((key,), queue="fault-paused")
                except LockBackendError:
                    raised += 1
                finally:
                    server.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                resumed = time.monotonic()
                try:
                    wait_until(lambda b=before: orphans.removed_count() > b, 10)
                    wait_until(lambda i=lock_id: not lock_status(i).held, 10)
                except AssertionError:
                    continue
                removed += 1
                gone.append(time.monotonic() - resumed)
                again = tasks.finish_once.apply_async((key,), queue="fault-paused")
                held = lock_status(lock_id).value
                published += held == f"queued:{again.id}"
    finally:
        from django_tasklock.backends import close_thread_connections

        close_thread_connections()
        server.stop()
    wrong = (attempts - raised) + (attempts - removed) + (attempts - published)
    row = Row("24. store paused at .delay(), resumed", attempts, None, wrong)
    row.figures.append(
        f"error raised {raised}/{attempts}; phantom mark removed {removed}/"
        f"{attempts}, {min(gone, default=0) * 1000:.0f}-"
        f"{max(gone, default=0) * 1000:.0f} ms after SIGCONT; the same call sent "
        f"again published {published}/{attempts}"
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
    # One worker with a child to spare: a call sent again after a kill must not
    # wait for the pool to replace the dead child (Celery's scheduling, not the
    # lock's).
    workers = start_workers(broker, ["fault-recovery"], concurrency=4)
    try:
        rows.append(recovery.child_killed(1 if quick else 3))
        rows.append(recovery.worker_killed_elsewhere(broker, 1 if quick else 3))
    finally:
        stop_workers(workers)
    rows.append(never_consumed(1 if quick else 3))
    rows.append(publish_fails(2 if quick else 10))
    rows += redelivered(broker, 1 if quick else 3)
    rows.append(killed_and_redelivered(broker, 1 if quick else 3))
    rows.append(publish_timed_out(1 if quick else 5))
    return sorted(rows, key=lambda row: int(row.case.split(".", 1)[0]))
