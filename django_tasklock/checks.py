"""System checks: a TASKLOCK or CACHES entry that cannot give a working lock.

Ids are stable, named below (what each reports beside it) and documented in
docs/reference/checks.rst.

Each of E003-E006, E012, E015, W001 and W002 is reported for TASKLOCK['CACHE']
and for every alias a ``@single_instance(cache=...)`` names: those of the task
modules loaded by then, and of each installed app's ``tasks`` module, which the
check imports as Celery's autodiscovery would.

E012, W002 and W008 come from asking each memcached server once (a
connection with a 0.5 s timeout).
"""

from __future__ import annotations

from typing import Any, Final

from django.conf import settings as django_settings
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.cache.backends.memcached import PyMemcacheCache
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from .backends import (
    IMPLICIT_CACHES,
    caches_implicit,
    unsafe_options,
    unsupported_reason,
)
from .backends.memcached import meta_support
from .backends.redis.cluster import (
    KEY_TAG_ADVICE,
    ValkeyClusterBackend,
    key_tag_problem,
)
from .backends.supported import recommended_paths, supported_for
from .conf import DEFAULTS, setting_problems, suggested_key
from .declared import import_task_modules, named_aliases

__all__ = [
    "ALLOW_PER_PROCESS_INVALID",
    "BEAT_MISSED_INVALID",
    "CACHES_UNSET",
    "CACHE_CANNOT_LOCK",
    "CACHE_UNKNOWN",
    "CLASSIC_FALLBACK",
    "EXPIRE_INVALID",
    "GRACE_SHORT",
    "IGNORE_EXC_SET",
    "KEY_BRACES",
    "LIVENESS_INVALID",
    "META_REFUSED",
    "METRICS_INVALID",
    "NOREPLY_SET",
    "ONE_SLOT",
    "ON_CONTENTION_INVALID",
    "ON_LIMIT_INVALID",
    "PER_PROCESS_ALLOWED",
    "PER_PROCESS_CACHE",
    "PROTOCOL_INVALID",
    "QUEUE_EXPIRE_INVALID",
    "RATE_KIND_INVALID",
    "RATE_LIMITS_INVALID",
    "RENEW_INVALID",
    "RESTART_GRACE_INVALID",
    "RETRY_COUNTDOWN_INVALID",
    "SERVER_SILENT",
    "SETTING_MISSPELT",
    "TASKLOCK_INVALID",
    "TASKS_UNIMPORTABLE",
    "TASK_RATE_INVALID",
    "WAIT_TIMEOUT_INVALID",
    "check_settings",
]

