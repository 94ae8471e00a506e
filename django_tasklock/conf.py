"""The TASKLOCK setting, read on every use so that ``override_settings`` works.

Every value is validated where it is read: a bad value raises
``LockConfigurationError`` instead of silently disabling a lock, and
``python manage.py check`` reports the same problem earlier (see ``checks.py``).
"""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING, Any, Final, Literal

from django.conf import settings as django_settings

from .exceptions import InvalidArgument, InvalidLockExpire, LockConfigurationError
from .rates import parse_rate

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DEFAULTS",
    "MAX_EXPIRE",
    "settings",
    "validate_bool",
    "validate_choice",
    "validate_expire",
    "validate_seconds",
]

#: memcached reads a relative expiry above 30 days as an absolute Unix time.
MAX_EXPIRE: Final = 30 * 24 * 60 * 60

Protocol = Literal["auto", "meta", "classic"]
PROTOCOLS: Final = ("auto", "meta", "classic")
#: What ``lock_defaults()`` gives: LOCK_EXPIRE, CACHE, MEMCACHED_PROTOCOL,
#: RENEW and LIVENESS.
LockDefaults = tuple[float, str, Protocol, bool, "float | None"]
Contention = Literal["skip", "raise", "retry", "wait"]
CONTENTION_POLICIES: Final = ("skip", "raise", "retry", "wait")
TIMEOUT_POLICIES: Final = ("skip", "raise")
#: What ``on_contention=`` takes on a decorator: the setting's, and ``park``
#: (a Celery task's calls only, so never a project-wide default).
DECORATOR_CONTENTION: Final = (*CONTENTION_POLICIES, "park")
#: Who leaves a full park line: ``on_park_full=``.
PARK_FULL_POLICIES: Final = ("refuse", "drop_oldest", "replace")
#: How many calls a park line holds unless ``park=`` says.
DEFAULT_PARK: Final = 100
RATE_KINDS: Final = ("window", "smooth")
LIMIT_POLICIES: Final = ("retry", "raise", "wait", "skip")
MISSED_POLICIES: Final = ("send", "skip")
Waiting = Literal["line", "poll"]
WAITING_KINDS: Final = ("line", "poll")

DEFAULTS: Final[dict[str, Any]] = {
    "LOCK_EXPIRE": 600,
    "CACHE": "default",
    "MEMCACHED_PROTOCOL": "auto",
    "ON_CONTENTION": "skip",
    "WAIT_TIMEOUT": 60,
    "WAITING": "line",
    "RETRY_COUNTDOWN": 5,
    "RENEW": False,
    "RESTART_GRACE": None,
    "QUEUE_EXPIRE": 3600,
    "LIVENESS": 10,
    "SOCKET_TIMEOUT": 2,
    "RATE_LIMITS": {},
    "RATE_KIND": "window",
    "ON_LIMIT": "retry",
    "METRICS": None,
    "BEAT_MISSED": "send",
    "ALLOW_PER_PROCESS": False,
}


_UNSET: Final = object()
_KNOWN_KEYS: Final = frozenset(DEFAULTS)
_LOCK_KEYS: Final = ("LOCK_EXPIRE", "CACHE", "MEMCACHED_PROTOCOL", "RENEW", "LIVENESS")
# Django's settings object keeps each setting it read in its own __dict__ and
# empties it whenever settings change (LazySettings.__setattr__, which
# override_settings goes through too); a hit there is the current value.
_django_settings_cache: dict[str, Any] = object.__getattribute__(
    django_settings, "__dict__"
)


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


