"""Park and promote (``on_contention="park"``) under real ``celery worker``
processes on a private Redis broker, locks on memcached: every call runs
once, never more than the limit at once, parked calls start in the order
they parked, a full line refuses or drops with the outcome told, and parked
calls outlive the worker that ran their lock's holder (SIGKILL)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from django_tasklock import ParkedCallDropped, ParkFull, lock_id_for
from django_tasklock.parking import ParkLine
from django_tasklock.status import lock_status
from django_tasklock.tokens import process_alive
from tests import tasks
from tests.helpers import wait_until
from tests.workers import (
    kill_node,
    most_at_once,
    overlaps,
    start_workers,
    started_runs,
    stop_workers,
    three_parked_behind_a_long_run,
    workers_said,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("memcached_locks")]


@pytest.fixture(scope="module")
def workers(broker):
    """Two worker processes, three pool processes each."""
    processes = start_workers(broker, ["park-1", "park-2"], concurrency=3)
    yield processes
    stop_workers(processes)


def _steps(task, key: str, action: str) -> list[str]:
    lock_id = lock_id_for(task, key=key, n=0)
    return [step[1] for step in tasks.park_steps(lock_id) if step[0] == action]


def _holds(key: str) -> list[tuple[float, float]]:
    return [(run["start"], run["end"]) for run in tasks.runs(key)]  # type: ignore[misc]


def _results(results, timeout: float = 120) -> list[object]:
    outcomes: list[object] = []
    for result in results:
        try:
            outcomes.append(result.get(timeout=timeout))
        except (ParkFull, ParkedCallDropped) as exc:
            outcomes.append(exc)
        except CeleryTimeout:
            pytest.fail(f"call {result.id} has no outcome: {workers_said()}")
    return outcomes


def _busy(task, key: str) -> None:
    """Until a run of ``key`` holds the lock (sent first, long)."""
    lock_id = lock_id_for(task, key=key, n=0)
    wait_until(lambda: lock_status(lock_id).held, 30, workers_said)


def test_parked_calls_start_in_the_order_they_parked(workers):
    key = "park-order"
    results = [tasks.parked_one.delay(key, n, seconds=0.1) for n in range(20)]
    outcomes = _results(results)
    assert outcomes == [f"{key}:{r.id}" for r in results]  # each its own run
    runs = tasks.runs(key)
    started = [run["task_id"] for run in sorted(runs, key=lambda r: r["start"])]
    steps = tasks.park_steps(lock_id_for(tasks.parked_one, key=key, n=0))
    # In the order of their tickets (the workers' signals may cross).
    parked = [s[1] for s in sorted(steps, key=lambda s: s[3]) if s[0] == "parked"]
    print(f"{len(parked)} of 20 calls parked; runs {len(runs)}")
    assert sorted(started) == sorted(r.id for r in results)  # once each
    assert overlaps(_holds(key)) == 0
    assert parked, "no call parked: the test did not contend"
    # The parked calls started in the order they parked (a newcomer behind
    # them parks too, so none is overtaken).
    assert [c for c in started if c in parked] == parked


def test_at_most_two_at_once_and_every_call_once(workers):
    key = "park-two"
    results = [tasks.parked_two.delay(key, n, seconds=0.2) for n in range(30)]
    outcomes = _results(results)
    assert outcomes == [f"{key}:{r.id}" for r in results]
    runs = tasks.runs(key)
    assert sorted(run["task_id"] for run in runs) == sorted(r.id for r in results)
    peak = most_at_once(_holds(key))
    print(
        f"most at once: {peak}; parked {len(_steps(tasks.parked_two, key, 'parked'))}"
    )
    assert peak == 2  # the limit, reached and never passed
    line = ParkLine(lock_id_for(tasks.parked_two, key=key, n=0), None, 60).read()
    assert not line.waiting and not line.running


def _behind_a_long_run(task, key: str, calls: int, *actions: str) -> list:
    """A long first call of ``task``, then ``calls`` short ones, each sent
    once the one before was said (``actions``: parked, refused): the
    results, the first's first."""
    first = task.delay(key, 0, seconds=3)
    _busy(task, key)
    later = []
    for n in range(1, calls + 1):
        later.append(task.delay(key, n, seconds=0.05))
        # Each said before the next is sent: the order is known.
        wait_until(
            lambda n=n: sum(len(_steps(task, key, a)) for a in actions) >= n,
            30,
            workers_said,
        )
    return [first, *later]


def test_a_full_line_refuses_the_newest_and_each_refused_call_is_told(workers):
    key = "park-refuse"
    results = _behind_a_long_run(tasks.parked_refusing, key, 6, "parked", "refused")
    outcomes = _results(results)
    refused = [o for o in outcomes if isinstance(o, ParkFull)]
    assert [type(o).__name__ for o in outcomes[1:]] == ["str"] * 3 + ["ParkFull"] * 3
    lock_id = lock_id_for(tasks.parked_refusing, key=key, n=0)
    assert all(o.lock_id == lock_id for o in refused)
    assert len(tasks.runs(key)) == 4


def test_drop_oldest_tells_the_dropped_call_who_took_its_place(workers):
    key = "park-drop"
    results = _behind_a_long_run(tasks.parked_dropping, key, 4, "parked")
    later = results[1:]
    outcomes = _results(results)
    dropped = outcomes[1:3]
    assert all(isinstance(o, ParkedCallDropped) for o in dropped), outcomes
    # The oldest left for the newer: call 1 for call 3, call 2 for call 4.
    assert [o.by for o in dropped] == [later[2].id, later[3].id]  # type: ignore[union-attr]
    assert outcomes[3:] == [f"{key}:{r.id}" for r in later[2:]]
    assert sorted(r["n"] for r in tasks.runs(key)) == [0, 3, 4]


def _all_ran_after(key: str, later: list, killed: float) -> float:
    """Seconds from ``killed`` to the first parked call's start, once each
    of ``later`` ran once with its own result."""
    outcomes = _results(later)
    assert outcomes == [f"{key}:{r.id}" for r in later]
    assert sorted(r["n"] for r in started_runs(key)) == [0, 1, 2, 3]
    resumed = min(r["start"] for r in tasks.runs(key) if r["n"] != 0)
    print(f"the next parked call started {resumed - killed:.2f}s after the kill")
    return resumed - killed


def test_parked_calls_outlive_the_killed_process_of_the_running_call(workers):
    key = "park-kill"
    first, later, pid = three_parked_behind_a_long_run(key)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not process_alive(pid), 10)
    assert _all_ran_after(key, later, killed) < 30
    # The killed call's own outcome is Celery's (WorkerLostError, acks early),
    # stored by the worker's main process once it saw its child die.
    wait_until(lambda: first.state == "FAILURE", 30, lambda: first.state)


def test_parked_calls_outlive_the_whole_worker_that_ran_and_parked_them(
    workers, broker
):
    """The worker node (main process and pool) of the running call is
    SIGKILLed: no ``task_failure`` frees its slot, its sweep dies with it.
    Its lock is freed by crash recovery (its holder's process is gone) and
    the other node's sweep sends the next parked call."""
    key = "park-node"
    _first, later, pid = three_parked_behind_a_long_run(key)
    killed = kill_node(pid, workers, broker, "park-3")
    assert _all_ran_after(key, later, killed) < 40
