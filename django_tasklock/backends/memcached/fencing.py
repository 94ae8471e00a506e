"""Fencing tokens on memcached: drawn from the lock id's counter, counting
only while the lock still holds this holder's token under its CAS id."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pymemcache.exceptions import MemcacheClientError, MemcacheError

from ...values import unique_value
from . import meta
from .wire import _wire_key

if TYPE_CHECKING:
    from ..base import FenceCounter
    from .wire import MemcachedHold, Wire

__all__ = ["draw"]


def _bad_counter(fence: FenceCounter, reply: bytes) -> MemcacheError:
    return MemcacheError(
        f"the fencing counter {fence.key!r} holds something that is not a number "
        f"({reply.decode(errors='replace')}); some other code wrote to that key. "
        "Delete it (it restarts from the clock) and stop writing to it; no fence "
        "was drawn, and the lock is still held"
    )


def draw(
    wire: Wire,
    client: Any,
    key: str,
    hold: MemcachedHold,
    token: str,
    fence: FenceCounter,
) -> int | None:
    if wire.meta(client):
        # Draw from the counter (made at the floor if missing), then read the
        # lock back: if it still holds our token under our CAS id, the lock
        # was ours when the token was drawn, so any later holder draws after
        # us and gets a larger one.
        commands = meta.count_and_read(
            _wire_key(client, fence.key), fence.ttl, fence.floor, _wire_key(client, key)
        )
        replies = wire.exchange(client, commands, 2)
        if replies is not None:
            try:
                found = meta.drawn(replies)
            except ValueError:
                raise _bad_counter(fence, replies[0].strip()) from None
            if found is None or found[1] != token.encode():
                return None
            number, _, cas = found
            return number if _same_item(hold, cas, token) else None
    try:
        number = client.incr(fence.key, 1, noreply=False)
        if number is None:
            if client.add(fence.key, str(fence.floor), expire=fence.ttl, noreply=False):
                number = fence.floor
            else:  # made by another holder in between
                number = client.incr(fence.key, 1, noreply=False)
    except MemcacheClientError as exc:
        raise _bad_counter(fence, str(exc).encode()) from exc
    value, cas = client.gets(key)
    if value != token or cas is None or number is None:
        return None
    if not _same_item(hold, int(cas), token):
        return None
    return int(number)


def _same_item(hold: MemcachedHold, cas: int | None, token: str) -> bool:
    """Whether the item read back (holding ``token``, under CAS id ``cas``) is
    the one ``hold`` took: the same CAS id, or a unique token of ours whose item
    memcached's slab rebalancer moved (a new CAS id, learnt here)."""
    if cas == hold.cas:
        return True
    if cas is None or not unique_value(token):
        return False
    hold.cas = cas
    return True