def validate_seconds(value: object, *, name: str, allow_zero: bool = False) -> float:
    """Return ``value`` if it is a finite number of seconds (> 0, or >= 0)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = "0 or more" if allow_zero else "greater than 0"
        raise InvalidArgument(
            f"{name} must be a number of seconds {bound}, not {value!r}."
        )
    return value


def validate_choice(value: object, *, name: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(
            f"{name} must be one of {', '.join(choices)}, not {value!r}."
        )
    return value


_VALIDATORS: Final[dict[str, Callable[[object], object]]] = {
    "LOCK_EXPIRE": lambda v: validate_expire(v, name="TASKLOCK['LOCK_EXPIRE']"),
    "CACHE": lambda v: validate_alias(v, name="TASKLOCK['CACHE']"),
    "MEMCACHED_PROTOCOL": lambda v: validate_choice(
        v, name="TASKLOCK['MEMCACHED_PROTOCOL']", choices=PROTOCOLS
    ),
    "ON_CONTENTION": lambda v: validate_choice(
        v, name="TASKLOCK['ON_CONTENTION']", choices=CONTENTION_POLICIES
    ),
    "WAIT_TIMEOUT": lambda v: validate_seconds(v, name="TASKLOCK['WAIT_TIMEOUT']"),
    "WAITING": lambda v: validate_choice(
        v, name="TASKLOCK['WAITING']", choices=WAITING_KINDS
    ),
    "RETRY_COUNTDOWN": lambda v: validate_seconds(
        v, name="TASKLOCK['RETRY_COUNTDOWN']", allow_zero=True
    ),
    "RENEW": lambda v: validate_bool(v, name="TASKLOCK['RENEW']"),
    "RESTART_GRACE": lambda v: (
        v
        if v is None
        else validate_seconds(v, name="TASKLOCK['RESTART_GRACE']", allow_zero=True)
    ),
    "QUEUE_EXPIRE": lambda v: validate_expire(v, name="TASKLOCK['QUEUE_EXPIRE']"),
    "LIVENESS": lambda v: v if v is None else validate_liveness(v),
    "SOCKET_TIMEOUT": lambda v: validate_seconds(v, name="TASKLOCK['SOCKET_TIMEOUT']"),
    "RATE_LIMITS": lambda v: validate_rate_limits(v),
    "RATE_KIND": lambda v: validate_choice(
        v, name="TASKLOCK['RATE_KIND']", choices=RATE_KINDS
    ),
    "ON_LIMIT": lambda v: validate_choice(
        v, name="TASKLOCK['ON_LIMIT']", choices=LIMIT_POLICIES
    ),
    "METRICS": lambda v: validate_metrics(v),
    "BEAT_MISSED": lambda v: validate_beat_missed(v),
    "ALLOW_PER_PROCESS": lambda v: validate_bool(
        v, name="TASKLOCK['ALLOW_PER_PROCESS']"
    ),
}


def validate_rate_limits(value: object) -> dict[str, dict[str, Any]]:
    """``TASKLOCK['RATE_LIMITS']``: named limits, each a rate (``"100/m"``) or
    a dict of ``rate`` and optionally ``kind``, ``burst`` and ``cache``."""
    where = "TASKLOCK['RATE_LIMITS']"
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"{where} must be a dict of limit names to rates, such as "
            f'{{"partner-api": "100/m"}}, not {value!r}.'
        )
    limits: dict[str, dict[str, Any]] = {}
    for name, spec in value.items():
        entry = spec if isinstance(spec, dict) else {"rate": spec}
        unknown = set(entry) - {"rate", "kind", "burst", "cache"}
        if not isinstance(name, str) or not name or unknown or "rate" not in entry:
            raise InvalidArgument(
                f'{where}[{name!r}] must be a rate ("100/m") or a dict with '
                f'"rate" and optionally "kind", "burst" and "cache", not {spec!r}.'
            )
        parse_rate(entry["rate"], name=f"{where}[{name!r}]")
        if "kind" in entry:
            validate_choice(
                entry["kind"], name=f"{where}[{name!r}]['kind']", choices=RATE_KINDS
            )
        burst = entry.get("burst", 1)
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise InvalidArgument(
                f"{where}[{name!r}]['burst'] must be a whole number >= 1, not {burst!r}."
            )
        if "cache" in entry:
            validate_alias(entry["cache"], name=f"{where}[{name!r}]['cache']")
        limits[name] = dict(entry)
    return limits


def validate_beat_missed(value: object) -> str | dict[str, str]:
    """``TASKLOCK['BEAT_MISSED']``: what a leader beat does with a periodic run
    that fell due while no beat led, ``"send"`` (late, once) or ``"skip"``;
    for every entry, or a dict of entry names to either (others send)."""
    where = "TASKLOCK['BEAT_MISSED']"
    if isinstance(value, str):
        return validate_choice(value, name=where, choices=MISSED_POLICIES)
    if not isinstance(value, dict) or not all(
        isinstance(name, str) and choice in MISSED_POLICIES
        for name, choice in value.items()
    ):
        raise InvalidArgument(
            f'{where} must be "send" or "skip" (for every periodic entry), or a '
            'dict of entry names to either, such as {"nightly-report": "skip"} '
            f"(the others send), not {value!r}."
        )
    return value


def validate_metrics(value: object) -> str | None:
    """Return ``value`` if it is a valid ``TASKLOCK['METRICS']``: None, or
    ``"prometheus"`` with prometheus_client installed."""
    if value is None:
        return None
    if value != "prometheus":
        raise InvalidArgument(
            f"TASKLOCK['METRICS'] must be None or 'prometheus', not {value!r}."
        )
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise InvalidArgument(
            "TASKLOCK['METRICS'] is 'prometheus', but prometheus_client is not "
            "installed: pip install 'django-tasklock[prometheus]'."
        ) from None
    return "prometheus"


#: The shortest liveness bound: a holder must be able to renew its record at
#: least once before memcached's whole-second clock may drop it.
MIN_LIVENESS: Final = 3


def validate_liveness(value: object) -> float:
    """Return ``value`` if it is a valid ``TASKLOCK['LIVENESS']``: seconds, at
    least ``MIN_LIVENESS``, at most a day."""
    seconds = validate_seconds(value, name="TASKLOCK['LIVENESS']")
    if not MIN_LIVENESS <= seconds <= 86400:
        raise InvalidArgument(
            f"TASKLOCK['LIVENESS'] must be between {MIN_LIVENESS} and 86400 seconds "
            f"(how long a holder may show no sign of life before its locks are "
            f"free), not {value!r}; None turns liveness records off."
        )
    return seconds


def validate_bool(value: object, *, name: str) -> bool:
    """Return ``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, not {value!r}.")
    return value


