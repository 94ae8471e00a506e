"""A process of the park line tests (tests/integrations/test_park.py): it
parks, then starts, calls of one park line as fast as it can, beside other
processes doing the same, and says what it got."""

from __future__ import annotations

import time


def park_then_start(
    tasklock: dict[str, object], lock_id: str, me: int, calls: int, processes: int
) -> tuple[list[int], list[str]]:
    """Park ``calls`` calls of its own in the line of ``lock_id``, wait until
    every process's are parked, then try to start every call of every
    process: the tickets its calls got, and the ids it was told to run."""
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings
    from django.core.cache import close_caches

    from django_tasklock.parking import ParkLine, Verdict

    settings.TASKLOCK = tasklock
    line = ParkLine(lock_id, None, 120)
    tickets = []
    for n in range(calls):
        parked = line.park(f"call-{me}-{n}", 10_000, "refuse", False)
        assert parked is not None and parked[0] == ""
        tickets.append(parked[1])
    deadline = time.monotonic() + 60
    while line.read().tickets < calls * processes:  # (tickets only grow)
        assert time.monotonic() < deadline, "the others' calls never showed"
        time.sleep(0.01)
    ran = []
    for other in range(processes):
        for n in range(calls):
            call_id = f"call-{(me + other) % processes}-{n}"
            verdict = line.start(call_id, f"token-{me}", lambda token: True)
            if verdict == Verdict.RUN:
                ran.append(call_id)
    close_caches()
    return tickets, ran