#: TASKLOCK is not a dict, or has an unknown key.
TASKLOCK_INVALID: Final = "django_tasklock.E001"
#: TASKLOCK['LOCK_EXPIRE'] is not a valid expiry.
EXPIRE_INVALID: Final = "django_tasklock.E002"
#: TASKLOCK['CACHE'] is not a str, or names no CACHES entry.
CACHE_UNKNOWN: Final = "django_tasklock.E003"
#: the lock cache's backend cannot lock atomically (Dummy, FileBased,
#: Database, other memcached clients, unknown backends).
CACHE_CANNOT_LOCK: Final = "django_tasklock.E004"
#: memcached OPTIONS['default_noreply'] is true.
NOREPLY_SET: Final = "django_tasklock.E005"
#: memcached OPTIONS['ignore_exc'] is true.
IGNORE_EXC_SET: Final = "django_tasklock.E006"
#: TASKLOCK['MEMCACHED_PROTOCOL'] is not auto, meta or classic.
PROTOCOL_INVALID: Final = "django_tasklock.E007"
#: TASKLOCK['ON_CONTENTION'] is not skip, raise, retry or wait.
ON_CONTENTION_INVALID: Final = "django_tasklock.E008"
#: TASKLOCK['WAIT_TIMEOUT'] is not a number of seconds > 0.
WAIT_TIMEOUT_INVALID: Final = "django_tasklock.E009"
#: TASKLOCK['RETRY_COUNTDOWN'] is not a number of seconds >= 0.
RETRY_COUNTDOWN_INVALID: Final = "django_tasklock.E010"
#: TASKLOCK['RENEW'] is not True or False.
RENEW_INVALID: Final = "django_tasklock.E011"
#: TASKLOCK['MEMCACHED_PROTOCOL'] is 'meta', but a server of the lock cache
#: refuses meta commands (memcached < 1.6, or a proxy such as twemproxy).
META_REFUSED: Final = "django_tasklock.E012"
#: TASKLOCK['RESTART_GRACE'] is not None or a number of seconds >= 0.
RESTART_GRACE_INVALID: Final = "django_tasklock.E013"
#: TASKLOCK['QUEUE_EXPIRE'] is not a number of seconds in (0, 30 days].
QUEUE_EXPIRE_INVALID: Final = "django_tasklock.E014"
#: CACHES is not set: Django's implicit default is a LocMemCache per process,
#: so no lock is shared between worker processes.
CACHES_UNSET: Final = "django_tasklock.E015"
#: TASKLOCK['LIVENESS'] is not None or a number of seconds in [3, 86400].
LIVENESS_INVALID: Final = "django_tasklock.E016"
#: TASKLOCK['RATE_LIMITS'] is not a dict of names to rates ("100/m", or a
#: dict of rate, kind, burst and cache), or one of its rates is not a rate.
RATE_LIMITS_INVALID: Final = "django_tasklock.E017"
#: TASKLOCK['RATE_KIND'] is not window or smooth.
RATE_KIND_INVALID: Final = "django_tasklock.E018"
#: TASKLOCK['ON_LIMIT'] is not retry, raise, wait or skip.
ON_LIMIT_INVALID: Final = "django_tasklock.E019"
#: TASKLOCK['METRICS'] is not None or 'prometheus', or prometheus_client is
#: not installed.
METRICS_INVALID: Final = "django_tasklock.E020"
#: a @rate_limited of an installed app's tasks has a rate, kind or burst it
#: cannot keep, or names a limit TASKLOCK['RATE_LIMITS'] does not define.
TASK_RATE_INVALID: Final = "django_tasklock.E021"
#: a cluster lock cache's keys (KEY_PREFIX, KEY_FUNCTION) have braces that
#: are no hash tag, so no key can share a lock's hash slot.
KEY_BRACES: Final = "django_tasklock.E022"
#: TASKLOCK['BEAT_MISSED'] is not "send" or "skip", nor a dict of periodic
#: entry names to either.
BEAT_MISSED_INVALID: Final = "django_tasklock.E023"
#: TASKLOCK['ALLOW_PER_PROCESS'] is not True or False.
ALLOW_PER_PROCESS_INVALID: Final = "django_tasklock.E024"
#: the lock cache is LocMemCache: locks hold within one process only.
PER_PROCESS_CACHE: Final = "django_tasklock.W001"
#: a server of the lock cache refuses meta commands and MEMCACHED_PROTOCOL is
#: 'auto': locks use the classic commands; set it to 'classic' to say so.
CLASSIC_FALLBACK: Final = "django_tasklock.W002"
#: an installed app's ``tasks`` module could not be imported, so the
#: ``cache=`` aliases of its ``@single_instance`` tasks were not checked.
TASKS_UNIMPORTABLE: Final = "django_tasklock.W003"
#: a cluster lock cache's keys carry a hash tag of their own: every lock in
#: one hash slot, on one primary.
ONE_SLOT: Final = "django_tasklock.W004"
#: TASKLOCK['RESTART_GRACE'] is shorter than TASKLOCK['LIVENESS']: after a
#: restart or failover a new lock may be granted while a holder slowed for
#: less than LIVENESS has not yet put its lock back.
GRACE_SHORT: Final = "django_tasklock.W005"
#: TASKLOCK['ALLOW_PER_PROCESS'] is True (for test settings only).
PER_PROCESS_ALLOWED: Final = "django_tasklock.W006"
#: a setting named as TASKLOCK misspelt (TASK_LOCK, TASKLOCKS), not read.
SETTING_MISSPELT: Final = "django_tasklock.W007"
#: a memcached server of the lock cache did not answer the check's probe.
SERVER_SILENT: Final = "django_tasklock.W008"


