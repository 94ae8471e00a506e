"""System checks: a TASKLOCK or CACHES entry that cannot give a working lock.

Ids are stable, named in ``check_ids`` (what each reports beside it) and
documented in docs/reference/checks.rst.

Each of E003-E006, E012, E015, W001 and W002 is reported for TASKLOCK['CACHE']
and for every alias a ``@single_instance(cache=...)`` names: those of the task
modules loaded by then, and of each installed app's ``tasks`` module, which the
check imports as Celery's autodiscovery would.

E012, W002 and W008 come from asking each memcached server once (a
connection with a 0.5 s timeout).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from .backends import (
    IMPLICIT_CACHES,
    caches_implicit,
    unsupported_reason,
)
from .backends.supported import recommended_paths, supported_for
from .check_ids import (
    ALLOW_PER_PROCESS_INVALID,
    BEAT_MISSED_INVALID,
    CACHE_CANNOT_LOCK,
    CACHE_UNKNOWN,
    CACHES_UNSET,
    EXPIRE_INVALID,
    GRACE_SHORT,
    LIVENESS_INVALID,
    METRICS_INVALID,
    ON_CONTENTION_INVALID,
    ON_LIMIT_INVALID,
    PER_PROCESS_ALLOWED,
    PER_PROCESS_CACHE,
    PROTOCOL_INVALID,
    QUEUE_EXPIRE_INVALID,
    RATE_KIND_INVALID,
    RATE_LIMITS_INVALID,
    RENEW_INVALID,
    RESTART_GRACE_INVALID,
    RETRY_COUNTDOWN_INVALID,
    SETTING_MISSPELT,
    TASK_RATE_INVALID,
    TASKLOCK_INVALID,
    TASKS_UNIMPORTABLE,
    WAIT_TIMEOUT_INVALID,
    WAITING_INVALID,
)
from .conf import DEFAULTS, setting_problems, suggested_key
from .declared import import_task_modules, named_aliases

__all__ = ["check_settings"]


_SETTING_IDS = {
    "": TASKLOCK_INVALID,
    "LOCK_EXPIRE": EXPIRE_INVALID,
    "CACHE": CACHE_UNKNOWN,
    "MEMCACHED_PROTOCOL": PROTOCOL_INVALID,
    "ON_CONTENTION": ON_CONTENTION_INVALID,
    "WAIT_TIMEOUT": WAIT_TIMEOUT_INVALID,
    "WAITING": WAITING_INVALID,
    "RETRY_COUNTDOWN": RETRY_COUNTDOWN_INVALID,
    "RENEW": RENEW_INVALID,
    "RESTART_GRACE": RESTART_GRACE_INVALID,
    "QUEUE_EXPIRE": QUEUE_EXPIRE_INVALID,
    "LIVENESS": LIVENESS_INVALID,
    "RATE_LIMITS": RATE_LIMITS_INVALID,
    "RATE_KIND": RATE_KIND_INVALID,
    "ON_LIMIT": ON_LIMIT_INVALID,
    "METRICS": METRICS_INVALID,
    "BEAT_MISSED": BEAT_MISSED_INVALID,
    "ALLOW_PER_PROCESS": ALLOW_PER_PROCESS_INVALID,
}
_HINT_ALIAS = f"Point TASKLOCK['CACHE'] at a CACHES entry using {recommended_paths()}."


def _hint_for(named_by: str) -> str:
    """What to change, for an alias ``named_by`` names."""
    if named_by == "TASKLOCK['CACHE']":
        return _HINT_ALIAS
    return f"Make {named_by} name a CACHES entry using {recommended_paths()}."


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Report TASKLOCK and lock-cache problems before anything runs."""
    raw = getattr(django_settings, "TASKLOCK", {})
    messages: list[CheckMessage] = [
        _setting_error(key, message) for key, message in setting_problems(raw)
    ]
    # The servers are asked only when every setting is valid.
    protocol = (
        None
        if messages or not isinstance(raw, dict)
        else raw.get("MEMCACHED_PROTOCOL", DEFAULTS["MEMCACHED_PROTOCOL"])
    )
    if caches_implicit():
        messages.append(
            Error(
                IMPLICIT_CACHES.split(": ", 1)[0] + ": no lock is shared between "
                "worker processes.",
                hint=IMPLICIT_CACHES,
                id=CACHES_UNSET,
            )
        )
    messages.extend(_check_misspelt())
    alias = raw.get("CACHE", DEFAULTS["CACHE"]) if isinstance(raw, dict) else "default"
    checked = set()
    if isinstance(alias, str) and alias:
        checked.add(alias)
        messages.extend(_check_cache(alias, protocol, "TASKLOCK['CACHE']"))
    settings_ok = not messages
    if settings_ok:
        messages.extend(_check_grace(raw))
        messages.extend(_check_per_process(raw))
    messages.extend(_import_task_modules())
    if settings_ok:  # (a limit is made from the settings: they must be sound)
        messages.extend(_check_declared_limits())
    for named, users in sorted(named_aliases().items()):
        if named in checked:
            continue
        checked.add(named)
        by = f"@single_instance(cache={named!r}) of {', '.join(sorted(users))}"
        messages.extend(_check_cache(named, protocol, by))
    return messages


def _check_misspelt() -> list[CheckMessage]:
    """W007: a setting whose name is TASKLOCK misspelt (TASK_LOCK,
    TASKLOCKS, tasklock...), which nothing reads."""
    found = [
        name
        for name in dir(django_settings)
        if name != "TASKLOCK"
        and name.replace("_", "").upper() in ("TASKLOCK", "TASKLOCKS")
    ]
    return [
        Warning(
            f"settings.{name} is set, but django_tasklock reads only TASKLOCK: "
            "its entries are not used.",
            hint=f"Rename {name} to TASKLOCK.",
            id=SETTING_MISSPELT,
        )
        for name in found
    ]


