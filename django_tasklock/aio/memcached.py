"""Locks on memcached from an event loop: the sync backend's meta commands,
sent over asyncio connections of the loop's own.

The hot path (take a lock: ``ms`` in add mode; release it: ``md`` with the CAS
id) is one round trip, as in the sync backend, over the loop's one connection
to the lock's server: commands of every coroutine are pipelined on it, their
replies parsed in order as the bytes arrive (memcached answers a connection's
commands in the order they came; ``aio.pipeline``), so a coroutine cancelled
mid-command never leaves a reply unread. What a new connection needs first
is done the sync backend's way, in a thread: which run of the server it
reaches (a restarted memcached comes back empty, and new locks on it wait out
``RESTART_GRACE``, see ``backends.memcached.restarts``) and whether it speaks
meta commands (one that does not is served by the sync backend in a thread,
``aio.threaded``).

A CAS id alone proves ownership only over the connection that took the lock,
still open: a server restarted since hands its ids out again from 1. A new
connection checks the stored token first (tokens are random per acquisition),
as the sync backend does over a connection of another thread.
"""

from __future__ import annotations

import asyncio
import functools
import math
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, cast

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import MemcacheError

from ..backends import Peek, backend_for
from ..backends.memcached.restarts import _refused
from ..backends.memcached.wire import (
    _TEXT_FLAG,
    MOVES_IN_A_ROW,
    MemcachedHold,
    _clocks,
    _server_name,
    expiry_on,
    exptime,
    kept_moving,
)
from ..conf import settings as tasklock_settings
from ..values import unique_value
from .base import Cancel, PipelinedBackend
from .finishing import carried_through, finish_later
from .pipeline import Pipeline
from .threaded import ThreadedBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends import Hold
    from ..backends.memcached.backend import MemcachedBackend

__all__ = ["AsyncMemcached", "NoMetaCommands"]

#: Bytes waiting to be sent on a connection past which a command waits for
#: them to go (the server is slow to read).
_HIGH_WATER = 1 << 16
#: Replies handed out in one callback before the loop runs others.
_REPLIES_AT_ONCE = 32


class NoMetaCommands(Exception):
    """The server does not speak meta commands: the sync backend serves it."""


