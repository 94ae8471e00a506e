"""What the values django_tasklock stores look like: read by the stores'
backends (below everything else) and made by ``tokens`` and ``calls``."""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = ["QUEUED", "STARTED", "FenceCounter", "token_process", "unique_value"]

#: The marks a call leaves: published and not started; started (until_started).
QUEUED: Final = "queued:"
STARTED: Final = "started:"


def token_process(value: object) -> tuple[str, str] | None:
    """The owner (``oid@host`` or ``host``) and the process identity
    (``pid-start-space``, or a bare pid) in a token ``tokens.new_token`` made;
    None for any other value (other code's, such as the recipe's oid, or a
    call's mark)."""
    if not isinstance(value, str):
        return None
    parts = value.rsplit(":", 4)
    if len(parts) != 5 or not parts[1].partition("-")[0].isdigit():
        return None
    return parts[0], parts[1]


def unique_value(value: object) -> bool:
    """True for a value only one holder ever stores: a django_tasklock token
    (random per acquisition) or a call's mark (named after its task id).

    For such a value, the value alone proves ownership when the item's CAS id
    changed under its holder: memcached's slab rebalancer (``slab_automove``,
    on by default) gives an item it moves to another page a new CAS id, value
    unchanged. Other values (a recipe's oid, other code's ``"1"``) are stored
    by many owners alike: only the CAS id tells their items apart.
    """
    if isinstance(value, str) and value.startswith((QUEUED, STARTED)):
        return True
    return token_process(value) is not None


class FenceCounter(NamedTuple):
    """Where an acquisition draws its fencing token from.

    ``key`` is the counter's store key; ``floor`` the value a missing counter
    (never made, evicted, flushed, lost in a restart) starts again from, the
    current time in microseconds, above anything it can have given out; ``ttl``
    its lifetime in whole seconds, renewed on every draw.
    """

    key: str
    floor: int
    ttl: int
