"""memcached's wire protocol as the locks speak it, on pymemcache's sockets.

Meta commands (memcached 1.6+) where the server has them, the classic commands
(``add``, ``gets``, ``cas``) where it does not (memcached < 1.6 answers
``ERROR``; twemproxy closes the connection instead). Replies are read by length
(a ``VA`` value may hold CR LF itself); the hot path sends one command and reads
once on a connection from before. ``Wire`` is one alias's view: which protocol
it was told to use, and which servers turned out to lack meta commands.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, TypeVar

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import (
    MemcacheClientError,
    MemcacheError,
    MemcacheUnexpectedCloseError,
    MemcacheUnknownCommandError,
)

from ...foreign import memcached_connect
from . import meta

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "MemcachedHold",
    "ServerRefused",
    "TimedSockets",
    "Wire",
    "clock_suspect",
    "closes_on_stats",
    "expiry_on",
    "exptime",
    "meta_support",
    "observe_clock",
]

_T = TypeVar("_T")
# What a server that went away since the last command looks like on its socket.
_DROPPED = (MemcacheUnexpectedCloseError, BrokenPipeError, ConnectionResetError)
# Servers that refused a meta command; they get the classic commands.
_classic_servers: set[Any] = set()
# An absolute expiry (memcached reads any above 30 days as a Unix time) long past:
# the written item expires at once. Unlike -1, proxies pass it on.
_PAST = 2592001

logger = logging.getLogger(__name__)

#: The longest expiry memcached reads as seconds from now (protocol.txt,
#: "Expiration times"); any larger number is a Unix time.
_RELATIVE_MOST = 2592000


def exptime(expire: float) -> int:
    """What to send memcached for an item to live ``expire`` seconds: whole
    seconds, rounded up; past 30 days, the Unix time then (memcached reads a
    larger number of seconds as a Unix time, one in 1970 that expires the item
    at once). Absolute times are judged on the server's clock: a skew between
    client and server moves such an item's end by as much."""
    seconds = math.ceil(expire)
    if seconds > _RELATIVE_MOST:
        return int(time.time()) + seconds
    return seconds


#: Per server address: how far its clock, memcached's ``time``, is ahead of
#: this process's ``time.monotonic()``, at least (the best read of the
#: server's current run). Learnt from ``stats`` on every new connection.
_clocks: dict[Any, float] = {}
#: A read of the server's clock is used only when its round trip was this
#: short: the server read its clock somewhere within it, and every expiry
#: sent on it is this much later, so that the round trip never shortens one.
CLOCK_READ_MOST = 0.25
#: How long to wait before reading a suspect clock again (``clock_suspect``):
#: past the server's next tick.
CLOCK_RECHECK = 1.1
#: Reads of a run's clock tried before its locks are refused for want of one.
CLOCK_READS = 3


def clock_suspect(server_time: int) -> bool:
    """Whether the first read of a server's clock in a run (its ``stats``
    ``time``, a Unix time) may be one a stalled server gave before its clock
    caught up: more than two seconds behind this host's clock, which a running
    memcached's never is (its whole seconds, its once-a-second timer) where
    the hosts' clocks agree. Then it is read again after ``CLOCK_RECHECK``."""
    return server_time < time.time() - 2


def observe_clock(server: Any, server_time: int, sent: float, received: float) -> bool:
    """Learn the clock of ``server`` from its ``stats`` ``time``, read by a
    command sent at ``sent`` and answered at ``received`` (monotonic); False if
    the read took too long to tell (``CLOCK_READ_MOST``).

    memcached's ``time`` is whole seconds, set by a timer once a second, and
    never ahead of the server's own clock: ``server_time - received`` is a
    lower bound of the offset between the two clocks, give or take the round
    trip, and the highest such bound of a run the best one (a read lower than
    it, a stalled server's, changes nothing).

    An item sent to end at ``now + offset + n`` on that clock (``expiry_on``)
    then lives at least ``n - 2`` seconds from the send, as a relative expiry
    does on a server whose clock runs (the read lags the server's clock by up
    to two seconds, its whole seconds and its once-a-second timer; the
    round trip is made up by ``CLOCK_READ_MOST``), and at most about three
    seconds more than ``n`` (more as the two clocks drift apart, which the
    next run's reads reset): longer, never shorter, whatever the server's
    clock was doing when it stored the item."""
    if received - sent > CLOCK_READ_MOST:
        return False
    # (The round trip's slack folded in once, here, not on every send.)
    offset = server_time - received + CLOCK_READ_MOST
    if offset > _clocks.get(server, -math.inf):
        _clocks[server] = offset
    return True