def validate_alias(value: object, *, name: str) -> str:
    """Return ``value`` if it can name a CACHES entry."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(
            f"{name} must be the name of a CACHES entry, not {value!r}."
        )
    return value


def setting_problems(raw: object) -> list[tuple[str, str]]:
    """List ``(key, message)`` for every problem in a TASKLOCK value.

    ``key`` is ``""`` when TASKLOCK itself is not a dict.
    """
    if not isinstance(raw, dict):
        return [("", f"TASKLOCK must be a dict, not {type(raw).__name__}.")]
    problems: list[tuple[str, str]] = []
    for key, value in raw.items():
        validator = _VALIDATORS.get(key)
        if validator is None:
            problems.append((str(key), unknown_key_message(key)))
            continue
        try:
            validator(value)
        except ValueError as exc:
            problems.append((key, str(exc)))
    return problems


def suggested_key(key: object) -> str | None:
    """The known TASKLOCK key an unknown ``key`` most likely misspells."""
    meant = difflib.get_close_matches(str(key), list(DEFAULTS), n=1, cutoff=0.6)
    return meant[0] if meant else None


def unknown_key_message(key: object) -> str:
    """What to say of a TASKLOCK key this app does not know, with the known key
    it most likely meant."""
    known = ", ".join(sorted(DEFAULTS))
    meant = suggested_key(key)
    guess = f" Did you mean {meant!r}?" if meant else ""
    return (
        f"Unknown TASKLOCK key {key!r}: it is not read, so its value is not used."
        f"{guess} Known keys: {known}."
    )


def _check_known_keys(raw: dict[Any, Any]) -> None:
    """Raise LockConfigurationError for the first key of ``raw`` not known."""
    if not _KNOWN_KEYS.issuperset(raw):
        for key in raw:
            if key not in _KNOWN_KEYS:
                raise LockConfigurationError(unknown_key_message(key))


class Settings:
    """Typed view of ``settings.TASKLOCK``; every attribute is read anew."""

    def __init__(self) -> None:
        # The last value found valid per key: a value object seen before (the
        # very same object) is not validated again on this hot path.
        self._valid: dict[str, object] = {}
        # lock_defaults(): the TASKLOCK values it last read, and what they gave.
        self._lock_memo: (
            tuple[dict[str, object], dict[str, object], object, object, LockDefaults]
            | None
        ) = None

    def _get(self, key: str) -> Any:
        # As lock_defaults() reads it: from the cache Django's settings object
        # keeps (a getattr() on it costs more than the rest of this read, in
        # LazyObject.__getattribute__).
        raw = _django_settings_cache.get("TASKLOCK", _UNSET)
        if raw is _UNSET:
            raw = getattr(django_settings, "TASKLOCK", None)
        if raw is None:
            return DEFAULTS[key]
        if not isinstance(raw, dict):
            raise LockConfigurationError(setting_problems(raw)[0][1])
        _check_known_keys(raw)
        if key not in raw:
            return DEFAULTS[key]
        value = raw[key]
        if self._valid.get(key, _UNSET) is value:
            return value
        for problem_key, message in setting_problems({key: value}):
            if problem_key == key:
                raise LockConfigurationError(message)
        self._valid[key] = value
        return value

    def lock_defaults(self) -> LockDefaults:
        """``LOCK_EXPIRE``, ``CACHE``, ``MEMCACHED_PROTOCOL``, ``RENEW`` and
        ``LIVENESS`` in one read, the hot path of every acquire.

        The TASKLOCK dict is taken from the cache Django's settings object keeps
        of it (emptied by Django on every change: override_settings,
        assignment). What it gave last time is reused while it is the same dict
        with the same contents; a change in place, even to an equal value of
        another type such as 0 for False, is read and validated anew. The test
        is one C-level comparison of the dict with a copy, and an identity check
        of the two keys whose valid values equal invalid ones of another type
        (``RENEW``: False and 0; ``LOCK_EXPIRE``: 1 and True); the other keys'
        valid values equal no invalid one."""
        raw = _django_settings_cache.get("TASKLOCK", _UNSET)
        memo = self._lock_memo
        if (
            memo is not None
            and raw is memo[0]
            and raw == memo[1]
            and raw.get("RENEW", _UNSET) is memo[2]
            and raw.get("LOCK_EXPIRE", _UNSET) is memo[3]
        ):
            return memo[4]
        if raw is _UNSET:  # not read yet since it last changed, or not set
            raw = getattr(django_settings, "TASKLOCK", None)
        if not isinstance(raw, dict):
            self._lock_memo = None
            return (
                self.LOCK_EXPIRE,
                self.CACHE,
                self.MEMCACHED_PROTOCOL,
                self.RENEW,
                self.LIVENESS,
            )
        # A misspelt key must not leave its value silently unused.
        _check_known_keys(raw)
        valid = self._valid
        values = []
        for key in _LOCK_KEYS:
            value = raw.get(key, _UNSET)
            if value is _UNSET:
                value = DEFAULTS[key]
            elif valid.get(key, _UNSET) is not value:
                value = self._get(key)
            values.append(value)
        expire, cache, protocol, renew, liveness = values
        result = (expire, cache, protocol, renew, liveness)
        self._lock_memo = (
            raw,
            dict(raw),
            raw.get("RENEW", _UNSET),
            raw.get("LOCK_EXPIRE", _UNSET),
            result,
        )
        return result

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
    def ON_CONTENTION(self) -> Contention:
        """What ``@single_instance`` does when the lock is held."""
        value: Contention = self._get("ON_CONTENTION")
        return value

    @property
    def WAIT_TIMEOUT(self) -> float:
        """How long ``on_contention="wait"`` waits for the lock, in seconds."""
        value: float = self._get("WAIT_TIMEOUT")
        return value

    @property
    def WAITING(self) -> Waiting:
        """How a blocking acquire waits: ``"line"``, in the lock's waiting
        line where the store keeps one (Redis, memcached), woken by the
        release (across processes on Redis; on memcached within one, polled
        across them), first come first served; ``"poll"``, trying again after growing pauses
        (every store), in no order."""
        value: Waiting = self._get("WAITING")
        return value

    @property
    def RETRY_COUNTDOWN(self) -> float:
        """Seconds before ``on_contention="retry"`` runs the task again."""
        value: float = self._get("RETRY_COUNTDOWN")
        return value

    @property
    def ALLOW_PER_PROCESS(self) -> bool:
        """Whether a worker, beat or leadership may lock in a store each
        process has its own of (LocMemCache): for single-process tests."""
        value: bool = self._get("ALLOW_PER_PROCESS")
        return value

    @property
    def RENEW(self) -> bool:
        """Whether locks renew themselves while held, unless told otherwise."""
        value: bool = self._get("RENEW")
        return value

    @property
    def RESTART_GRACE(self) -> float:
        """Seconds after a memcached restart during which new locks on it are
        refused, unless set: ``LIVENESS`` while liveness records are on (a live
        holder's record thread puts its locks back within a beat or two; one
        that cannot show life for ``LIVENESS`` may lose its locks anyway, to a
        contender on another host), ``LOCK_EXPIRE`` without them."""
        value: float | None = self._get("RESTART_GRACE")
        if value is not None:
            return value
        return self.LOCK_EXPIRE if self.LIVENESS is None else self.LIVENESS

    @property
    def SOCKET_TIMEOUT(self) -> float:
        """Seconds any socket of this package's own may wait on a memcached
        server (to connect, or for a reply), whatever the alias's OPTIONS
        say (a shorter ``timeout`` there is kept): a stalled server then
        delays only what it holds, and a read of it that times out tells
        nothing, so new locks there are refused."""
        value: float = self._get("SOCKET_TIMEOUT")
        return value

    @property
    def FAILOVER_GRACE(self) -> float:
        """Seconds after a cluster primary was promoted (or restarted) during
        which new locks on it are refused: ``RESTART_GRACE``, and for the same
        reason (holders that keep liveness records put back within a beat
        what the promotion lost; without records, a lost lock's holder may
        run until its expiry)."""
        return self.RESTART_GRACE

    @property
    def QUEUE_EXPIRE(self) -> float:
        """Seconds a pending call's lock lasts beyond its countdown or ETA."""
        value: float = self._get("QUEUE_EXPIRE")
        return value

    @property
    def LIVENESS(self) -> float | None:
        """Seconds a holder may show no sign of life before contenders on other
        hosts take its locks; None: no liveness records (its locks then last
        until they expire)."""
        value: float | None = self._get("LIVENESS")
        return value

    @property
    def MEMCACHED_PROTOCOL(self) -> Protocol:
        """``auto`` (meta commands; gets/cas where missing), ``meta`` or ``classic``."""
        value: Protocol = self._get("MEMCACHED_PROTOCOL")
        return value

    @property
    def RATE_KIND(self) -> str:
        """The kind of a rate limit that names none: ``window`` or ``smooth``."""
        value: str = self._get("RATE_KIND")
        return value

    @property
    def ON_LIMIT(self) -> str:
        """What a task call over its rate limit does: ``retry`` (at the time the
        refusal names), ``raise``, ``wait`` or ``skip``."""
        value: str = self._get("ON_LIMIT")
        return value

    @property
    def METRICS(self) -> str | None:
        """``"prometheus"`` to export metrics from the lock signals (read when
        the app is ready), or None."""
        value: str | None = self._get("METRICS")
        return value

    def beat_missed(self, entry: str) -> str:
        """``"send"`` or ``"skip"``: what a leader beat does with a run of the
        periodic entry named ``entry`` that fell due while no beat led."""
        value: str | dict[str, str] = self._get("BEAT_MISSED")
        if isinstance(value, str):
            return value
        return value.get(entry, "send")

    def rate_limit_names(self) -> list[str]:
        """The names of ``TASKLOCK['RATE_LIMITS']``."""
        limits: dict[str, Any] = self._get("RATE_LIMITS")
        return list(limits)

    def named_rate(self, name: str) -> dict[str, Any]:
        """``TASKLOCK['RATE_LIMITS'][name]`` as a dict with ``rate`` (and maybe
        ``kind``, ``burst``, ``cache``); empty if there is no such limit."""
        limits: dict[str, Any] = self._get("RATE_LIMITS")
        spec = limits.get(name)
        if spec is None:
            return {}
        return dict(spec) if isinstance(spec, dict) else {"rate": spec}


settings = Settings()
