"""Locks on memcached from an event loop: the sync backend's meta commands,
sent over asyncio connections of the loop's own.

The hot path (take a lock: ``ms`` in add mode; release it: ``md`` with the CAS
id) is one round trip, as in the sync backend, over the loop's one connection
to the lock's server: commands of every coroutine are pipelined on it, their
replies parsed in order as the bytes arrive (memcached answers a connection's
commands in the order they came; ``backends.aio.pipeline``), so a coroutine cancelled
mid-command never leaves a reply unread. What a new connection needs first
is done the sync backend's way, in a thread: which run of the server it
reaches (a restarted memcached comes back empty, and new locks on it wait out
``RESTART_GRACE``, see ``backends.memcached.restarts``) and whether it speaks
meta commands (one that does not is served by the sync backend in a thread,
``backends.aio.threaded``).

A CAS id alone proves ownership only over the connection that took the lock,
still open: a server restarted since hands its ids out again from 1. A new
connection checks the stored token first (tokens are random per acquisition),
as the sync backend does over a connection of another thread.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, cast

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import MemcacheError

from ...conf import settings as tasklock_settings
from ...foreign import memcached_client_of
from .. import Peek, backend_for
from ..aio.base import Cancel, PipelinedBackend
from ..aio.finishing import carried_through, finish_later
from ..aio.pipeline import Pipeline
from ..aio.threaded import ThreadedBackend
from . import meta
from .restarts import _refused
from .wire import (
    MemcachedHold,
    _server_name,
    expiry_on,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..base import Hold
    from .backend import MemcachedBackend

__all__ = [
    "AsyncMemcached",
    "NoMetaCommands",
    "build",
]

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
            # One reply, whole (the common case): ``_deliver``, inlined. Called,
            # an async Lock cycle took 0.7 % more instructions (make bench-cpu,
            # 159.3k -> 160.4k), past that row's 2 % budget.
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
                stop = meta.reply_end(buffer, start)
                if stop < 0:
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
    backend.server_runs.known(client)
    if client.sock is None or backend.server_runs.learnt.get(client) is not client.sock:
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
        client_class, options = memcached_client_of(cache)
        self._hash: Any = client_class(cache.client_servers, **options)
        self._prefix: bytes = getattr(self._hash, "key_prefix", b"") or b""
        self._servers: dict[Any, _Server] = {}
        #: key -> its server, remembered (hashing a key costs more than the
        #: rest of a take's Python).
        self._by_key: dict[str, _Server] = {}
        #: lock key -> its key on the wire (the client's prefix before it).
        self._wires: dict[str, bytes] = {}
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

    def _wire(self, key: str) -> bytes:
        """``key`` as the server knows it, remembered."""
        if len(self._wires) >= 4096:
            self._wires.clear()
        wire = self._wires[key] = self._prefix + key.encode()
        return wire

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
                self.sync.server_runs.refuse_if_restarted(server.client)
            handler = None if late is None else functools.partial(late, conn)
            try:
                reply = await conn.send(command, server.timeout, handler)
            except ConnectionError:
                if reused and attempt == 1:
                    continue
                raise
            return reply, conn, attempt == 2
        raise AssertionError("unreachable")

    async def _read_item(
        self, server: _Server, wire: bytes
    ) -> tuple[object, int] | None:
        """The item's value (a str, as tokens are) and CAS id
        (``meta.while_ours``'s read); None if it is gone."""
        reply, _, _ = await self._command(server, meta.read(wire))
        found = meta.value_of(reply)
        if found is None:
            return None
        return found[0].decode(errors="replace"), found[1]

    async def _while_ours(
        self,
        server: _Server,
        wire: bytes,
        hold: MemcachedHold,
        token: object,
        proven: bool,
        write: Callable[[int], Awaitable[Any]],
    ) -> Any:
        """``meta.while_ours``'s steps, each awaited: the item read, or
        ``write(cas)``; at once at the holder's CAS id where the connection
        proves it (``proven``), as the sync Wire does."""
        tries = meta.MOVES_IN_A_ROW
        if proven:
            done = await write(hold.cas)
            if meta.settled(hold, token, done):
                return done
            tries -= 1
        steps = meta.while_ours(wire.decode(errors="replace"), hold, token, tries)
        step = next(steps)
        while True:
            if step == meta.READ:
                answer = await self._read_item(server, wire)
            else:
                answer = await write(step)
            try:
                step = steps.send(answer)
            except StopIteration as done_steps:
                return done_steps.value

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
            command = meta.add(
                self._wires.get(key) or self._wire(key),
                token.encode(),
                expiry_on(server.server, expire),
            )
            landed = functools.partial(_landed, conn, cancel)
            try:
                reply = await conn.send(command, server.timeout, landed)
            except ConnectionError:
                pass  # it may have been stored before it dropped: sent again below
            else:
                found = meta.taken(reply)
                if found:
                    return MemcachedHold(found, conn)
                if found is None:
                    return None
                raise meta.no_cas(_server_name(server.server))
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
            wire = self._wires.get(key) or self._wire(key)
            command = meta.delete(wire, hold.cas)  # type: ignore[attr-defined]
            try:
                reply = await conn.send(command, server.timeout)
            except ConnectionError:
                reply = b""  # it may have gone: checked by value below
            gone = meta.removed(reply)
            if gone is not None:
                return gone
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
                    self._command(self._server(key), meta.exists(prefix + key.encode()))
                    for key in keys
                )
            )
        except NoMetaCommands:
            return await self._threaded.held_many(keys)
        return [meta.present(reply) for reply, _, _ in replies]

    async def peek(self, key: str) -> Peek | None:
        server = self._server(key)
        try:
            reply, conn, _ = await self._command(
                server, meta.read(self._prefix + key.encode(), flags=True)
            )
        except NoMetaCommands:
            return await self._threaded.peek(key)
        found = meta.value_of(reply)
        if found is None:
            return None
        data, cas, flags = found
        # Decoded as the sync client decodes it (Django's serializer).
        value = server.client.serde.deserialize(key, data, flags)
        return Peek(value, MemcachedHold(cas, conn))

    async def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        assert isinstance(hold, MemcachedHold)
        server = self._server(key)
        wire = self._prefix + key.encode()
        data = new.encode()

        async def swap(cas: int) -> MemcachedHold | None:
            command = meta.swap(wire, data, cas, expiry_on(server.server, expire))
            reply, conn, _ = await self._command(server, command)
            new_cas = meta.swapped(reply)
            if new_cas == 0:
                raise MemcacheError(f"unexpected reply to ms: {reply!r}")
            return None if new_cas is None else MemcachedHold(new_cas, conn)

        # Read on a connection since closed, the CAS id proves nothing (the
        # server may have restarted and given it to another item): the value
        # tells, as it does after an EX.
        taker = hold.sock
        took = isinstance(taker, _Connection) and taker is server.conn
        try:
            found: MemcachedHold | None = await self._while_ours(
                server, wire, hold, old, took and not taker.broken, swap
            )
        except NoMetaCommands:
            return await self._threaded.replace(key, hold, old, new, expire)
        return found

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
        command = meta.add(wire, token.encode(), expiry_on(server.server, expire))

        def landed(conn: _Connection, line: bytes | None) -> None:
            _landed(conn, cancel, line)

        reply, conn, retried = await self._command(
            server, command, True, landed, dropped
        )
        cas = meta.taken(reply)
        if cas:
            return MemcachedHold(cas, conn)
        if cas is not None:
            raise meta.no_cas(_server_name(server.server))
        if not retried:
            return None
        # The first try, on a connection that dropped, may have stored our
        # token before it went: then the lock is ours.
        try:
            return await self._ours(server, wire, token)
        except asyncio.CancelledError:
            if cancel is not None:  # ours or not: removed if so
                cancel.failed(ConnectionResetError("cancelled while checking"))
            raise

    async def _release(
        self, server: _Server, key: str, hold: Hold, token: object
    ) -> bool:
        """Release by value: two round trips, carried to their end through a
        cancel."""
        assert isinstance(hold, MemcachedHold)
        wire = self._prefix + key.encode()

        async def delete(cas: int) -> bool | None:
            reply, _, _ = await self._command(server, meta.delete(wire, cas))
            return meta.deleted(reply) or None

        return bool(
            await carried_through(
                self._while_ours(server, wire, hold, token, False, delete)
            )
        )

    async def _ours(self, server: _Server, wire: bytes, token: str) -> Hold | None:
        """The hold on the item at ``wire`` if it holds ``token``, else None."""
        found = await self._read_item(server, wire)
        if found is None or found[0] != token:
            return None
        # Checked by value from now on: no connection of the first try is left.
        return MemcachedHold(found[1], None)


def _landed(conn: _Connection, cancel: Cancel | None, line: bytes | None) -> None:
    """What becomes of the reply ``line`` of a take whose caller was
    cancelled once it was sent on ``conn``: a lock it took is released; a
    connection lost first leaves its fate unknown (``cancel``)."""
    if cancel is None:
        return
    if line is None:
        cancel.failed(ConnectionResetError("memcached connection lost"))
        return
    cas = meta.cas_of(line, b"HD")
    if cas:
        finish_later(cancel.taken(MemcachedHold(cas, conn)))


def build(sync: MemcachedBackend) -> AsyncMemcached | None:
    """A loop's client of ``sync``'s servers (meta commands); None for an
    alias that speaks the classic ones: the sync backend on executor threads
    serves it then."""
    return None if sync.protocol == "classic" else AsyncMemcached(sync)