def expiry_on(server: Any, expire: float) -> int:
    """What to send ``server`` for an item to live ``expire`` seconds from
    now: a Unix time on the server's own clock where that clock was read
    (``observe_clock``), so that an item stored by a server whose clock stood
    still (a stalled process, a frozen VM: commands it had queued are carried
    out before its clock catches up) lives longer, never shorter; else
    ``exptime``."""
    offset = _clocks.get(server)
    if offset is None:
        return exptime(expire)
    return math.ceil(time.monotonic() + offset + expire)


def sure_life(expire: float) -> float:
    """The shortest time memcached is sure to keep an item stored for
    ``expire`` seconds (``exptime``), counted from before the command was sent.

    memcached judges expiry by a clock of whole seconds that a timer sets once
    a second, re-armed after each firing. A late tick (a busy or paused
    server) moves the phase of that timer against the seconds it counts, and a
    phase that wraps past a second makes an item stored just before it go
    almost a second sooner: ``n - 2`` seconds for ``n``, not ``n - 1``
    (``tests/backends/memcached/test_memcached_clock.py`` measures it with the server paused at
    random). Where the server's clock was read (``expiry_on``), the item's
    end is a time on that clock, which a pause can only make later, and the
    read's own error stays within the same two seconds (``observe_clock``).
    """
    return float(max(math.ceil(expire) - 2, 0))


def _talk(server: Any, line: bytes, timeout: float) -> bytes:
    """Send ``line`` (with its CR LF) to ``server`` on a connection of its own; the reply's first
    line, or b"" if the other end closed the connection instead of answering."""
    host, port = server if isinstance(server, tuple) else (server, 11211)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(line)
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                return b""
            reply += chunk
        return reply


def meta_support(server: Any, timeout: float = 2.0) -> str:
    """How ``server`` (host, port) meets a meta command.

    ``"meta"``: it answers them (memcached 1.6+). ``"error"``: it answers
    ``ERROR`` (memcached before 1.6). ``"closed"``: it closes the connection but
    answers the classic ``version`` (a proxy such as twemproxy). Raises OSError
    when it does not answer at all.
    """
    reply = _talk(server, b"mn\r\n", timeout)
    if reply.startswith(b"MN"):
        return "meta"
    if reply == b"ERROR\r\n":
        return "error"
    if reply.startswith(b"ERROR"):
        # "ERROR Too many open connections": refused, not an answer to mn.
        raise ConnectionRefusedError(
            f"memcached at {_server_name(server)} refused the connection: "
            f"{reply.strip().decode(errors='replace')}"
        )
    if reply == b"" and _talk(server, b"version\r\n", timeout).startswith(b"VERSION"):
        return "closed"
    raise ConnectionError(f"memcached at {server} answered {reply!r} to mn")


class TimedSockets:
    """A ``socket_module`` for pymemcache whose sockets wait at most
    ``seconds`` for each send and reply, by the kernel's own timers
    (``SO_SNDTIMEO``, ``SO_RCVTIMEO``): the socket stays blocking, so a call
    costs no ``poll`` as a Python-level ``settimeout`` would, and one that
    times out raises ``BlockingIOError`` (an ``OSError``)."""

    def __init__(self, module: Any, seconds: float) -> None:
        self._module = module
        whole = int(seconds)
        self._interval = struct.pack("ll", whole, int((seconds - whole) * 1e6))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def socket(self, *args: Any, **kwargs: Any) -> Any:
        sock = self._module.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._interval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._interval)
        return sock


