"""A compare-and-swap rewrite of a held item on memcached: how a lock is
extended, replaced by a new value, or handed over, only while it is still the
holder's (the backend's ``replace``)."""

from __future__ import annotations

from typing import Any

from . import meta
from .wire import _PAST, MemcachedHold, Wire, _wire_key

__all__ = ["delete_if", "rewrite"]


def rewrite(
    wire: Wire,
    client: Any,
    key: str,
    hold: MemcachedHold,
    old: object,
    new: str,
    ttl: int,
) -> MemcachedHold | None:
    """Store ``new`` for ``ttl`` in place of the item ``hold`` holds (whose
    value is ``old``), only while the store still has that very item: its
    CAS id, or (after a connection change or a slab move) its value; the
    hold on the new item, or None."""
    return wire.while_ours(
        client,
        key,
        hold,
        old,
        lambda cas: _rewrite_at(wire, client, key, cas, new, ttl),
    )


def _rewrite_at(
    wire: Wire, client: Any, key: str, cas: int, new: str, ttl: int
) -> MemcachedHold | None:
    """Store ``new`` at ``key`` only while its CAS id is ``cas``: the hold on
    the new item, or None (another CAS id by then, or gone)."""
    if wire.meta(client):
        command = meta.swap(_wire_key(client, key), new.encode(), cas, ttl)
        reply = wire.command(client, command)
        if reply is not None:
            new_cas = meta.swapped(reply)
            return None if new_cas is None else wire.hold(client, new_cas)
    if not client.cas(key, new, cas, expire=ttl, noreply=False):
        return None
    value, new_cas = client.gets(key)
    return wire.hold(client, new_cas, proven=False) if value == new else None


def delete_if(wire: Wire, client: Any, key: str, token: object, cas: int) -> bool:
    """Delete the item at ``key`` only while its CAS id is ``cas``; True if
    it did."""
    if wire.meta(client):
        reply = wire.command(client, meta.delete(_wire_key(client, key), cas))
        if reply is not None:
            return meta.deleted(reply)
    # cas() answers True (STORED), False (EXISTS: another owner's) or None
    # (NOT_FOUND); an expiry in the past makes the stored item expire at once.
    return bool(client.cas(key, token, cas, expire=_PAST, noreply=False))