_SETTING_IDS = {
    "": TASKLOCK_INVALID,
    "LOCK_EXPIRE": EXPIRE_INVALID,
    "CACHE": CACHE_UNKNOWN,
    "MEMCACHED_PROTOCOL": PROTOCOL_INVALID,
    "ON_CONTENTION": ON_CONTENTION_INVALID,
    "WAIT_TIMEOUT": WAIT_TIMEOUT_INVALID,
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
_OPTION_IDS = {
    "default_noreply": NOREPLY_SET,
    "ignore_exc": IGNORE_EXC_SET,
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


def _servers(config: dict[str, Any]) -> list[tuple[str, int]]:
    location = config.get("LOCATION") or []
    if isinstance(location, str):
        location = location.replace(",", ";").split(";")
    servers = []
    for entry in location:
        host, _, port = str(entry).strip().rpartition(":")
        if host and port.isdigit() and not host.startswith("unix"):
            servers.append((host.strip("[]"), int(port)))
    return servers


def _check_protocol(
    alias: str, config: dict[str, Any], protocol: object
) -> list[CheckMessage]:
    """E012/W002: ask each memcached server of the alias how it meets ``mn``."""
    messages: list[CheckMessage] = []
    for server in _servers(config):
        name = "{}:{}".format(*server)
        try:
            how = meta_support(server, timeout=0.5)
        except OSError as exc:
            messages.append(_unanswered(alias, name, exc))
            continue
        if how == "meta":
            continue
        what = (
            "closes the connection on memcached's meta commands but answers "
            "classic ones: a proxy such as twemproxy (nutcracker)"
            if how == "closed"
            else "answers ERROR to memcached's meta commands (memcached < 1.6)"
        )
        if protocol == "meta":
            messages.append(
                Error(
                    f"CACHES[{alias!r}] server {name} {what}, and "
                    "TASKLOCK['MEMCACHED_PROTOCOL'] is 'meta': every lock fails.",
                    hint="Set TASKLOCK['MEMCACHED_PROTOCOL'] to 'classic'.",
                    id=META_REFUSED,
                )
            )
        else:
            messages.append(
                Warning(
                    f"CACHES[{alias!r}] server {name} {what}. Locks on it use the "
                    "classic commands (add, gets, cas): owner-checked, with one "
                    "more round trip per release.",
                    hint=(
                        "Set TASKLOCK['MEMCACHED_PROTOCOL'] to 'classic' to say so "
                        "(and skip this probe)."
                    ),
                    id=CLASSIC_FALLBACK,
                )
            )
    return messages


def _unanswered(alias: str, name: str, exc: OSError) -> CheckMessage:
    """W008: a server of the alias that did not answer the probe."""
    return Warning(
        f"CACHES[{alias!r}] server {name} did not answer in 0.5s "
        f"({type(exc).__name__}: {exc}): every lock on it fails "
        "(LockBackendError) until it does.",
        hint="Start it, or correct its LOCATION. (A server that is only "
        "starting up answers in a moment: check again.)",
        id=SERVER_SILENT,
    )


def _unsafe_options(
    alias: str, backend_class: type[Any], options: dict[str, Any]
) -> list[CheckMessage]:
    """An error for each OPTIONS entry of ``alias`` that would let a lock
    fail silently."""
    return [
        Error(
            f"CACHES[{alias!r}] has OPTIONS[{option!r}] set: {why}.",
            hint=(
                f"Remove {option} from this alias, or give locks an alias of their "
                "own without it and set TASKLOCK['CACHE'] to it."
            ),
            id=_OPTION_IDS[option],
        )
        for option, why in unsafe_options(backend_class, options).items()
    ]


def _check_key_tags(alias: str, backend_class: type[Any]) -> list[CheckMessage]:
    """E022/W004: the hash tags in a cluster alias's keys."""
    entry = supported_for(backend_class)
    if entry is None or entry.backend is not ValkeyClusterBackend:
        return []
    problem = key_tag_problem(caches[alias])
    if problem is None:
        return []
    what, fatal = problem
    hint = f"{KEY_TAG_ADVICE}. {_HINT_ALIAS}"
    message = f"CACHES[{alias!r}] is a cluster, and {what}."
    if fatal:
        return [Error(message, hint=hint, id=KEY_BRACES)]
    return [Warning(message, hint=hint, id=ONE_SLOT)]


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
    messages = _unsafe_options(alias, backend_class, config.get("OPTIONS") or {})
    messages += _check_key_tags(alias, backend_class)
    if issubclass(backend_class, LocMemCache) and not caches_implicit():
        messages.append(
            Warning(
                f"CACHES[{alias!r}] ({named_by}) is LocMemCache: each process has "
                "its own, so a lock taken in one worker process is invisible to "
                "the others.",
                hint="Use it for single-process tests only (workers, beats and "
                "leaderships refuse it unless TASKLOCK['ALLOW_PER_PROCESS']). "
                + _hint_for(named_by),
                id=PER_PROCESS_CACHE,
            )
        )
    if (
        not messages
        and protocol not in (None, "classic")
        and issubclass(backend_class, PyMemcacheCache)
    ):
        messages.extend(_check_protocol(alias, config, protocol))
    return messages
