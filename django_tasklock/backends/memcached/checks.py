"""The system checks of memcached aliases (``MemcachedBackend.alias_checks``):
OPTIONS that let a lock fail silently (E005, E006), and how each server meets
meta commands, asked once with a 0.5 s timeout (E012, W002, W008)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from ...check_ids import (
    CLASSIC_FALLBACK,
    IGNORE_EXC_SET,
    META_REFUSED,
    NOREPLY_SET,
    SERVER_SILENT,
)
from .wire import meta_support

__all__ = ["alias_checks", "unsafe_options"]

#: OPTIONS of a memcached alias that break ``cache.add()`` locking: why, and
#: the check that reports it.
_UNSAFE = {
    "default_noreply": (
        "memcached sends no reply, so cache.add() cannot report that a lock is "
        "already held",
        NOREPLY_SET,
    ),
    "ignore_exc": (
        "cache.add() returns False when memcached is down, so every task looks "
        "locked and is silently skipped",
        IGNORE_EXC_SET,
    ),
}


def unsafe_options(options: dict[str, Any]) -> dict[str, str]:
    """The OPTIONS entries that break ``cache.add()`` locking, with why."""
    return {name: why for name, (why, _) in _UNSAFE.items() if options.get(name)}


def alias_checks(
    alias: str, config: dict[str, Any], protocol: object, hint: str
) -> list[CheckMessage]:
    """Errors for unsafe OPTIONS; then, with none and a ``protocol`` that may
    use meta commands, what each server answers to them (``hint``: another
    alias's, unused: each message says what to change here)."""
    messages: list[CheckMessage] = [
        Error(
            f"CACHES[{alias!r}] has OPTIONS[{option!r}] set: {why}.",
            hint=(
                f"Remove {option} from this alias, or give locks an alias of their "
                "own without it and set TASKLOCK['CACHE'] to it."
            ),
            id=_UNSAFE[option][1],
        )
        for option, why in unsafe_options(config.get("OPTIONS") or {}).items()
    ]
    if not messages and protocol not in (None, "classic"):
        messages = _check_protocol(alias, config, protocol)
    return messages


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
