"""The wait of a blocking acquire: random, growing pauses up to a deadline."""

from __future__ import annotations

import random
import time
from typing import Final

__all__ = ["POLL_MAX", "POLL_MIN", "backoff", "next_wait"]

#: Shortest and longest pause between two tries of a blocking acquire.
POLL_MIN: Final = 0.01
POLL_MAX: Final = 0.5


def backoff(pause: float, deadline: float | None, now: float) -> float | None:
    """Wait before a blocking acquire's next try: a random time up to ``pause``,
    never past ``deadline``. The next try's pause, or None (without waiting) once
    the deadline has passed."""
    wait = next_wait(pause, deadline, now)
    if wait is None:
        return None
    time.sleep(wait[0])
    return wait[1]


def next_wait(
    pause: float, deadline: float | None, now: float
) -> tuple[float, float] | None:
    """``backoff``'s wait, not waited: how long to wait before the next try
    and the pause after it; None once the deadline has passed."""
    if deadline is not None and now >= deadline:
        return None
    sleep = random.uniform(pause / 2, pause)
    return (sleep if deadline is None else min(sleep, deadline - now)), min(
        pause * 2, POLL_MAX
    )