class _Connection(Pipeline, asyncio.Protocol):
    """One asyncio connection to a memcached server: commands pipelined
    (``Pipeline``), their replies parsed as the bytes arrive, with no task
    or stream reader between the socket and the waiters."""

    def __init__(self) -> None:
        super().__init__()
        self.transport: asyncio.Transport | None = None
        self._buffer = b""
        #: A parse of replies left in the buffer, scheduled to run next.
        self._parsing: asyncio.Handle | None = None
        self._closed = asyncio.get_running_loop().create_future()
        self._resumed: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses.)
        self.transport = stream = cast("asyncio.Transport", transport)
        stream.set_write_buffer_limits(high=_HIGH_WATER)
        self._write = stream.write

    def data_received(self, data: bytes) -> None:
        if self._buffer or self._parsing is not None:
            self._buffer += data
            if self._parsing is None:
                self._parse()
        elif (
            data.find(b"\r\n") == len(data) - 2 and data[:3] != b"VA " and self.pending
        ):
            # One reply, whole (the common case): ``_deliver``, inlined.
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_result(data)
            elif self.late:
                handler = self.late.pop(waiter, None)
                if handler is not None:
                    handler(data)
        else:
            self._buffer = data
            self._parse()

    def eof_received(self) -> None:
        self._fail(ConnectionResetError("memcached closed the connection"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.broken:
            self._fail(exc or ConnectionResetError("memcached closed the connection"))
        if not self._closed.done():
            self._closed.set_result(None)
        resumed = self._resumed
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def pause_writing(self) -> None:
        self._resumed = asyncio.get_running_loop().create_future()
        self._drain = self._resuming

    def resume_writing(self) -> None:
        self._drain = None
        resumed = self._resumed
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    async def _resuming(self) -> None:
        resumed = self._resumed
        if resumed is not None:
            await asyncio.shield(resumed)
        if self.broken:
            raise self.lost("memcached connection lost")

    # -- Pipeline ----------------------------------------------------------

    def _close_transport(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _parse(self) -> None:
        """Hand out the replies whole in the buffer, at most
        ``_REPLIES_AT_ONCE`` in one callback (those of a thousand coroutines
        would hold the loop): the rest in the next."""
        self._parsing = None
        buffer, start = self._buffer, 0
        try:
            for _ in range(_REPLIES_AT_ONCE):
                end = buffer.find(b"\r\n", start)
                if end < 0:
                    break
                stop = end + 2
                if buffer.startswith(b"VA ", start):
                    stop += int(buffer[start + 3 : end].split(b" ", 1)[0]) + 2
                    if len(buffer) < stop:
                        break
                if not self.pending:
                    raise ConnectionResetError(
                        f"memcached sent {buffer[start:stop]!r} unasked"
                    )
                self._deliver(buffer[start:stop])
                start = stop
            else:
                if buffer.find(b"\r\n", start) >= 0:
                    loop = asyncio.get_running_loop()
                    self._parsing = loop.call_soon(self._parse)
        except (ConnectionError, ValueError) as exc:
            self._buffer = b""
            self._fail(exc)
            return
        self._buffer = buffer[start:] if start else buffer

    async def close(self) -> None:
        if not self.broken:
            self._fail(ConnectionResetError("the connection was closed"))
        await self._closed


def _ours(timeout: float | None) -> float:
    """``timeout`` (an alias's option), never longer than SOCKET_TIMEOUT."""
    ours = tasklock_settings.SOCKET_TIMEOUT
    return ours if not timeout else min(timeout, ours)


class _Server:
    """A loop's connection to one server, opened when first needed and again
    after it broke."""

    def __init__(self, server: Any, client: Any) -> None:
        self.server, self.client = server, client
        #: How long a reply may take: the client's ``timeout`` option where it
        #: is shorter than ``TASKLOCK['SOCKET_TIMEOUT']``, else that.
        self.timeout: float = _ours(getattr(client, "timeout", None))
        self.conn: _Connection | None = None
        self._opening: asyncio.Future[_Connection] | None = None
        self.meta: bool | None = None

    async def connection(self, alias: str, protocol: str) -> _Connection:
        conn = self.conn
        if conn is not None and not conn.broken:
            return conn
        opening = self._opening
        if opening is None:
            opening = self._opening = asyncio.ensure_future(self._open(alias, protocol))
            opening.add_done_callback(self._opened)
        return await asyncio.shield(opening)

    def _opened(self, opening: asyncio.Future[_Connection]) -> None:
        self._opening = None
        if not opening.cancelled() and opening.exception() is None:
            self.conn = opening.result()

    async def _open(self, alias: str, protocol: str) -> _Connection:
        server = self.server
        connect_timeout = _ours(getattr(self.client, "connect_timeout", None))
        loop = asyncio.get_running_loop()
        opening = (
            loop.create_connection(_Connection, *server)
            if isinstance(server, tuple)
            else loop.create_unix_connection(_Connection, server)
        )
        _, conn = await asyncio.wait_for(opening, connect_timeout)
        try:
            # Opened first, then the server's run learnt: a restart in between
            # has broken this connection already.
            self.meta = await asyncio.to_thread(_learn, alias, protocol, server)
        except BaseException:
            await conn.close()
            raise
        return conn


def _learn(alias: str, protocol: str, server: Any) -> bool:
    """In a thread: learn ``server``'s run over a new connection of this
    thread's sync backend (refusing new locks if it restarted), and whether it
    speaks meta commands. Raises if it could not be read: "could not tell"
    never lets a lock through."""
    backend: MemcachedBackend = backend_for(alias, protocol=protocol)  # type: ignore[assignment]
    client = _client_at(backend, server)
    client.close()
    backend.restarts.known(client)
    if client.sock is None or backend.restarts.learnt.get(client) is not client.sock:
        raise ConnectionRefusedError(
            f"could not read which run of memcached at {_server_name(server)} "
            "answers (it did not reply)"
        )
    return backend.wire.meta(client)


def _client_at(backend: MemcachedBackend, server: Any) -> Any:
    """The sync backend's client of ``server`` (an address of its alias)."""
    hash_client = backend._hash_client
    clients = (
        hash_client.clients.values()
        if isinstance(hash_client, HashClient)
        else [hash_client]
    )
    for client in clients:
        if client.server == server:
            return client
    raise MemcacheError(f"cache {backend.alias!r} has no server {server!r}")


class _Servers(PipelinedBackend):
    """The loop's connections to the servers of one PyMemcacheCache alias,
    and a command sent on the one that holds a key."""

    native = True
    sync: MemcachedBackend

    def __init__(self, sync: MemcachedBackend) -> None:
        super().__init__(sync)
        self.errors = (*sync.errors, OSError, asyncio.TimeoutError)
        cache: Any = sync.cache
        # Built as Django builds its own (same servers, options, hashing), never
        # sent a command: its hashing alone picks each key's server, and it
        # never marks one dead (a lock goes nowhere but its own server).
        self._hash: Any = cache._class(cache.client_servers, **cache._options)
        self._prefix: bytes = getattr(self._hash, "key_prefix", b"") or b""
        self._servers: dict[Any, _Server] = {}
        #: key -> its server, remembered (hashing a key costs more than the
        #: rest of a take's Python).
        self._by_key: dict[str, _Server] = {}
        #: For a server that does not speak meta commands.
        self._threaded = ThreadedBackend(sync)

    def _server(self, key: str) -> _Server:
        found = self._by_key.get(key)
        if found is not None:
            return found
        hashing = self._hash
        if isinstance(hashing, HashClient):
            client = hashing.clients[hashing.hasher.get_node(key)]
        else:
            client = hashing
        found = self._servers.get(client.server)
        if found is None:
            found = self._servers[client.server] = _Server(client.server, client)
        if len(self._by_key) >= 4096:
            self._by_key.clear()
        self._by_key[key] = found
        return found

    async def _command(
        self,
        server: _Server,
        command: bytes,
        take: bool = False,
        late: Callable[[_Connection, bytes | None], object] | None = None,
        dropped: bool = False,
    ) -> tuple[bytes, _Connection, bool]:
        """``command``'s reply, the connection that carried it, and whether it
        was sent twice: once more on a new connection if one from before had
        dropped (a restart, an idle timeout), as the sync backend does
        (``dropped``: it was sent once already, on a connection that dropped).
        A new connection that fails is an outage, and is raised. A ``take`` is
        refused on a server that restarted within ``RESTART_GRACE``. ``late``
        gets the connection and the reply if the caller is cancelled once the
        command is written."""
        for attempt in (2,) if dropped else (1, 2):
            conn = server.conn
            reused = conn is not None and not conn.broken
            if not reused:  # (a coroutine less on the hot path)
                conn = await server.connection(self.alias, self.sync.protocol)
            assert conn is not None
            if not server.meta:
                raise NoMetaCommands(_server_name(server.server))
            if take and _refused:
                # (Checked after the connection: a new one has just learnt
                # whether the server restarted.)
                self.sync.restarts.refuse_if_restarted(server.client)
            handler = None if late is None else functools.partial(late, conn)
            try:
                reply = await conn.send(command, server.timeout, handler)
            except ConnectionError:
                if reused and attempt == 1:
                    continue
                raise
            return reply, conn, attempt == 2
        raise AssertionError("unreachable")

    async def _owner_cas(
        self, server: _Server, wire: bytes, token: object
    ) -> int | None:
        """The CAS id of the item at ``wire`` if it holds ``token``, else None."""
        reply, _, _ = await self._command(server, b"mg %s v c\r\n" % wire)
        if not reply.startswith(b"VA"):
            return None
        header, _, value = reply.partition(b"\r\n")
        if value[:-2] != str(token).encode():
            return None
        return _cas_of(header, b"VA")

    async def aclose(self) -> None:
        for server in self._servers.values():
            conn, server.conn = server.conn, None
            if conn is not None:
                await conn.close()


class AsyncMemcached(_Servers):
    """Locks and the items of rate limits on the servers of one
    PyMemcacheCache alias, from one event loop."""

    async def take(
        self,
        key: str,
        token: str,
        expire: float,
        cancel: Cancel | None,
    ) -> Hold | None:
        # No task of its own: a cancel once the command is written leaves its
        # reply to the connection, which hands it to ``cancel``.
        server = self._by_key.get(key) or self._server(key)
        conn = server.conn
        if conn is not None and server.meta and not conn.broken and not _refused:
            # The hot path, in one coroutine: the server's connection is open
            # and speaks meta commands, and no server is in its restart grace.
            # (_take_command, expiry_on inlined)
            wire = self._prefix + key.encode()
            data = token.encode()
            clock = _clocks.get(server.server)
            ttl = (
                exptime(expire)
                if clock is None
                else math.ceil(_monotonic() + clock + expire)
            )
            command = b"ms %s %d T%d F16 ME c\r\n%s\r\n" % (wire, len(data), ttl, data)
            landed = functools.partial(_landed, conn, cancel)
            try:
                reply = await conn.send(command, server.timeout, landed)
            except ConnectionError:
                pass  # it may have been stored before it dropped: sent again below
            else:
                if reply[:4] == b"HD c" and reply[4:-2].isdigit():
                    cas = int(reply[4:-2])
                    if cas:
                        return MemcachedHold(cas, conn)
                return await self._took(server, wire, reply, token, False, cancel)
            dropped = True
        else:
            dropped = False
        try:
            return await self._acquire(key, token, expire, cancel, dropped)
        except NoMetaCommands:
            threaded = self._threaded
            return await threaded.take(key, token, expire, cancel)

    async def drop(self, key: str, hold: Hold, token: object) -> bool:
        server = self._by_key.get(key) or self._server(key)
        conn = server.conn
        if getattr(hold, "sock", None) is conn and conn is not None and not conn.broken:
            # The hot path, in one coroutine. The connection that took it,
            # never closed since: no restart since, so the CAS id alone proves
            # it is this holder's item.
            command = b"md %s%s C%d\r\n" % (self._prefix, key.encode(), hold.cas)  # type: ignore[attr-defined]
            try:
                reply = await conn.send(command, server.timeout)
            except ConnectionError:
                reply = b""  # it may have gone: checked by value below
            if reply[:2] == b"HD":
                return True
            if reply[:2] == b"NF":
                return False
            # EX: another CAS id, another owner's item or ours moved by the
            # slab rebalancer: the value tells them apart.
        try:
            return await self._release(server, key, hold, token)
        except NoMetaCommands:
            return await self._threaded.drop(key, hold, token)

    async def held_many(self, keys: list[str]) -> list[bool]:
        """Every key's ``mg`` at once, pipelined on each server's connection."""
        prefix = self._prefix
        try:
            replies = await asyncio.gather(
                *(
                    self._command(
                        self._server(key), b"mg %s\r\n" % (prefix + key.encode())
                    )
                    for key in keys
                )
            )
        except NoMetaCommands:
            return await self._threaded.held_many(keys)
        held = []
        for reply, _, _ in replies:
            if not reply.startswith((b"HD", b"EN")):
                raise MemcacheError(f"unexpected reply to mg: {reply!r}")
            held.append(reply.startswith(b"HD"))
        return held

    async def peek(self, key: str) -> Peek | None:
        server = self._server(key)
        wire = self._prefix + key.encode()
        try:
            reply, conn, _ = await self._command(server, b"mg %s v c f\r\n" % wire)
        except NoMetaCommands:
            return await self._threaded.peek(key)
        if reply.startswith(b"EN"):
            return None
        header, _, data = reply.partition(b"\r\n")
        cas = _cas_of(header, b"VA")
        flags = next((int(f[1:]) for f in header.split() if f[:1] == b"f"), 0)
        if cas is None:
            raise MemcacheError(f"unexpected reply to mg: {header!r}")
        # Decoded as the sync client decodes it (Django's serializer).
        value = server.client.serde.deserialize(key, data[:-2], flags)
        return Peek(value, MemcachedHold(cas, conn))

    async def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        assert isinstance(hold, MemcachedHold)
        server = self._server(key)
        wire = self._prefix + key.encode()
        data = new.encode()
        # Read on a connection since closed, the CAS id proves nothing (the
        # server may have restarted and given it to another item): the value
        # tells, as it does after an EX below.
        taker = hold.sock
        took = isinstance(taker, _Connection) and taker is server.conn
        cas: int | None = hold.cas if took and not taker.broken else None
        try:
            for _ in range(MOVES_IN_A_ROW):
                if cas is None:
                    cas = await self._owner_cas(server, wire, old)
                    if cas is None or (cas != hold.cas and not unique_value(old)):
                        return None
                command = b"ms %s %d C%d T%d F%d c\r\n%s\r\n" % (
                    wire, len(data), cas, expiry_on(server.server, expire), _TEXT_FLAG, data
                )  # fmt: skip
                reply, conn, _ = await self._command(server, command)
                if reply.startswith(b"HD"):
                    new_cas = _cas_of(reply, b"HD")
                    if new_cas is None:
                        break
                    return MemcachedHold(new_cas, conn)
                if not reply.startswith((b"EX", b"NF")):
                    break
                # EX: another CAS id, another owner's item or ours moved by
                # the slab rebalancer (NF: gone). The value tells them apart.
                if not unique_value(old):
                    return None
                cas = None
            else:
                raise kept_moving(key)
        except NoMetaCommands:
            return await self._threaded.replace(key, hold, old, new, expire)
        raise MemcacheError(f"unexpected reply to ms: {reply!r}")

    @staticmethod
    def _take_command(server: Any, wire: bytes, token: str, expire: float) -> bytes:
        """``ms`` in add mode: stored only if absent, its CAS id returned."""
        data = token.encode()
        ttl = expiry_on(server, expire)
        return b"ms %s %d T%d F16 ME c\r\n%s\r\n" % (wire, len(data), ttl, data)

    async def _acquire(
        self,
        key: str,
        token: str,
        expire: float,
        cancel: Cancel | None,
        dropped: bool = False,
    ) -> Hold | None:
        server = self._server(key)
        wire = self._prefix + key.encode()
        command = self._take_command(server.server, wire, token, expire)

        def landed(conn: _Connection, line: bytes | None) -> None:
            _landed(conn, cancel, line)

        reply, conn, retried = await self._command(
            server, command, True, landed, dropped
        )
        cas = _cas_of(reply, b"HD")
        if cas:
            return MemcachedHold(cas, conn)
        return await self._took(server, wire, reply, token, retried, cancel)

    async def _took(
        self,
        server: _Server,
        wire: bytes,
        reply: bytes,
        token: str,
        retried: bool,
        cancel: Cancel | None,
    ) -> Hold | None:
        """What a take's reply other than a CAS id means: refused (None), ours
        after all (a take sent twice), or an error, raised."""
        if reply.startswith(b"NS"):
            if retried:
                # The first try, on a connection that dropped, may have
                # stored our token before it went: then the lock is ours.
                try:
                    return await self._ours(server, wire, token)
                except asyncio.CancelledError:
                    if cancel is not None:  # ours or not: removed if so
                        cancel.failed(ConnectionResetError("cancelled while checking"))
                    raise
            return None
        if reply.startswith(b"HD"):
            raise MemcacheError(
                f"memcached at {_server_name(server.server)} runs without CAS "
                "ids (-C), so a lock cannot be owner-checked; restart it without -C"
            )
        raise MemcacheError(f"unexpected reply to ms: {reply!r}")

    async def _release(
        self, server: _Server, key: str, hold: Hold, token: object
    ) -> bool:
        """Release by value: two round trips, carried to their end through a
        cancel."""
        assert isinstance(hold, MemcachedHold)
        wire = self._prefix + key.encode()
        return await carried_through(self._release_by_value(server, wire, hold, token))

    async def _release_by_value(
        self, server: _Server, wire: bytes, hold: MemcachedHold, token: object
    ) -> bool:
        for _ in range(MOVES_IN_A_ROW):
            cas = await self._owner_cas(server, wire, token)
            if cas is None or (cas != hold.cas and not unique_value(token)):
                # (A value other code may store too proves nothing by itself.)
                return False
            command = b"md %s C%d\r\n" % (wire, cas)
            reply, _, _ = await self._command(server, command)
            if reply.startswith(b"HD"):
                return True
            if not unique_value(token):
                return False
            # EX: moved once more between the read and the delete (or NF,
            # gone: the read tells).
        raise kept_moving(wire.decode(errors="replace"))

    async def _ours(self, server: _Server, wire: bytes, token: str) -> Hold | None:
        """The hold on the item at ``wire`` if it holds ``token``, else None."""
        cas = await self._owner_cas(server, wire, token)
        # Checked by value from now on: no connection of the first try is left.
        return None if cas is None else MemcachedHold(cas, None)


def _landed(conn: _Connection, cancel: Cancel | None, line: bytes | None) -> None:
    """What becomes of the reply ``line`` of a take whose caller was
    cancelled once it was sent on ``conn``: a lock it took is released; a
    connection lost first leaves its fate unknown (``cancel``)."""
    if cancel is None:
        return
    if line is None:
        cancel.failed(ConnectionResetError("memcached connection lost"))
        return
    cas = _cas_of(line, b"HD")
    if cas:
        finish_later(cancel.taken(MemcachedHold(cas, conn)))


def _cas_of(reply: bytes, head: bytes) -> int | None:
    """The ``c`` flag of a meta reply starting with ``head``, or None."""
    if not reply.startswith(head):
        return None
    for flag in reply.split():
        if flag[:1] == b"c" and flag[1:].isdigit():
            return int(flag[1:])
    return None
