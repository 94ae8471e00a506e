"""The TASKLOCK setting, read on every use so that ``override_settings`` works.

Every value is validated where it is read: a bad value raises
``LockConfigurationError`` instead of silently disabling a lock, and
``python manage.py check`` reports the same problem earlier (see ``checks.py``).
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal

from django.conf import settings as django_settings

from .exceptions import InvalidLockExpire, LockConfigurationError

__all__ = ["DEFAULTS", "MAX_EXPIRE", "settings", "validate_expire"]

#: memcached reads a relative expiry above 30 days as an absolute Unix time.
MAX_EXPIRE: Final = 30 * 24 * 60 * 60

Protocol = Literal["auto", "meta", "classic"]
PROTOCOLS: Final = ("auto", "meta", "classic")

DEFAULTS: Final[dict[str, Any]] = {
    "LOCK_EXPIRE": 600,
    "CACHE": "default",
    "MEMCACHED_PROTOCOL": "auto",
}


def validate_expire(value: object, *, name: str = "expire") -> float:
    """Return ``value`` if it is a valid lock expiry, else raise InvalidLockExpire.

    A valid expiry is an int or float number of seconds, greater than 0 and at
    most 30 days (2,592,000). ``None`` (never expire) is refused on purpose: a lock
    whose holder crashed would then be held forever.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidLockExpire(
            f"{name} must be a number of seconds (int or float) greater than 0 and "
            f"at most {MAX_EXPIRE} (30 days), not {value!r}"
            + (
                "; a lock that never expires would stay held forever after a crash"
                if value is None
                else ""
            )
            + "."
        )
    if not math.isfinite(value) or value <= 0 or value > MAX_EXPIRE:
        raise InvalidLockExpire(
            f"{name} must be greater than 0 and at most {MAX_EXPIRE} seconds "
            f"(30 days), not {value!r}. memcached reads larger values as a Unix "
            "timestamp and 0 or less as 'already expired'."
        )
    return value


def setting_problems(raw: object) -> list[tuple[str, str]]:
    """List ``(key, message)`` for every problem in a TASKLOCK value.

    ``key`` is ``""`` when TASKLOCK itself is not a dict.
    """
    if not isinstance(raw, dict):
        return [("", f"TASKLOCK must be a dict, not {type(raw).__name__}.")]
    problems: list[tuple[str, str]] = []
    for key in raw:
        if key not in DEFAULTS:
            known = ", ".join(sorted(DEFAULTS))
            problems.append(
                (str(key), f"Unknown TASKLOCK key {key!r}; known keys: {known}.")
            )
    if "LOCK_EXPIRE" in raw:
        try:
            validate_expire(raw["LOCK_EXPIRE"], name="TASKLOCK['LOCK_EXPIRE']")
        except InvalidLockExpire as exc:
            problems.append(("LOCK_EXPIRE", str(exc)))
    if "CACHE" in raw and (not isinstance(raw["CACHE"], str) or not raw["CACHE"]):
        problems.append(
            (
                "CACHE",
                "TASKLOCK['CACHE'] must be the name of a CACHES entry, "
                f"not {raw['CACHE']!r}.",
            )
        )
    if "MEMCACHED_PROTOCOL" in raw and raw["MEMCACHED_PROTOCOL"] not in PROTOCOLS:
        problems.append(
            (
                "MEMCACHED_PROTOCOL",
                "TASKLOCK['MEMCACHED_PROTOCOL'] must be one of "
                f"{', '.join(PROTOCOLS)}, "
                f"not {raw['MEMCACHED_PROTOCOL']!r}.",
            )
        )
    return problems


class Settings:
    """Typed view of ``settings.TASKLOCK``; every attribute is read anew."""

    def _get(self, key: str) -> Any:
        raw = getattr(django_settings, "TASKLOCK", None)
        if raw is None:
            return DEFAULTS[key]
        if not isinstance(raw, dict):
            raise LockConfigurationError(setting_problems(raw)[0][1])
        if key not in raw:
            return DEFAULTS[key]
        value = raw[key]
        for problem_key, message in setting_problems({key: value}):
            if problem_key == key:
                raise LockConfigurationError(message)
        return value

    @property
    def LOCK_EXPIRE(self) -> float:
        """Default expiry of a lock in seconds."""
        value: float = self._get("LOCK_EXPIRE")
        return value

    @property
    def CACHE(self) -> str:
        """Alias of the CACHES entry that holds the locks."""
        value: str = self._get("CACHE")
        return value

    @property
    def MEMCACHED_PROTOCOL(self) -> Protocol:
        """``auto`` (meta commands; gets/cas where missing), ``meta`` or ``classic``."""
        value: Protocol = self._get("MEMCACHED_PROTOCOL")
        return value


settings = Settings()
