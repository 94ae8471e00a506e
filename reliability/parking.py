"""Fault case 57: parked calls (``on_contention="park"``) when the worker
node that runs their lock's call and parked them is SIGKILLed whole, its
main process and its pool at once, over real ``celery worker`` processes on
a private Redis broker, locks on memcached.

Nothing of the killed node tells anyone: no ``task_failure`` frees its slot,
its sweep dies with it. The lock's slot is freed by crash recovery (its
holder's process gone, on this host) and the other node's sweep sends the
next parked call. Every parked call must run once, in the order it parked;
overlaps: runs of the lock that overlapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reliability.faults import Row
from tests.workers import (
    kill_node,
    overlaps,
    start_workers,
    started_runs,
    stop_workers,
    three_parked_behind_a_long_run,
)

if TYPE_CHECKING:
    from tests.services import Redis

#: Parked calls behind the killed run, per attempt.
PARKED = 3


def _attempt(key: str, workers: list, broker: dict[str, str]) -> tuple[int, float]:
    """One kill: how many outcomes were wrong, and seconds from the kill to
    the first parked call's start."""
    from django_tasklock import lock_id_for
    from tests import tasks

    _first, later, pid = three_parked_behind_a_long_run(key)
    lock_id = lock_id_for(tasks.parked_killable, key=key, n=0)

    def parked() -> list[list[str]]:
        return [s for s in tasks.park_steps(lock_id) if s[0] == "parked"]

    killed = kill_node(pid, workers, broker, f"{key}-again")
    wrong = 0
    for result in later:
        try:
            wrong += result.get(timeout=60) != f"{key}:{result.id}"
        except Exception:  # lost or failed: the case exists to catch it
            wrong += 1
    runs = started_runs(key)
    wrong += sorted(int(r["n"]) for r in runs) != [0, 1, 2, 3]  # type: ignore[call-overload]
    by_ticket = [s[1] for s in sorted(parked(), key=lambda s: int(s[3]))]
    by_start = [r["task_id"] for r in sorted(runs, key=lambda r: r["start"])]
    wrong += [c for c in by_start if c in by_ticket] != by_ticket
    resumed = min(float(r["start"]) for r in runs if r["n"] != 0)  # type: ignore[arg-type]
    return wrong, resumed - killed


def run(redis: Redis, quick: bool) -> list[Row]:
    from reliability.calls import _broker
    from tests import tasks

    broker = _broker(redis)
    tasks.forget_runs()
    workers = start_workers(broker, ["fault-park-1", "fault-park-2"], concurrency=3)
    attempts = wrong = 0
    took: list[float] = []
    holds: list[tuple[float, float]] = []
    try:
        for attempt in range(1 if quick else 3):
            attempts += 1
            key = f"fault-park-{attempt}"
            bad, seconds = _attempt(key, workers, broker)
            wrong += bad
            took.append(seconds)
            ended = [r for r in tasks.runs(key) if r.get("phase") != "start"]
            holds += [(r["start"], r["end"]) for r in ended]  # type: ignore[misc]
    finally:
        stop_workers(workers)
    row = Row(
        "57. parked calls: the running node SIGKILLed", attempts, overlaps(holds), wrong
    )
    row.figures.append(
        f"the next parked call started {min(took, default=0):.1f}-"
        f"{max(took, default=0):.1f}s after the kill; {PARKED} parked each time, "
        "each ran once, in the order it parked"
    )
    return [row]
