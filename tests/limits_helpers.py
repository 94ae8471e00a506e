"""Rate-limit helpers shared by the tests and the reliability suite: the
guarantees as formulas over recorded admission times, and a storm of
processes admitting under one limit."""

from __future__ import annotations

import math
import time
from typing import Any

from tests.workers import Storms, storm


def window_violations(times_ms: list[int], count: int, period_ms: int) -> int:
    """Admissions that make more than ``count`` in some period of ``period_ms``:
    pairs ``count`` apart (in time order) less than a period apart."""
    times = sorted(times_ms)
    return sum(
        times[i + count] - times[i] < period_ms for i in range(len(times) - count)
    )


def smooth_violations(
    times_ms: list[int], count: int, period_ms: int, burst: int
) -> int:
    """Admissions GCRA with these parameters would have refused, replayed in
    time order with the store's own rounding (its arrival time kept to the
    microsecond)."""
    interval = period_ms / count
    tolerance = (burst - 1) * interval
    tat: float | None = None
    bad = 0
    for at in sorted(times_ms):
        tat = at if tat is None else max(tat, at)
        bad += tat - at > tolerance + 1e-6
        tat = float(f"{tat + interval:.3f}")
    return bad


def admitted_share(
    times_ms: list[int], count: int, period_ms: int, burst: int | None = None
) -> float:
    """How much of what the limit allows callers got. Window kind: the
    admissions in the whole periods from the first one, over ``count`` per
    period (a run that ends part-way into a period is not judged on it, so the
    figure does not jump with where the run stopped). Smooth kind (``burst``
    given): the admissions over ``burst`` plus one per interval between the
    first and the last."""
    times = sorted(times_ms)
    if len(times) < 2:
        return 0.0
    span = times[-1] - times[0]
    if burst is None:
        periods = span // period_ms
        if periods == 0:
            return len(times) / count
        ends = times[0] + periods * period_ms
        return sum(at < ends for at in times) / (count * periods)
    allowed = burst + math.floor(span * count / period_ms)
    return len(times) / allowed


def admit_until(
    tasklock: dict[str, object],
    limiter: tuple[str, str, dict[str, Any]],
    start_at: float,
    give_up: float,
) -> list[int]:
    """Admit under one limit, in a storm (``tests.workers.storm``), until its
    processes have been admitted as often as it wants between them, coming
    back when each refusal says; the admission times (ms, the limit's clock)."""
    from django.conf import settings

    from django_tasklock import RateLimiter
    from tests.workers import _count_hold, _storm_over

    settings.TASKLOCK = tasklock
    limit_id, rate, options = limiter
    rate_limiter = RateLimiter(limit_id, rate, **options)
    times: list[int] = []
    while time.monotonic() < start_at:
        time.sleep(0.005)
    ends = start_at + give_up
    while not _storm_over() and time.monotonic() < ends:
        admission = rate_limiter.admit()
        if admission:
            times.append(round(admission.at * 1000))
            _count_hold()
        else:
            time.sleep(min(admission.retry_after, 1.0))
    return times


def admission_storm(
    tasklock: dict[str, object],
    limiter: tuple[str, str, dict[str, Any]],
    processes: int,
    wanted: int,
    give_up: float = 120.0,
    storms: Storms | None = None,
) -> list[int]:
    """``processes`` spawned processes (of ``storms`` when given) admitting
    under one limit, started together, until ``wanted`` admissions between
    them; every admission's time."""
    found = storm(
        admit_until, processes, wanted, (tasklock, limiter), (), give_up, storms=storms
    )
    return sorted(at for times in found for at in times)
