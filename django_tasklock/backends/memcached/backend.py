"""Owner-checked locks on memcached, through the client of Django's PyMemcacheCache.

The lock operations; the protocol they speak is ``wire``, and the restart
checks of new connections are ``restarts``.

With memcached's meta commands (protocol.txt, "Meta Set", "Meta Delete") a lock
cycle is the same two round trips as the cookbook's unsafe ``add`` + ``delete``:

- acquire: ``ms <key> <len> T<ttl> F16 ME c`` stores only if absent (add mode) and
  answers the item's CAS id;
- release: ``md <key> C<cas>`` deletes only while the CAS id still matches;
- extend: ``ms <key> <len> C<cas> T<ttl> F16 c`` rewrites only while it matches;
- a fencing token, when the holder asks for one: ``ma`` on the lock's counter and
  ``mg <key> c v`` pipelined, the token counting only if the lock still holds
  this holder's value under its CAS id.

Any later write to the key (a new holder after expiry, eviction or flush) gives it
a new CAS id, so a stale holder can neither delete nor prolong it. CAS ids are
unique only within one run of the server, though: a restarted memcached counts
from 1 again, and a new holder can get the very CAS id an old holder kept. A
restart always breaks the TCP connections to the server, so the CAS id alone is
trusted only while the connection that took the lock is still the one in use;
otherwise (a reconnect, another thread, a pooled client) release and extend first
read the item with ``gets`` and act only if both the stored token and the CAS id
are still this holder's.

Where meta commands are missing the same checks use ``add``, ``gets`` and ``cas``.
That is memcached < 1.6, which answers ``ERROR``, and twemproxy (``nutcracker``),
which closes the connection instead; so does it on a negative expiry, so a classic
delete is ``cas`` with an absolute expiry long past (memcached reads any expiry
above 30 days as a Unix time, and one in the past expires the item at once). A
proxy may reconnect to a restarted server behind the same client socket, so on
the classic path the CAS id is never trusted alone: release and extend always
read the token back.
"""

from __future__ import annotations

import math
import socket
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, ClassVar

from pymemcache.exceptions import MemcacheError

from ...conf import settings as tasklock_settings
from ...foreign import memcached_client_of, memcached_server_picker
from ...keys import memcached_key
from ...values import unique_value
from . import checks, meta
from .fencing import draw
from .line import MemcachedLines
from .reads import MemcachedReads
from .restarts import NodeRestarted, Restarts, _refused
from .rewrite import delete_if, rewrite
from .wire import (
    MemcachedHold,
    ServerRefused,
    TimedSockets,
    Wire,
    _clocks,
    _wire_key,
    expiry_on,
    exptime,
    only_client,
    sure_life,
)

if TYPE_CHECKING:
    from django.core.cache.backends.memcached import PyMemcacheCache

    from ..base import FenceCounter, Hold

__all__ = ["MemcachedBackend"]

# What _learnt holds for a client whose connection's server run was never read.
_UNLEARNT: Any = object()


def own_options(options: dict[str, Any]) -> dict[str, Any]:
    """The alias's client OPTIONS for this package's own client: unpooled
    (it is one thread's, and the run of a server is learnt per connection,
    which a pool hides), and never waiting longer than SOCKET_TIMEOUT to
    connect, send or for a reply, so a stalled server holds up only what is on
    it: the kernel's timers on each socket (``TimedSockets``), and the
    alias's own ``timeout`` where it sets one, kept if shorter."""
    ours = tasklock_settings.SOCKET_TIMEOUT
    made = {**options, "use_pooling": False}
    made["socket_module"] = TimedSockets(options.get("socket_module", socket), ours)
    made["connect_timeout"] = min(options.get("connect_timeout") or ours, ours)
    if options.get("timeout"):
        made["timeout"] = min(options["timeout"], ours)
    return made