def closes_on_stats(server: Any, timeout: float) -> bool:
    """Whether ``server`` proves itself a proxy without ``stats`` (twemproxy):
    on connections of their own, it answers ``version`` and closes the
    connection on ``stats``. A server that closes every connection (stopping,
    or a port forwarder with nothing behind it) is not one; raises OSError
    when it does not answer in ``timeout`` seconds."""
    if not _talk(server, b"version\r\n", timeout).startswith(b"VERSION"):
        return False
    return _talk(server, b"stats\r\n", timeout) == b""


def _server_name(server: Any) -> str:
    return "{}:{}".format(*server) if isinstance(server, tuple) else str(server)


class MemcachedHold:
    """The CAS id of this holder's item, and the socket that wrote it."""

    __slots__ = ("cas", "sock")

    def __init__(self, cas: int, sock: Any) -> None:
        self.cas, self.sock = cas, sock

    def __repr__(self) -> str:
        return f"MemcachedHold(cas={self.cas})"


def _wire_key(client: Any, key: str) -> bytes:
    """The key as the client itself sends it, with its own key_prefix.

    ``key`` comes from ``key_for``, which already made sure memcached can take it
    (length with the prefix, no whitespace or control characters).
    """
    wire: bytes = client.key_prefix + key.encode("utf-8")
    return wire


class ServerRefused(MemcacheError):  # type: ignore[misc]
    """A server answered ``ERROR <reason>`` (its connection limit) and closed."""


def _refusal(client: Any, line: bytes) -> ServerRefused:
    """The error for a server that answered ``ERROR <reason>`` and closed."""
    return ServerRefused(
        f"memcached at {_server_name(client.server)} refused the connection: "
        f"{line.strip().decode(errors='replace')} (over its connection limit, -c?). "
        "Raise its -c or use fewer connections; try again"
    )


def _read_stats(client: Any) -> dict[bytes, bytes]:
    """``stats`` on the client's own connection, read whole.

    pymemcache's ``stats()`` reports every ``ERROR`` line alike; here a bare
    ``ERROR`` (a server or proxy without ``stats``) raises
    MemcacheUnknownCommandError, and ``ERROR <reason>`` (a refusal, such as
    memcached's connection limit) the refusal itself.
    """
    if client.sock is None:
        memcached_connect(client)
    sock: Any = client.sock
    buffer = b""
    try:
        sock.sendall(b"stats\r\n")
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise MemcacheUnexpectedCloseError()
            buffer += chunk
            if buffer.endswith(b"END\r\n") or (
                b"\r\n" in buffer and not buffer.startswith(b"STAT ")
            ):
                break
    except BaseException:
        client.close()
        raise
    first = buffer[: buffer.find(b"\r\n")]
    if first.startswith(b"ERROR"):
        client.close()
        if first == b"ERROR":
            raise MemcacheUnknownCommandError(b"stats")
        raise _refusal(client, first)
    if not first.startswith(b"STAT "):
        client.close()
        raise MemcacheClientError(first)
    stats: dict[bytes, bytes] = {}
    for line in buffer.split(b"\r\n"):
        parts = line.split(b" ", 2)
        if len(parts) == 3 and parts[0] == b"STAT":
            stats[parts[1]] = parts[2]
    return stats


def only_client(hash_client: Any) -> Any:
    """The one client every key goes to, if there is one (a HashClient of ours
    never gains or loses servers): one server, even while HashClient has marked
    it dead after errors of other cache calls, since there is nowhere else to go
    and talking to it directly means locking resumes the moment it is back."""
    if not isinstance(hash_client, HashClient):
        return hash_client
    if len(hash_client.clients) == 1:
        return next(iter(hash_client.clients.values()))
    return None


