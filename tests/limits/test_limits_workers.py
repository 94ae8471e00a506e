"""``@rate_limited`` over real ``celery worker`` processes: two prefork workers
of four processes each take three times more calls than the limit allows per
period; every call runs exactly once, and the admissions keep to the limit."""

from __future__ import annotations

import pytest

from django_tasklock import RateLimiter
from tests import tasks
from tests.helpers import wait_until
from tests.limits_helpers import smooth_violations, window_violations
from tests.workers import start_workers, stop_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(broker):
    processes = start_workers(broker, ["limits-a", "limits-b"], concurrency=4)
    yield processes
    stop_workers(processes)


def run_each_once(task, key, calls, timeout=60):
    """Send ``calls`` calls of ``task`` at once (its ``n`` from 0 up); every
    one returns and ran exactly once. Their results, and their runs."""
    sent = [task.delay(key, n) for n in range(calls)]
    assert sorted(result.get(timeout=timeout) for result in sent) == list(range(calls))
    runs = tasks.runs(key)
    assert sorted(run["n"] for run in runs) == list(range(calls)), "ran twice or never"
    return sent, runs


@pytest.mark.parametrize(
    ("task", "kind"),
    [(tasks.limited_window, "window"), (tasks.limited_smooth, "smooth")],
    ids=["window", "smooth"],
)
def test_every_call_runs_once_at_the_limits_pace(workers, settings, task, kind):
    name = f"tests.limited-{kind}"
    cache = "redis" if kind == "smooth" else "default"
    RateLimiter(name, "4/s", kind=kind, burst=2, cache=cache).reset()
    _sent, runs = run_each_once(task, f"limited-{kind}", 12)  # three periods' worth
    # Sent again at the time each refusal named, without spending max_retries (0).
    assert all(run["retries"] == 0 for run in runs)
    times = [int(run["at"]) for run in runs]  # type: ignore[call-overload]
    if kind == "window":
        assert window_violations(times, 4, 1000) == 0
    else:
        assert smooth_violations(times, 4, 1000, 2) == 0
    # Three periods' worth cannot fit in less than two periods.
    assert max(times) - min(times) >= 2000 - 1


def test_a_rate_limit_above_an_enqueue_time_lock_loses_no_call(workers):
    RateLimiter("tests.limited-until-finished", "2/s").reset()
    _sent, runs = run_each_once(
        tasks.limited_until_finished, "limited-until-finished", 6
    )
    assert window_violations([int(run["at"]) for run in runs], 2, 1000) == 0  # type: ignore[call-overload]


def test_a_backlog_is_sent_again_once_per_call_and_keeps_its_final_state(workers):
    """Sixty calls at once over a 10/s limit: each refused call is sent again
    for its own turn (not all for the moment the refusal named, to be refused
    again but for ten), and the state each call ends in is its last run's: a
    refused delivery's RETRY never lands after the SUCCESS of the call's run."""
    from celery.result import AsyncResult

    from tests.celery_app import app

    RateLimiter("tests.limited-backlog", "10/s").reset()
    sent, runs = run_each_once(tasks.limited_backlog, "limited-backlog", 60, 90)
    times = sorted(int(run["at"]) for run in runs)  # type: ignore[call-overload]
    # On failure, the admissions of the crowded second, to tell a lost state
    # (a run of them restarting the count) from a clock read out of order.
    assert window_violations(times, 10, 1000) == 0, [
        times[i : i + 11]
        for i in range(len(times) - 10)
        if times[i + 10] - times[i] < 1000
    ][:2]
    ids = [result.id for result in sent]
    # Every delivery over: each refused one sent its call again before it
    # ended, and every call has run, so none is still to come.
    wait_until(lambda: tasks.deliveries(ids)[1] == tasks.deliveries(ids)[0], 30)
    delivered = tasks.deliveries(ids)[0]
    print(f"60 calls over 10/s: {delivered} deliveries, {delivered / 60:.2f} per call")
    assert delivered <= 2 * 60, f"{delivered} deliveries for 60 calls"
    states = [AsyncResult(task_id, app=app).state for task_id in ids]
    assert states == ["SUCCESS"] * 60, [s for s in states if s != "SUCCESS"]