def _check_per_process(raw: Any) -> list[CheckMessage]:
    """W006: ALLOW_PER_PROCESS set (for test settings only)."""
    if not isinstance(raw, dict) or raw.get("ALLOW_PER_PROCESS") is not True:
        return []
    return [
        Warning(
            "TASKLOCK['ALLOW_PER_PROCESS'] is True: Celery workers, LeaderScheduler "
            "and Leadership start on a lock store each process has its own of "
            "(LocMemCache), where their locks hold nothing between processes.",
            hint="Set it in the settings of single-process tests only; the "
            "tasklock fixture and TaskLockTestMixin need no setting.",
            id=PER_PROCESS_ALLOWED,
        )
    ]


def _check_grace(raw: Any) -> list[CheckMessage]:
    """W005: a restart grace shorter than the liveness bound."""
    if not isinstance(raw, dict) or raw.get("RESTART_GRACE") is None:
        return []
    grace = float(raw["RESTART_GRACE"])
    liveness = raw.get("LIVENESS", DEFAULTS["LIVENESS"])
    if liveness is None or grace >= liveness:
        return []
    return [
        Warning(
            f"TASKLOCK['RESTART_GRACE'] ({grace:g}s) is shorter than "
            f"TASKLOCK['LIVENESS'] ({liveness:g}s): after a memcached restart or "
            "a cluster failover, a new lock may be granted while a live holder, "
            "slowed for less than LIVENESS, has not yet put its lock back; both "
            "then run.",
            hint="Leave RESTART_GRACE out (it is LIVENESS then), or set it to at "
            f"least {liveness:g}.",
            id=GRACE_SHORT,
        )
    ]


def _setting_error(key: str, message: str) -> Error:
    known = key in _SETTING_IDS
    hint = None
    if not known:
        meant = suggested_key(key)
        hint = (
            f"Rename {key!r} to {meant!r}."
            if meant
            else f"Remove {key!r}; known keys: {', '.join(sorted(DEFAULTS))}."
        )
    return Error(
        message, hint=hint, id=_SETTING_IDS[key] if known else TASKLOCK_INVALID
    )


def _check_declared_limits() -> list[CheckMessage]:
    """E021: each ``@rate_limited`` of an installed app's ``tasks`` module,
    made as its first call would make it."""
    from django.apps import apps

    from .limits.decorator import DECLARED

    modules = {f"{config.name}.tasks" for config in apps.get_app_configs()}
    messages: list[CheckMessage] = []
    for name, limits in sorted(DECLARED.items()):
        if limits.module not in modules:
            continue
        try:
            limits._make(name)
        except (TypeError, ValueError) as exc:
            messages.append(
                Error(
                    f"@rate_limited {name!r}: {exc}",
                    hint="Fix its rate, kind or burst (or its TASKLOCK['RATE_LIMITS'] "
                    "entry); every call of it would fail.",
                    id=TASK_RATE_INVALID,
                )
            )
    return messages


def _import_task_modules() -> list[CheckMessage]:
    """W003 for each installed app's ``tasks`` module that would not import
    (``registry.import_task_modules``)."""
    return [
        Warning(
            f"Could not import {name} ({type(exc).__name__}: {exc}), so the "
            "cache= aliases of its @single_instance tasks were not checked.",
            hint=f"Make {name} importable; run the check again.",
            id=TASKS_UNIMPORTABLE,
        )
        for name, exc in import_task_modules()
    ]


def _check_cache(alias: str, protocol: object, named_by: str) -> list[CheckMessage]:
    """The alias's backend and options; with ``protocol`` (None: skip, another
    setting is already wrong), how its memcached servers meet meta commands.
    ``named_by`` says where the alias comes from, for the messages."""
    caches_setting: dict[str, Any] = django_settings.CACHES
    config = caches_setting.get(alias)
    if config is None:
        return [
            Error(
                f"{named_by} names {alias!r}, which is not in CACHES.",
                hint=(
                    f"Add CACHES[{alias!r}], or make {named_by} name an existing alias."
                ),
                id=CACHE_UNKNOWN,
            )
        ]
    try:
        backend_class = import_string(config.get("BACKEND", ""))
    except ImportError:
        return []  # Django's own caches check reports a backend that cannot import.
    reason = unsupported_reason(backend_class, config.get("OPTIONS") or {})
    if reason is not None:
        return [
            Error(
                f"CACHES[{alias!r}] cannot hold task locks: {reason}",
                hint=_HINT_ALIAS,
                id=CACHE_CANNOT_LOCK,
            )
        ]
    entry = supported_for(backend_class)
    assert entry is not None  # (else unsupported_reason said why)
    messages = entry.backend.alias_checks(alias, config, protocol, _HINT_ALIAS)
    if not entry.shared and not caches_implicit():
        messages.append(
            Warning(
                f"CACHES[{alias!r}] ({named_by}) is {backend_class.__name__}: "
                "each process has "
                "its own, so a lock taken in one worker process is invisible to "
                "the others.",
                hint="Use it for single-process tests only (workers, beats and "
                "leaderships refuse it unless TASKLOCK['ALLOW_PER_PROCESS']). "
                + _hint_for(named_by),
                id=PER_PROCESS_CACHE,
            )
        )
    return messages