class Wire:
    """One alias's memcached protocol: meta commands or classic ones, per server."""

    def __init__(self, protocol: str) -> None:
        #: "auto", "meta" or "classic", fixed when the backend is built.
        self.protocol = protocol
        #: Whether this alias sends classic commands only ("classic").
        self.classic = protocol == "classic"
        #: The servers found without meta commands (every alias's: a server
        #: of several aliases is probed once).
        self.without_meta = _classic_servers

    # -- protocol choice -----------------------------------------------------------

    def meta(self, client: Any) -> bool:
        if self.protocol == "classic":
            return False
        return self.protocol == "meta" or client.server not in _classic_servers

    def _no_meta(self, client: Any, how: str) -> None:
        if self.protocol == "classic":
            return  # only ttl() tries meta here, and says so itself
        name = _server_name(client.server)
        if how == "closed":
            what = (
                f"{name} closed the connection on a meta command but answers "
                "classic ones: a proxy such as twemproxy (nutcracker), which "
                "speaks only the classic protocol"
            )
        else:
            what = f"memcached at {name} has no meta commands (needs 1.6+)"
        if self.protocol == "meta":
            raise MemcacheError(
                f"{what}; set TASKLOCK['MEMCACHED_PROTOCOL'] to 'classic' (or 'auto')"
            )
        if client.server not in _classic_servers:
            _classic_servers.add(client.server)
            logger.warning(
                "%s. Locks on it use the classic commands (add, gets, cas): owner-"
                "checked as before, one more round trip per release. Set "
                "TASKLOCK['MEMCACHED_PROTOCOL'] = 'classic' to skip this probe.",
                what[0].upper() + what[1:],
            )

    def command(self, client: Any, command: bytes) -> bytes | None:
        """Send one meta command (``meta``) and read its reply (see
        ``exchange``)."""
        replies = self.exchange(client, command, 1)
        if replies is None:
            return None
        if replies[0].startswith(b"CLIENT_ERROR"):
            raise MemcacheError(replies[0].decode(errors="replace"))
        return replies[0]

    def exchange(self, client: Any, commands: bytes, count: int) -> list[bytes] | None:
        """Send ``count`` pipelined meta commands and read their replies.

        One round trip for all of them; each reply whole (``meta.split``).
        None if the server does not know meta
        commands. On the client's own socket (pymemcache's raw_command costs more
        than the lock's own work, and reads one line only); a PooledClient lends
        one of its clients. Any error closes the connection, as pymemcache does;
        a ``CLIENT_ERROR`` reply (a bad value, the connection still in step) is
        returned for the caller to judge.
        """
        pool = getattr(client, "client_pool", None)
        if pool is not None:
            with pool.get_and_release(destroy_on_fail=True) as pooled:
                return self.exchange(pooled, commands, count)
        sock: Any = client.sock
        fresh = sock is None
        if fresh:
            memcached_connect(client)
            sock = client.sock
        try:
            sock.sendall(commands)
            buffer = sock.recv(4096)
        except BaseException as exc:
            self._broken(client, fresh, exc)
            return None
        return self._replies(client, sock, buffer, count, fresh)

    def _replies(
        self, client: Any, sock: Any, buffer: bytes, count: int, fresh: bool
    ) -> list[bytes] | None:
        """The ``count`` replies that start with ``buffer``, read to their end
        from ``sock`` (see ``exchange``)."""
        try:
            while True:
                replies = meta.split(buffer, count)
                if replies is not None:
                    break
                chunk = sock.recv(4096)
                if not chunk:
                    raise MemcacheUnexpectedCloseError()
                buffer += chunk
        except BaseException as exc:
            self._broken(client, fresh, exc)
            return None
        if b"ERROR" not in buffer:  # no reply of ours carries text of its own
            return replies
        if replies[0].startswith(b"ERROR"):
            # An old server also answers the rest (a data line, the other
            # commands) with ERROR, which must not be read as the next reply.
            client.close()
            if replies[0] != b"ERROR\r\n":
                # "ERROR <reason>": a refusal (over its connection limit), which
                # says nothing about the commands it knows; it stays transient.
                raise _refusal(client, replies[0])
            self._no_meta(client, "error")
            return None
        for reply in replies:
            if reply.startswith((b"ERROR", b"SERVER_ERROR")):
                client.close()
                raise MemcacheError(reply.strip().decode(errors="replace"))
        return replies

    def one_reply(self, client: Any, sock: Any, buffer: bytes) -> bytes | None:
        """``command``'s reading half, for a command already sent on ``sock``
        whose reply starts with ``buffer``."""
        replies = self._replies(client, sock, buffer, 1, False)
        if replies is None:
            return None
        if replies[0].startswith(b"CLIENT_ERROR"):
            raise MemcacheError(replies[0].decode(errors="replace"))
        return replies[0]

    @staticmethod
    def round_trip(client: Any, sock: Any, command: bytes) -> bytes | None:
        """Send ``command`` on ``sock``, a connection from before, and read
        what the server has answered so far (the hot path's one read); None if
        the connection had dropped, which is then closed. Any other error
        closes it too, and is raised."""
        try:
            sock.sendall(command)
            reply: bytes = sock.recv(4096)
            if not reply:
                raise MemcacheUnexpectedCloseError()
        except _DROPPED:
            client.close()
            return None
        except BaseException:
            client.close()
            raise
        return reply

    def _broken(self, client: Any, fresh: bool, exc: BaseException) -> None:
        """After ``exc`` on the connection: close it, as pymemcache does, and
        raise ``exc``; None if it shows the server refuses meta commands."""
        client.close()
        # A fresh connection closed at the first meta command: a proxy that
        # speaks only the classic protocol does that instead of ERROR.
        if isinstance(exc, _DROPPED) and fresh and self._closes_on_meta(client):
            return None
        raise exc

    def _closes_on_meta(self, client: Any) -> bool:
        """After a closed connection: whether the server refuses meta commands."""
        try:
            how = meta_support(client.server, timeout=client.timeout or 2.0)
        except OSError:
            return False  # it does not answer at all: an outage, raised as such
        if how == "meta":
            return False
        self._no_meta(client, how)
        return True

    def hold(
        self, client: Any, cas: int | bytes | str | None, proven: bool = True
    ) -> MemcachedHold:
        """The hold on the item at CAS id ``cas``, read on ``client``'s own
        connection (``proven``: where that connection alone proves it later)."""
        cas_id = int(cas or 0)
        if cas_id == 0:
            raise meta.no_cas(_server_name(client.server))
        # PooledClient hides its sockets, and a classic-protocol proxy may have
        # reconnected to a restarted server behind the same socket: those holds
        # are always verified by value.
        sock = getattr(client, "sock", None) if proven else None
        return MemcachedHold(cas_id, sock)

    def read_item(self, client: Any, key: str) -> tuple[object, int] | None:
        """The item's value and CAS id (``meta.while_ours``'s read), None if
        it is gone: pymemcache's ``gets``, on either protocol."""
        value, cas = client.gets(key)
        return None if cas is None else (value, int(cas))

    def while_ours(
        self,
        client: Any,
        key: str,
        hold: MemcachedHold,
        token: object,
        write: Callable[[int], _T | None],
    ) -> _T | None:
        """``write(cas)`` at the CAS id of the holder's item, while the item is
        still the holder's (``meta.while_ours``): on the connection that took
        it, the CAS id it learnt; elsewhere, read first."""
        tries = meta.MOVES_IN_A_ROW
        if hold.sock is not None and getattr(client, "sock", None) is hold.sock:
            # One write, no steps to run (their generator is 6 % of a rate
            # limit's admission on memcached, make bench-cpu).
            done = write(hold.cas)
            if meta.settled(hold, token, done):
                return done
            tries -= 1
        steps = meta.while_ours(key, hold, token, tries)
        found: _T | None = meta.drive(steps, lambda: self.read_item(client, key), write)
        return found

    def once_more(self, client: Any, operation: Callable[[], _T]) -> _T:
        """Run ``operation``, again once if a connection from before had dropped.

        A restarted (or idle-timed-out) server leaves pymemcache a dead socket
        that fails the next command; pymemcache then reconnects. A fresh
        connection that fails is an outage, and is raised.
        """
        reused = getattr(client, "sock", None) is not None
        try:
            return operation()
        except _DROPPED:
            if not reused:
                raise
            return operation()

    def added(self, client: Any, wire: bytes, reply: bytes) -> MemcachedHold | None:
        """The hold an add-mode ``ms`` answered with ``reply`` gives; None if the
        key was taken. An item stored with no CAS id is removed again."""
        cas = meta.taken(reply)
        if cas == 0:
            self.command(client, meta.delete(wire))
        return None if cas is None else self.hold(client, cas)
