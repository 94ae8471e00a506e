"""Owner-checked locks on memcached, through the client of Django's PyMemcacheCache.

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

import logging
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import (
    MemcacheClientError,
    MemcacheError,
    MemcacheUnexpectedCloseError,
    MemcacheUnknownCommandError,
)

from ..conf import MAX_EXPIRE
from ..conf import settings as tasklock_settings
from ..keys import memcached_key
from .base import FenceCounter, Hold, LockBackend, Peek

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.core.cache.backends.memcached import PyMemcacheCache

__all__ = ["MemcachedBackend", "MemcachedHold"]

# pymemcache's serde marks str values with flag 16 (FLAG_TEXT): storing the token
# with it lets cache.get(lock_id) read the owner back as a str.
_TEXT_FLAG = 16
_T = TypeVar("_T")
# What a server that went away since the last command looks like on its socket.
_DROPPED = (MemcacheUnexpectedCloseError, BrokenPipeError, ConnectionResetError)
# What _learnt holds for a client whose connection's server run was never read.
_UNLEARNT: Any = object()
# Servers that refused a meta command; they get the classic commands.
_classic_servers: set[Any] = set()
# An absolute expiry (memcached reads any above 30 days as a Unix time) long past:
# the written item expires at once. Unlike -1, proxies pass it on.
_PAST = 2592001

logger = logging.getLogger(__name__)


class NodeRestarted(MemcacheError):  # type: ignore[misc]
    """New locks refused on a memcached server that restarted recently."""


# Restart detection (see MemcachedBackend._learn). Per server: the run of it last
# seen, as (pid, start time on the server's clock); servers whose stats cannot be
# read (a proxy); and, for servers seen to restart, when that run started (on
# time.monotonic()), new locks on them refused until RESTART_GRACE has passed.
_runs: dict[Any, tuple[int, int]] = {}
_unlearnable: set[Any] = set()
_refused: dict[Any, float] = {}
_runs_mutex = threading.Lock()
#: Two sightings of one run may put its start a second apart (whole-second clock).
_START_SLACK = 2
#: memcached reports an uptime up to this many seconds longer than it has run.
_UPTIME_AHEAD = 3


def _record_key(server: Any) -> str:
    return "tasklock-run-" + _server_name(server).replace(":", "-")


def _same_run(seen: tuple[int, int], now: tuple[int, int]) -> bool:
    return seen[0] == now[0] and abs(seen[1] - now[1]) <= _START_SLACK


def _talk(server: Any, line: bytes, timeout: float) -> bytes:
    """Send one line to ``server`` on a connection of its own; the reply's first
    line, or b"" if the other end closed the connection instead of answering."""
    host, port = server if isinstance(server, tuple) else (server, 11211)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(line + b"\r\n")
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
    reply = _talk(server, b"mn", timeout)
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
    if reply == b"" and _talk(server, b"version", timeout).startswith(b"VERSION"):
        return "closed"
    raise ConnectionError(f"memcached at {server} answered {reply!r} to mn")


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


def _split_replies(buffer: bytes, count: int) -> list[bytes] | None:
    """The first ``count`` replies in ``buffer``, or None if more must be read."""
    if (
        count == 1
        and buffer.endswith(b"\r\n")
        and buffer.find(b"\r\n") == len(buffer) - 2
    ):
        return [buffer[:-2]]  # the common case: one reply line, read whole
    replies: list[bytes] = []
    start = 0
    while len(replies) < count:
        end = buffer.find(b"\r\n", start)
        if end < 0:
            return None
        line = buffer[start:end]
        start = end + 2
        if line.startswith(b"VA "):
            # The value is as long as the header says: it may hold CR LF itself.
            size = _value_size(line)
            end = start + size
            if len(buffer) < end + 2:
                return None
            line += b" " + buffer[start:end]
            start = end + 2
        replies.append(line)
        if line.startswith(b"ERROR"):
            break
    return replies


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
        client._connect()
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


def _value_size(header: bytes) -> int:
    """The data length a ``VA <size> <flags>*`` reply header states."""
    parts = header.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise MemcacheError(f"unexpected reply header from memcached: {header!r}")
    return int(parts[1])


def _bad_counter(fence: FenceCounter, reply: bytes) -> MemcacheError:
    return MemcacheError(
        f"the fencing counter {fence.key!r} holds something that is not a number "
        f"({reply.decode(errors='replace')}); some other code wrote to that key. "
        "Delete it (it restarts from the clock) and stop writing to it; no fence "
        "was drawn, and the lock is still held"
    )


def _flag(reply: bytes, name: bytes) -> int | None:
    for flag in reply.split()[1:]:
        if flag[:1] == name:
            return int(flag[1:])
    return None


def _ttl_of(reply: bytes) -> float | None:
    """The seconds left that an ``mg <key> t`` reply gives; None if no item."""
    if not reply.startswith(b"HD"):
        return None
    seconds = _flag(reply, b"t")
    return float("inf") if seconds is None or seconds < 0 else float(seconds)


class MemcachedBackend(LockBackend):
    """Locks on the memcached servers of a PyMemcacheCache alias."""

    kind = "memcached"
    errors = (OSError, MemcacheError)
    cache: PyMemcacheCache

    def __init__(
        self, cache: PyMemcacheCache, alias: str, protocol: str = "auto"
    ) -> None:
        super().__init__(cache, alias)
        self.protocol = protocol
        # A client of our own, built exactly as Django builds its one (same
        # servers, options and hashing, so the same server for a key), which
        # close_caches() leaves alone: Celery's Django fixup closes every cache
        # connection after every task, and reconnecting would cost each locked
        # task more than the lock.
        django_cache = cast(Any, cache)
        self._hash_client: Any = django_cache._class(
            django_cache.client_servers, **django_cache._options
        )
        # Per server client, the connection whose server run was learnt.
        self._learnt: dict[Any, Any] = {}
        # The one client every key goes to, if there is one (this backend's own
        # HashClient never gains or loses servers): one server, even while
        # HashClient has marked it dead after errors of other cache calls,
        # since there is nowhere else to go and talking to it directly means
        # locking resumes the moment it is back.
        hash_client = self._hash_client
        self._only_client: Any = None
        if not isinstance(hash_client, HashClient):
            self._only_client = hash_client
        elif len(hash_client.clients) == 1:
            self._only_client = next(iter(hash_client.clients.values()))

    def close(self) -> None:
        self._hash_client.close()

    def _client(self, key: str) -> Any:
        """The server Django's own ``cache.add(key)`` talks to."""
        if self._only_client is not None:
            return self._only_client
        client = self._hash_client._get_client(key)
        if client is None:  # HashClient with ignore_exc=True and every server dead
            raise MemcacheError("All memcached servers are marked dead")
        return client

    def describe(self, key: str) -> str:
        try:
            server = _server_name(self._client(key).server)
        except self.errors:
            server = "(no live server)"
        return f"memcached cache {self.alias!r} at {server}"

    def shortest_life(self, expire: float) -> float:
        # memcached stores whole seconds on a clock that ticks once a second, so
        # an item stored with T<n> just before a tick goes after n - 1 seconds.
        return float(math.ceil(expire) - 1)

    def key_for(self, lock_id: str) -> str:
        reserved = len(getattr(self._hash_client, "key_prefix", b"") or b"")
        return memcached_key(self.cache, lock_id, reserved=reserved)

    # -- protocol choice -----------------------------------------------------------

    def _meta(self, client: Any) -> bool:
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

    def _command(self, client: Any, command: bytes) -> bytes | None:
        """Send one meta command and read its one-line reply (see ``_exchange``)."""
        replies = self._exchange(client, command, 1)
        if replies is None:
            return None
        if replies[0].startswith(b"CLIENT_ERROR"):
            raise MemcacheError(replies[0].decode(errors="replace"))
        return replies[0]

    def _exchange(self, client: Any, commands: bytes, count: int) -> list[bytes] | None:
        """Send ``count`` pipelined meta commands and read their replies.

        One round trip for all of them. A ``VA`` reply comes back as its header
        and value joined by a space. None if the server does not know meta
        commands. On the client's own socket (pymemcache's raw_command costs more
        than the lock's own work, and reads one line only); a PooledClient lends
        one of its clients. Any error closes the connection, as pymemcache does;
        a ``CLIENT_ERROR`` reply (a bad value, the connection still in step) is
        returned for the caller to judge.
        """
        pool = getattr(client, "client_pool", None)
        if pool is not None:
            with pool.get_and_release(destroy_on_fail=True) as pooled:
                return self._exchange(pooled, commands, count)
        sock: Any = client.sock
        fresh = sock is None
        if fresh:
            client._connect()
            sock = client.sock
        try:
            sock.sendall(commands + b"\r\n")
            buffer = sock.recv(4096)
        except BaseException as exc:
            self._broken(client, fresh, exc)
            return None
        return self._replies(client, sock, buffer, count, fresh)

    def _replies(
        self, client: Any, sock: Any, buffer: bytes, count: int, fresh: bool
    ) -> list[bytes] | None:
        """The ``count`` replies that start with ``buffer``, read to their end
        from ``sock`` (see ``_exchange``)."""
        try:
            while True:
                replies = _split_replies(buffer, count)
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
            if replies[0] != b"ERROR":
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

    def _one_reply(self, client: Any, sock: Any, buffer: bytes) -> bytes | None:
        """``_command``'s reading half, for a command already sent on ``sock``
        whose reply starts with ``buffer``."""
        replies = self._replies(client, sock, buffer, 1, False)
        if replies is None:
            return None
        if replies[0].startswith(b"CLIENT_ERROR"):
            raise MemcacheError(replies[0].decode(errors="replace"))
        return replies[0]

    @staticmethod
    def _round_trip(client: Any, sock: Any, command: bytes) -> bytes | None:
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

    def _hold(self, client: Any, cas: object, meta: bool = True) -> MemcachedHold:
        cas_id = int(cast(Any, cas))
        if cas_id == 0:
            raise MemcacheError(
                f"memcached at {client.server} runs without CAS ids (-C), so a "
                "lock cannot be owner-checked; restart it without -C"
            )
        # PooledClient hides its sockets, and a classic-protocol proxy may have
        # reconnected to a restarted server behind the same socket: those holds
        # are always verified by value.
        sock = getattr(client, "sock", None) if meta else None
        return MemcachedHold(cas_id, sock)

    def _owner_cas(
        self, client: Any, key: str, hold: MemcachedHold, token: object
    ) -> int | None:
        """The CAS id to act on if this holder still owns the lock, else None.

        On the connection that took the lock, the CAS id it learnt is proof
        enough. Elsewhere the stored token decides (tokens are random per
        acquisition, nobody else writes ours), and the CAS id read with it makes
        the following write conditional on nothing having changed since.
        """
        if hold.sock is not None and getattr(client, "sock", None) is hold.sock:
            return hold.cas
        # Both must match: the value tells a restarted server's new item (CAS ids
        # start again from 1) from ours, the CAS id tells our item from a later one
        # with the same value (other code may store one value every time).
        value, cas = client.gets(key)
        if value == token and cas is not None and int(cas) == hold.cas:
            return hold.cas
        return None

    def _once_more(self, client: Any, operation: Callable[[], _T]) -> _T:
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

    # -- acquire -----------------------------------------------------------------

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        client = self._client(key)
        ttl = math.ceil(expire)
        sock: Any = getattr(client, "sock", None)
        if (
            sock is not None
            and sock is self._learnt.get(client, _UNLEARNT)
            and not _refused
            and self._meta(client)
        ):
            # The common case: a connection whose server run is known, in one
            # send and one read. Anything unusual goes the long way below.
            data = token.encode()
            wire = client.key_prefix + key.encode()
            command = b"ms %s %d T%d F16 ME c\r\n%s\r\n" % (wire, len(data), ttl, data)
            reply = self._round_trip(client, sock, command)
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
            line = self._one_reply(client, sock, reply)
            if line is not None:
                return self._added(client, wire, line)
        return self._acquire_tries(client, key, token, ttl, 0)

    def _acquire_tries(
        self, client: Any, key: str, token: str, ttl: int, tries: int
    ) -> MemcachedHold | None:
        """The acquire, learning the server's run on a new connection, and tried
        once more if a connection from before had dropped; ``tries``: how many
        were already sent."""

        def attempt() -> MemcachedHold | None:
            nonlocal tries
            tries += 1
            sock = getattr(client, "sock", False)
            if sock is not False and (
                sock is None or self._learnt.get(client) is not sock
            ):
                # A new connection: learn which run of the server answers it.
                self._learn(client)
                self._learnt[client] = client.sock
            if _refused:
                self._refuse_if_restarted(client)
            hold = self._acquire(client, key, token, ttl)
            if hold is None and tries > 1:
                # The dropped first try may have stored our token before the
                # connection went: then the lock is ours.
                value, cas = client.gets(key)
                if value == token:
                    return self._hold(client, cas, meta=False)
            return hold

        if tries:
            return attempt()
        return self._once_more(client, attempt)

    def _acquire(
        self, client: Any, key: str, token: str, ttl: int
    ) -> MemcachedHold | None:
        if self._meta(client):
            data = token.encode()
            wire = _wire_key(client, key)
            # Add mode: stored only if absent, answering the new item's CAS id.
            command = b"ms %s %d T%d F%d ME c\r\n%s" % (
                wire, len(data), ttl, _TEXT_FLAG, data,
            )  # fmt: skip
            reply = self._command(client, command)
            if reply is not None:
                return self._added(client, wire, reply)
        if not client.add(key, token, expire=ttl, noreply=False):
            return None
        value, cas = client.gets(key)
        # Someone else's value here means our item expired in between: not ours.
        if value != token:
            return None
        return self._hold(client, cas, meta=False)

    def _added(self, client: Any, wire: bytes, reply: bytes) -> MemcachedHold | None:
        """The hold an add-mode ``ms`` answered with ``reply`` gives; None if the
        key was taken."""
        if reply.startswith(b"NS"):
            return None
        if not reply.startswith(b"HD"):
            raise MemcacheError(f"unexpected reply to ms: {reply!r}")
        cas = _flag(reply, b"c")
        if not cas:
            self._command(client, b"md %s" % wire)
        return self._hold(client, cas)

    # -- fencing tokens ------------------------------------------------------------

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        # The counter lives on the lock's own server, whichever server its key
        # would hash to: one round trip draws the token and checks the lock.
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        return self._once_more(
            client, lambda: self._draw(client, key, hold, token, fence)
        )

    def _draw(
        self,
        client: Any,
        key: str,
        hold: MemcachedHold,
        token: str,
        fence: FenceCounter,
    ) -> int | None:
        if self._meta(client):
            # Draw from the counter (made at the floor if missing), then read the
            # lock back: if it still holds our token under our CAS id, the lock
            # was ours when the token was drawn, so any later holder draws after
            # us and gets a larger one.
            data = token.encode()
            commands = b"ma %s N%d J%d T%d v\r\nmg %s c v" % (
                _wire_key(client, fence.key), fence.ttl, fence.floor, fence.ttl,
                _wire_key(client, key),
            )  # fmt: skip
            replies = self._exchange(client, commands, 2)
            if replies is not None:
                drawn, check = replies
                if not drawn.startswith(b"VA "):
                    raise _bad_counter(fence, drawn)
                if not (check.startswith(b"VA ") and check.endswith(b" " + data)):
                    return None
                if _flag(check[: -len(data) - 1], b"c") != hold.cas:
                    return None
                return int(drawn.rsplit(b" ", 1)[1])
        try:
            number = client.incr(fence.key, 1, noreply=False)
            if number is None:
                if client.add(
                    fence.key, str(fence.floor), expire=fence.ttl, noreply=False
                ):
                    number = fence.floor
                else:  # made by another holder in between
                    number = client.incr(fence.key, 1, noreply=False)
        except MemcacheClientError as exc:
            raise _bad_counter(fence, str(exc).encode()) from exc
        value, cas = client.gets(key)
        if value != token or cas is None or int(cas) != hold.cas or number is None:
            return None
        return int(number)

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
            reply = self._round_trip(client, sock, b"md %s C%d\r\n" % (wire, hold.cas))
            if reply is None:
                # A new connection checks the stored token first.
                return self._release(client, key, hold, token)
            if reply == b"HD\r\n":
                return True
            if reply == b"EX\r\n" or reply == b"NF\r\n":
                return False
            line = self._one_reply(client, sock, reply)
            if line is not None:
                return self._deleted(line)
        return self._once_more(client, lambda: self._release(client, key, hold, token))

    def _release(
        self, client: Any, key: str, hold: MemcachedHold, token: object
    ) -> bool:
        cas = self._owner_cas(client, key, hold, token)
        if cas is None:
            return False
        return self._delete(client, key, token, cas)

    def _delete(self, client: Any, key: str, token: object, cas: int) -> bool:
        """Delete the item at ``key`` only while its CAS id is ``cas``."""
        if self._meta(client):
            reply = self._command(client, b"md %s C%d" % (_wire_key(client, key), cas))
            if reply is not None:
                return self._deleted(reply)
        # cas() answers True (STORED), False (EXISTS: another owner's) or None
        # (NOT_FOUND); an expiry in the past makes the stored item expire at once.
        return bool(client.cas(key, token, cas, expire=_PAST, noreply=False))

    @staticmethod
    def _deleted(reply: bytes) -> bool:
        """Whether an ``md <key> C<cas>`` that answered ``reply`` deleted it."""
        if reply.startswith(b"HD"):
            return True
        if reply.startswith((b"EX", b"NF")):
            return False
        raise MemcacheError(f"unexpected reply to md: {reply!r}")

    def discard(self, key: str, token: str) -> bool:
        client = self._client(key)

        def attempt() -> bool:
            value, cas = client.gets(key)
            if value != token or cas is None:
                return False
            return self._delete(client, key, token, int(cas))

        return self._once_more(client, attempt)

    def lost_with_store(self, exc: BaseException) -> bool:
        # Nothing listens: the memcached process is gone, and with it every item
        # it held (it keeps nothing on disk). A refused restarted server was sent
        # nothing, and one over its connection limit refused it unread.
        return isinstance(exc, (ConnectionRefusedError, NodeRestarted, ServerRefused))

    # -- restarts ------------------------------------------------------------------

    def _learn(self, client: Any) -> None:
        """Read which run of the server this new connection reaches, and refuse
        new locks on it for RESTART_GRACE seconds if it restarted.

        A restarted memcached comes back empty: the locks it held are gone while
        their holders may still run, and handing the same ids out again would
        run their work twice. A restart is known when this process saw another
        run of the server before, or when another server of the pool keeps a
        record of another run (each process that learns a server's run records
        it on the pool's other servers). A server first seen with no record is a
        new deployment, not a restart. Proxies do not pass ``stats`` on; servers
        behind them are not checked.
        """
        server = client.server
        if server in _unlearnable:
            return
        try:
            stats = _read_stats(client)
            run = (int(stats[b"pid"]), int(stats[b"time"]) - int(stats[b"uptime"]))
            server_now = int(stats[b"time"])
        except MemcacheUnexpectedCloseError:
            client.close()
            _unlearnable.add(server)  # twemproxy closes the connection on stats
            return
        except (KeyError, ValueError, MemcacheClientError):
            # No stats here, for good (MemcacheUnknownCommandError is one).
            _unlearnable.add(server)
            return
        except ServerRefused:
            raise  # over its connection limit: this lock fails, nothing else
        except self.errors:
            return  # down: the lock's own command reports it
        with _runs_mutex:
            seen = _runs.get(server)
            _runs[server] = run
        if seen is None:
            seen = self._recorded_run(server)
        if seen is not None and not _same_run(seen, run):
            grace = tasklock_settings.RESTART_GRACE
            # When it started, on this process's monotonic clock, late rather
            # than early: memcached's uptime runs up to 2 s ahead, in whole
            # seconds.
            uptime = server_now - run[1]
            started = time.monotonic() - max(uptime - _UPTIME_AHEAD, 0)
            _refused[server] = started
            left = started + grace - time.monotonic()
            if left > 0:
                logger.warning(
                    "memcached at %s restarted about %ds ago (pid %d, was %d) and "
                    "came back empty: locks it held are gone while their holders "
                    "may still run. New locks on it are refused for %.0fs more "
                    "(TASKLOCK['RESTART_GRACE'] = %ss).",
                    _server_name(server), uptime, run[0], seen[0], left, grace,
                )  # fmt: skip
        if seen is None or not _same_run(seen, run):
            self._record_run(server, run)

    def _others(self, server: Any) -> list[Any]:
        hash_client = self._hash_client
        if not isinstance(hash_client, HashClient):
            return []
        return [c for c in hash_client.clients.values() if c.server != server]

    def _recorded_run(self, server: Any) -> tuple[int, int] | None:
        for other in self._others(server):
            try:
                value = other.get(_record_key(server))
            except self.errors:
                continue
            if value is not None:
                pid, _, start = str(value).partition(":")
                return int(pid), int(start)
        return None

    def _record_run(self, server: Any, run: tuple[int, int]) -> None:
        for other in self._others(server):
            try:
                other.set(_record_key(server), f"{run[0]}:{run[1]}", MAX_EXPIRE)
            except self.errors:
                continue

    def _refuse_if_restarted(self, client: Any) -> None:
        started = _refused.get(client.server)
        if started is None:
            return
        left = started + tasklock_settings.RESTART_GRACE - time.monotonic()
        if left <= 0:
            _refused.pop(client.server, None)
            return
        raise NodeRestarted(
            f"memcached at {_server_name(client.server)} restarted and came back "
            "empty: locks it held are gone while their holders may still run, so "
            f"new locks on it are refused for {math.ceil(left)}s more "
            "(TASKLOCK['RESTART_GRACE'], by default LOCK_EXPIRE; set it to the "
            "longest expiry your locks use)"
        )

    # -- extend ------------------------------------------------------------------

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        return self.replace(key, hold, token, token, expire)

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        assert isinstance(hold, MemcachedHold)
        client = self._client(key)
        ttl = math.ceil(expire)
        tries = 0

        def attempt() -> MemcachedHold | None:
            nonlocal tries
            tries += 1
            done = self._rewrite(client, key, hold, old, new, ttl)
            if done is None and tries > 1:
                # The first try may have been carried out before its reply was
                # lost: the store then holds ``new`` (a token, or a call's
                # mark: unique to this holder) under a CAS id of its own.
                value, cas = client.gets(key)
                if value == new and cas is not None:
                    return self._hold(client, cas, meta=False)
            return done

        return self._once_more(client, attempt)

    def _rewrite(
        self,
        client: Any,
        key: str,
        hold: MemcachedHold,
        old: object,
        new: str,
        ttl: int,
    ) -> MemcachedHold | None:
        cas = self._owner_cas(client, key, hold, old)
        if cas is None:
            return None
        if self._meta(client):
            data = new.encode()
            command = b"ms %s %d C%d T%d F%d c\r\n%s" % (
                _wire_key(client, key), len(data), cas, ttl, _TEXT_FLAG, data,
            )  # fmt: skip
            reply = self._command(client, command)
            if reply is not None:
                if reply.startswith(b"HD"):
                    return self._hold(client, _flag(reply, b"c"))
                if reply.startswith((b"EX", b"NF")):
                    return None
                raise MemcacheError(f"unexpected reply to ms: {reply!r}")
        if not client.cas(key, new, cas, expire=ttl, noreply=False):
            return None
        value, new_cas = client.gets(key)
        return self._hold(client, new_cas, meta=False) if value == new else None

    # -- inspection ----------------------------------------------------------------

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        value, _cas = self._client(key).gets(key)
        return bool(value == token)

    def locked(self, key: str) -> bool:
        return self._client(key).get(key) is not None

    def held_many(self, keys: list[str]) -> list[bool]:
        # One round trip per server, straight to it: HashClient's own get_many
        # would mark a failing server dead and send its keys elsewhere.
        by_client: dict[Any, list[str]] = {}
        for key in keys:
            by_client.setdefault(self._client(key), []).append(key)
        found: dict[str, object] = {}
        for client, its_keys in by_client.items():
            found.update(client.get_many(its_keys))
        return [key in found for key in keys]

    def ttl(self, key: str) -> float | None:
        # Only the meta protocol can read an item's remaining time, so this is
        # tried whatever MEMCACHED_PROTOCOL says.
        client = self._client(key)
        reply = self._command(client, b"mg %s t" % _wire_key(client, key))
        if reply is None:
            raise MemcacheError(
                "reading a lock's remaining time needs memcached's meta commands "
                "(memcached 1.6+)"
            )
        return _ttl_of(reply)

    def peek(self, key: str) -> Peek | None:
        client = self._client(key)
        value, cas = client.gets(key)
        if cas is None:
            return None
        # The CAS id was read on this connection: while it stays the one in
        # use, it proves the item unchanged (see _owner_cas), so a replace
        # through this hold is one round trip. Classic-protocol servers, maybe
        # behind a proxy, always check the value first.
        sock = getattr(client, "sock", None) if self._meta(client) else None
        return Peek(value, MemcachedHold(int(cas), sock))

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self._client(key).get(fence_key)
        return None if value is None else int(value)
