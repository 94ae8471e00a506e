"""System checks: a TASKLOCK or CACHES entry that cannot give a working lock.

Ids are stable and documented in docs/reference/checks.rst:

- E001 TASKLOCK is not a dict, or has an unknown key.
- E002 TASKLOCK['LOCK_EXPIRE'] is not a valid expiry.
- E003 TASKLOCK['CACHE'] is not a str, or names no CACHES entry.
- E004 the lock cache's backend cannot lock atomically (Dummy, FileBased,
  Database, other memcached clients, unknown backends).
- E005 memcached OPTIONS['default_noreply'] is true.
- E006 memcached OPTIONS['ignore_exc'] is true.
- E007 TASKLOCK['MEMCACHED_PROTOCOL'] is not auto, meta or classic.
- E008 TASKLOCK['ON_CONTENTION'] is not skip, raise, retry or wait.
- E009 TASKLOCK['WAIT_TIMEOUT'] is not a number of seconds > 0.
- E010 TASKLOCK['RETRY_COUNTDOWN'] is not a number of seconds >= 0.
- E011 TASKLOCK['RENEW'] is not True or False.
- E013 TASKLOCK['RESTART_GRACE'] is not None or a number of seconds >= 0.
- E014 TASKLOCK['QUEUE_EXPIRE'] is not a number of seconds in (0, 30 days].
- E016 TASKLOCK['LIVENESS'] is not None or a number of seconds in [3, 86400].
- E017 TASKLOCK['RATE_LIMITS'] is not a dict of names to rates ("100/m", or a
  dict of rate, kind, burst and cache), or one of its rates is not a rate.
- E018 TASKLOCK['RATE_KIND'] is not window or smooth.
- E019 TASKLOCK['ON_LIMIT'] is not retry, raise, wait or skip.
- E020 TASKLOCK['METRICS'] is not None or 'prometheus', or prometheus_client
  is not installed.
- E021 a @rate_limited of an installed app's tasks has a rate, kind or burst
  it cannot keep, or names a limit TASKLOCK['RATE_LIMITS'] does not define.
- E015 CACHES is not set: Django's implicit default is a LocMemCache per
  process, so no lock is shared between worker processes.
- E012 TASKLOCK['MEMCACHED_PROTOCOL'] is 'meta', but a server of the lock cache
  refuses meta commands (memcached < 1.6, or a proxy such as twemproxy).
- W001 the lock cache is LocMemCache: locks hold within one process only.
- W002 a server of the lock cache refuses meta commands and MEMCACHED_PROTOCOL is
  'auto': locks use the classic commands; set it to 'classic' to say so.
- W003 an installed app's ``tasks`` module could not be imported, so the
  ``cache=`` aliases of its ``@single_instance`` tasks were not checked.
- E022 a cluster lock cache's keys (KEY_PREFIX, KEY_FUNCTION) have braces that
  are no hash tag, so no key can share a lock's hash slot.
- W004 a cluster lock cache's keys carry a hash tag of their own: every lock in
  one hash slot, on one primary.
- W005 TASKLOCK['RESTART_GRACE'] is shorter than TASKLOCK['LIVENESS']: after a
  restart or failover a new lock may be granted while a holder slowed for less
  than LIVENESS has not yet put its lock back.
- E024 TASKLOCK['ALLOW_PER_PROCESS'] is not True or False.
- W006 TASKLOCK['ALLOW_PER_PROCESS'] is True (for test settings only).
- W007 a setting named as TASKLOCK misspelt (TASK_LOCK, TASKLOCKS), not read.
- W008 a memcached server of the lock cache did not answer the check's probe.

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
from .backends.cluster import KEY_TAG_ADVICE, ValkeyClusterBackend, key_tag_problem
from .backends.memcached import meta_support
from .backends.supported import recommended_paths, supported_for
from .conf import DEFAULTS, setting_problems, suggested_key
from .declared import import_task_modules, named_aliases

__all__ = ["check_settings"]

_SETTING_IDS = {
    "": "django_tasklock.E001",
    "LOCK_EXPIRE": "django_tasklock.E002",
    "CACHE": "django_tasklock.E003",
    "MEMCACHED_PROTOCOL": "django_tasklock.E007",
    "ON_CONTENTION": "django_tasklock.E008",
    "WAIT_TIMEOUT": "django_tasklock.E009",
    "RETRY_COUNTDOWN": "django_tasklock.E010",
    "RENEW": "django_tasklock.E011",
    "RESTART_GRACE": "django_tasklock.E013",
    "QUEUE_EXPIRE": "django_tasklock.E014",
    "LIVENESS": "django_tasklock.E016",
    "RATE_LIMITS": "django_tasklock.E017",
    "RATE_KIND": "django_tasklock.E018",
    "ON_LIMIT": "django_tasklock.E019",
    "METRICS": "django_tasklock.E020",
    "BEAT_MISSED": "django_tasklock.E023",
    "ALLOW_PER_PROCESS": "django_tasklock.E024",
}
_OPTION_IDS = {
    "default_noreply": "django_tasklock.E005",
    "ignore_exc": "django_tasklock.E006",
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
                id="django_tasklock.E015",
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
            id="django_tasklock.W007",
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
            id="django_tasklock.W006",
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
            id="django_tasklock.W005",
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
        message, hint=hint, id=_SETTING_IDS[key] if known else "django_tasklock.E001"
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
                    id="django_tasklock.E021",
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
            id="django_tasklock.W003",
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
                    id="django_tasklock.E012",
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
                    id="django_tasklock.W002",
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
        id="django_tasklock.W008",
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
        return [Error(message, hint=hint, id="django_tasklock.E022")]
    return [Warning(message, hint=hint, id="django_tasklock.W004")]


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
                id="django_tasklock.E003",
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
                id="django_tasklock.E004",
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
                id="django_tasklock.W001",
            )
        )
    if (
        not messages
        and protocol not in (None, "classic")
        and issubclass(backend_class, PyMemcacheCache)
    ):
        messages.extend(_check_protocol(alias, config, protocol))
    return messages