class MemcachedBackend(MemcachedReads):
    """Locks on the memcached servers of a PyMemcacheCache alias."""

    kind = "memcached"
    async_client: ClassVar[str | None] = "django_tasklock.backends.memcached.aio"
    alias_checks = staticmethod(checks.alias_checks)

    errors = (OSError, MemcacheError)
    cache: PyMemcacheCache

    def __init__(
        self, cache: PyMemcacheCache, alias: str, protocol: str = "auto"
    ) -> None:
        super().__init__(cache, alias, protocol)
        self.records = self.restarts = self.uptime = self.items = self
        self.lines = MemcachedLines(self)
        self.wire = Wire(protocol)
        # A client of our own, built as Django builds its one (same servers
        # and hashing: the same server for a key; own_options), which
        # close_caches() leaves alone: Celery's Django fixup closes every cache
        # connection after every task, too costly to reconnect for each lock.
        client_class, options = memcached_client_of(cache)
        self._hash_client: Any = client_class(
            cache.client_servers, **own_options(options)
        )
        hash_client = self._hash_client
        self._pick = memcached_server_picker(hash_client)
        self._only_client: Any = only_client(hash_client)
        self.server_runs = Restarts(hash_client, self.errors)
        # Per server client, the connection whose server run was learnt.
        self._learnt = self.server_runs.learnt

    def close(self) -> None:
        self._hash_client.close()

    def shortest_life(self, expire: float) -> float:
        return sure_life(expire)

    def key_for(self, lock_id: str) -> str:
        reserved = len(getattr(self._hash_client, "key_prefix", b"") or b"")
        return memcached_key(self.cache, lock_id, reserved=reserved)

    # -- acquire -----------------------------------------------------------------

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        sock: Any = getattr(client, "sock", None)
        wire = self.wire
        if (
            sock is not None
            and sock is self._learnt.get(client, _UNLEARNT)
            and not _refused
            and not wire.classic
            and client.server not in wire.without_meta
        ):
            # The common case: a connection whose server run is known and
            # speaks meta commands (Wire.meta, but for a forced "meta" alias's
            # server another alias found without them: the long way), in one
            # send and one read. Anything unusual goes the long way below.
            # (expiry_on, Wire.meta, meta.add and meta.taken inlined: called,
            # a Lock cycle took 2.3 % more instructions, make bench-cpu.)
            at = _clocks.get(client.server)
            ttl = (
                exptime(expire) if at is None else math.ceil(_monotonic() + at + expire)
            )
            data = token.encode()
            wire_key = client.key_prefix + key.encode()
            command = b"ms %s %d T%d F16 ME c\r\n%s\r\n" % (
                wire_key,
                len(data),
                ttl,
                data,
            )
            reply = wire.round_trip(client, sock, command)
            if reply is None:
                # The command may have been carried out before it went.
                return self._acquire_tries(client, key, token, ttl, 1)
            if reply[-2:] == b"\r\n":  # the whole reply (one line)
                if reply[:4] == b"HD c":
                    cas = reply[4:-2]
                    if cas.isdigit() and cas != b"0":
                        return MemcachedHold(int(cas), sock)
                elif reply[:2] == b"NS":  # "NS c0": someone else holds it
                    return None
            line = wire.one_reply(client, sock, reply)
            if line is not None:
                return wire.added(client, wire_key, line)
        return self._acquire_tries(client, key, token, expire, 0)

    def _acquire_tries(
        self, client: Any, key: str, token: str, expire: float | int, tries: int
    ) -> MemcachedHold | None:
        """The acquire, learning the server's run on a new connection, and tried
        once more if a connection from before had dropped; ``tries``: how many
        were already sent (with ``expire``, then what they sent)."""
        ttl: int | None = math.ceil(expire) if tries else None

        def attempt() -> MemcachedHold | None:
            nonlocal tries
            tries += 1
            # A new connection: learn which run of the server answers it
            # (and its clock, for the first send's expiry).
            self.server_runs.known(client)
            if _refused:
                self.server_runs.refuse_if_restarted(client)
            nonlocal ttl
            if ttl is None:
                ttl = expiry_on(client.server, expire)
            hold = self._acquire(client, key, token, ttl)
            if hold is None and tries > 1 and unique_value(token):
                # The dropped first try may have stored our token before the
                # connection went: then the lock is ours. Only a value nobody
                # else stores proves it: a rate limit's state may equal
                # another process's, written in the same millisecond.
                value, cas = client.gets(key)
                if value == token:
                    return self.wire.hold(client, cas, proven=False)
            return hold

        if tries:
            return attempt()
        return self.wire.once_more(client, attempt)

    def _acquire(
        self, client: Any, key: str, token: str, ttl: int
    ) -> MemcachedHold | None:
        if self.wire.meta(client):
            wire = _wire_key(client, key)
            reply = self.wire.command(client, meta.add(wire, token.encode(), ttl))
            if reply is not None:
                return self.wire.added(client, wire, reply)
        if not client.add(key, token, expire=ttl, noreply=False):
            return None
        value, cas = client.gets(key)
        # Someone else's value here means our item expired in between: not ours.
        if value != token:
            return None
        return self.wire.hold(client, cas, proven=False)

    def restarted_at(self, key: str) -> float | None:
        client = self._client(key)
        self.server_runs.known(client)
        return _refused.get(client.server)

    def reassert(self, key: str, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        return self.wire.once_more(
            client,
            lambda: self._acquire(client, key, token, expiry_on(client.server, expire)),
        )

    # -- fencing tokens ------------------------------------------------------------

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        # The counter lives on the lock's own server, whichever server its key
        # would hash to: one round trip draws the token and checks the lock.
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        return self.wire.once_more(
            client, lambda: draw(self.wire, client, key, hold, token, fence)
        )

    # -- release -----------------------------------------------------------------

    def release(self, key: str, hold: Hold, token: object) -> bool:
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        sock: Any = getattr(client, "sock", None)
        if sock is not None and sock is hold.sock:
            # The common case: the connection that took the lock (so it speaks
            # meta commands), where the CAS id alone proves ownership; one send
            # and one read. Anything unusual goes the long way below.
            wire = client.key_prefix + key.encode()
            # (meta.delete inlined: called, a Lock cycle took 1.7 % more
            # instructions. Whole replies compared: a read may end mid-reply.)
            reply = self.wire.round_trip(
                client, sock, b"md %s C%d\r\n" % (wire, hold.cas)
            )
            if reply is None:
                # A new connection checks the stored token first.
                return self._release(client, key, hold, token)
            if reply == b"HD\r\n":
                return True
            if reply == b"NF\r\n":
                return False
            if reply != b"EX\r\n":
                line = self.wire.one_reply(client, sock, reply)
                if line is not None and not line.startswith(b"EX"):
                    return meta.deleted(line)
            # Another CAS id: another owner's item, or ours moved by the slab
            # rebalancer (a new CAS id, same value): told apart by the value.
            hold.sock = None
        return self.wire.once_more(
            client, lambda: self._release(client, key, hold, token)
        )

    def _release(
        self, client: Any, key: str, hold: MemcachedHold, token: object
    ) -> bool:
        deleted = self.wire.while_ours(
            client,
            key,
            hold,
            token,
            lambda cas: delete_if(self.wire, client, key, token, cas) or None,
        )
        return bool(deleted)

    def discard(self, key: str, token: str) -> bool:
        client = self._client(key)

        def attempt() -> bool:
            value, cas = client.gets(key)
            if value != token or cas is None:
                return False
            return delete_if(self.wire, client, key, token, int(cas))

        return self.wire.once_more(client, attempt)

    def lost_with_store(self, exc: BaseException) -> bool:
        # Nothing listens: the memcached process is gone, and with it every item
        # it held (it keeps nothing on disk). A refused restarted server was sent
        # nothing, and one over its connection limit refused it unread.
        return isinstance(exc, (ConnectionRefusedError, NodeRestarted, ServerRefused))

    # -- extend ------------------------------------------------------------------

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        return self.replace(key, hold, token, token, expire)

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        ttl = expiry_on(client.server, expire)
        tries = 0

        def attempt() -> MemcachedHold | None:
            nonlocal tries
            tries += 1
            done = rewrite(self.wire, client, key, hold, old, new, ttl)
            if done is None and tries > 1 and unique_value(new):
                # The first try may have been carried out before its reply was
                # lost: the store then holds ``new`` (a token, or a call's
                # mark: unique to this holder) under a CAS id of its own.
                value, cas = client.gets(key)
                if value == new and cas is not None:
                    return self.wire.hold(client, cas, proven=False)
            return done

        return self.wire.once_more(client, attempt)
