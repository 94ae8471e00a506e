"""On a store without a waiting line (PostgreSQL, LocMem), a blocking acquire
polls; a release in its own process wakes it at once (``wait_here``), where
a poll's pause would have grown to half a second."""

from __future__ import annotations

import statistics
import time

import pytest

from django_tasklock import Lock
from tests.helpers import background


@pytest.mark.parametrize("alias", ["postgres", "locmem"])
def test_a_release_here_wakes_a_polling_waiter_at_once(settings, alias, request):
    if alias == "postgres":
        request.getfixturevalue("postgres").clear()
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": None}
    gaps = []
    for _ in range(5):
        holder = Lock("polled-here", expire=30)
        assert holder.acquire()
        took: list[float] = []

        def wait(took: list[float] = took) -> None:
            lock = Lock("polled-here", expire=30)
            assert lock.acquire(blocking=True, timeout=30)
            took.append(time.monotonic())
            lock.release()

        thread, outcome = background(wait)
        time.sleep(1.0)  # the poll's pause grows to its longest (0.5 s)
        released_at = time.monotonic()
        holder.release()
        thread.join(30)
        assert "error" not in outcome, outcome
        gaps.append(took[0] - released_at)
    print(f"{alias}: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    # Polling: each gap about uniform over a pause of 0.25-0.5 s.
    assert statistics.median(gaps) < 0.04
