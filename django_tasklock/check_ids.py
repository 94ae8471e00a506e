"""The ids of the system checks (``checks``, and the store packages' own),
named for what each reports: stable, and documented in
docs/reference/checks.rst."""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALLOW_PER_PROCESS_INVALID",
    "BEAT_MISSED_INVALID",
    "CACHES_UNSET",
    "CACHE_CANNOT_LOCK",
    "CACHE_UNKNOWN",
    "CLASSIC_FALLBACK",
    "EXPIRE_INVALID",
    "FENCE_FIELDS_AMBIGUOUS",
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
    "POSTGRES_DATABASE_INVALID",
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
    "WAITING_INVALID",
    "WAIT_TIMEOUT_INVALID",
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
#: a PostgresCache's LOCATION names no DATABASES entry, or one not on PostgreSQL,
#: or its OPTIONS["FAILOVER"] is neither "synchronous" nor "asynchronous".
POSTGRES_DATABASE_INVALID: Final = "django_tasklock.E025"
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
#: a model has more than one FenceField without lock=, so a fenced write could
#: not tell which holder's fence goes in which.
FENCE_FIELDS_AMBIGUOUS: Final = "django_tasklock.E026"
#: TASKLOCK['WAITING'] is not "line" or "poll".
WAITING_INVALID: Final = "django_tasklock.E027"
