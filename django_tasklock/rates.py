"""Rates as users write them: ``"10/m"``, ``"100/30s"``, ``"5000/h"``, or
``(count, seconds)``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

from .exceptions import InvalidArgument

__all__ = ["MAX_WINDOW_COUNT", "Rate", "RateSpec", "parse_rate"]

#: Seconds per unit in a rate's period.
UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: The shortest period: the limits keep time in whole milliseconds.
MIN_PERIOD: Final = 0.001
#: The longest period: memcached's relative expiry ends at 30 days.
MAX_PERIOD: Final = 30 * 86400
#: The window kind keeps one timestamp per admission of the last period in one
#: store item (about 14 bytes each, under memcached's 1 MB item limit with room).
MAX_WINDOW_COUNT: Final = 20_000

_RATE: Final = re.compile(r"^\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([smhd])\s*$")


@dataclass(frozen=True)
class Rate:
    """``count`` admissions per ``period`` seconds."""

    count: int
    period: float

    @property
    def interval(self) -> float:
        """Seconds between admissions at the steady rate."""
        return self.period / self.count

    def __str__(self) -> str:
        for unit, seconds in sorted(UNITS.items(), key=lambda item: -item[1]):
            if self.period == seconds:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.period:g}s"


RateSpec = str | tuple[int, float] | Rate


def parse_rate(value: object, *, name: str = "rate") -> Rate:
    """``value`` as a Rate; ValueError naming ``name`` and the accepted forms
    for anything else (``"10/x"``, a count of 0, a period <= 0, a bool)."""
    forms = (
        '"N/s", "N/m", "N/h" or "N/d" (N admissions per second, minute, hour or '
        'day), "N/30s" or "N/5m" for other periods, or (N, seconds)'
    )
    if isinstance(value, Rate):
        count, period = value.count, value.period
    elif isinstance(value, str):
        match = _RATE.match(value)
        if match is None:
            raise InvalidArgument(f"{name} {value!r} is not a rate: write {forms}.")
        count = int(match.group(1))
        multiple = float(match.group(2)) if match.group(2) else 1.0
        period = multiple * UNITS[match.group(3)]
    elif (
        isinstance(value, tuple)
        and len(value) == 2
        and all(
            isinstance(part, (int, float)) and not isinstance(part, bool)
            for part in value
        )
    ):
        count, period = value
        if count != int(count):
            raise InvalidArgument(
                f"{name} {value!r}: the count must be a whole number."
            )
        count = int(count)
    else:
        raise InvalidArgument(f"{name} {value!r} is not a rate: write {forms}.")
    return _checked(count, period, value, name)


def _checked(count: int, period: float, value: object, name: str) -> Rate:
    """``count`` per ``period`` as a Rate, if a limit can keep it."""
    if count < 1:
        raise InvalidArgument(
            f"{name} {value!r} admits nothing: the count must be at least 1. To stop "
            "a task for a while, use RateLimiter.pause(seconds)."
        )
    if not math.isfinite(period) or period <= 0:
        raise InvalidArgument(
            f"{name} {value!r}: the period must be more than 0 seconds."
        )
    if period < MIN_PERIOD:
        per_second = count / period
        raise InvalidArgument(
            f"{name} {value!r}: the period must be at least 1 millisecond (0.001s): "
            "limits keep time in whole milliseconds, so a shorter one cannot be "
            f"enforced. For the same pace write it per second: "
            f'"{max(round(per_second), 1)}/s".'
        )
    if period > MAX_PERIOD:
        raise InvalidArgument(
            f"{name} {value!r}: the period must be at most 30 days (memcached's "
            "longest relative expiry)."
        )
    return Rate(count, float(period))
