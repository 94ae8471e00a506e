"""A lock's waiting line on memcached (``KeepsLines``), which cannot notify
another process: a ticket line beside the lock, on the lock's own server.

memcached has no lists and no scripts, so the line is two counters and a mark
per waiter, kept on the server that holds the lock (whatever their keys'
hashes say): ``tail``, the tickets handed out (``incr``), and ``head``, the
first ticket not yet served. A waiter draws a ticket when it joins; it may
take the lock once ``head`` has reached its ticket (or once no ticket before
it is still out: a line flushed or restarted). A waiter that took the lock
moves ``head`` past its ticket (compare-and-set, never backwards). Each
waiter renews a mark while it waits; a waiter whose mark expired (it died) is
passed over by the next one that looks.

What this gives, and what it costs, beside Redis's line:

- **Order**: the waiters of a blocking acquire take the lock in the order they
  came, and a holder that takes it again at once joins the end (a blocking
  acquire starts in line: its first look costs a round trip before the take);
  a non-blocking acquire that finds the lock free takes it out of turn (it
  cannot be refused atomically), which delays the waiter whose turn it was by
  one hold, never more, since it does not wait.
- **Wake-up**: nothing crosses processes, so a waiter polls, cheaply: the
  waiter whose turn it is every ``TURN_POLL`` (one take), the others read
  the line less often the further back they are. A release in this
  process wakes this process's waiters at once (``wake_here``).
- **A lost line** (a flush, a restart, an eviction) costs order, never a
  hang nor safety: the line decides only who may try a free lock; the lock's
  own item decides who holds it.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import TYPE_CHECKING, Any, Final

from ..capabilities import done_here, expect_here, wait_here, wake_here

if TYPE_CHECKING:
    from ..base import Hold
    from .reads import MemcachedReads

__all__ = ["COUNTERS_TTL", "TURN_POLL", "MemcachedLines"]

#: How often the waiter whose turn it is tries the lock, and the next one
#: reads the line (the others wait this times their place, up to
#: ``locks.line.LONGEST``): half of it is what a handoff across processes
#: costs on average.
TURN_POLL: Final = 0.005
#: Seconds the line's counters last after they were made: an idle line's
#: leftovers go, a line in use is never that old.
COUNTERS_TTL: Final = 86400
#: Keys longer than this get a digest of the lock key as their stem (with the
#: parts added, a memcached key stays under its 250 bytes).
_LONGEST_STEM: Final = 180
#: How many dead waiters' tickets one look passes over at most.
_PASS_OVER: Final = 8
#: How many times a move of ``head`` is tried against other movers.
_MOVES: Final = 5


class _Names:
    """The line's keys for the lock at ``key``."""

    __slots__ = ("head", "stem", "tail")

    def __init__(self, key: str) -> None:
        stem = key
        if len(key.encode()) > _LONGEST_STEM:
            stem = "tasklock-line:" + hashlib.md5(key.encode()).hexdigest()
        self.stem = stem
        self.head, self.tail = f"{stem}:line-head", f"{stem}:line-tail"

    def mark(self, ticket: int) -> str:
        return f"{self.stem}:line-{ticket}"


def _number(value: object) -> int:
    """A counter as stored (bytes of digits), 0 if missing."""
    if value is None:
        return 0
    if isinstance(value, bytes | str):
        return int(value)
    assert isinstance(value, int)
    return value


class _Waiter:
    """A waiter of this process in a line: its ticket, when it last renewed
    its mark, the head it last saw and since when, and whether its turn came
    (then it only tries the lock until it takes it)."""

    __slots__ = ("renewed", "seen", "since", "ticket", "turn")

    def __init__(self, ticket: int, now: float) -> None:
        self.ticket, self.renewed, self.seen, self.since = ticket, now, -1, now
        self.turn = False


#: (alias, key, waiter) -> the waiters of this process.
_waiters: dict[tuple[str, str, str], _Waiter] = {}


class MemcachedLines:
    """``KeepsLines`` for a ``MemcachedBackend``: the line on the lock's own
    server (through the backend's own clients, which raise when a server
    does not answer)."""

    #: A plain take cannot look at the line: a blocking acquire starts in it.
    guards_takes = False
    #: Each step would hold an executor thread: an event loop's waiters poll.
    wakes_async = False

    def __init__(self, backend: MemcachedReads) -> None:
        # A backend is one thread's; its waiters and their wake-ups are the
        # process's (an async waiter's tries run on any executor thread).
        self.backend, self.alias = backend, backend.alias

    # -- KeepsLines --------------------------------------------------------------

    def take_in_line(
        self, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        # Sent again once over a connection that had dropped (a restarted
        # server), as a take is; a ticket drawn twice is one passed over.
        client = self.backend._client(key)
        return self.backend.wire.once_more(
            client, lambda: self._take(client, key, token, expire, waiter, mark)
        )

    def _take(
        self, client: Any, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        names, now = _Names(key), time.monotonic()
        mark_ttl = math.ceil(mark) + 1  # (a whole-second clock may tick early)
        me = _waiters.get((self.alias, key, waiter))
        if me is None:
            got = client.get_many([names.head, names.tail])
            if _number(got.get(names.head)) >= _number(got.get(names.tail)):
                hold = self.backend.acquire(key, token, expire)  # nobody in line
                if hold is not None:
                    return hold, 0.0
            me = _Waiter(self._join(client, names), now)
            client.set(names.mark(me.ticket), b"1", mark_ttl, noreply=False)
            _waiters[self.alias, key, waiter] = me
            expect_here(self.alias, key, waiter)  # (a release here from now on)
        elif now - me.renewed > mark / 3:
            if not client.touch(names.mark(me.ticket), mark_ttl, noreply=False):
                client.set(names.mark(me.ticket), b"1", mark_ttl, noreply=False)
            me.renewed = now
        if not me.turn:
            ahead = self._ahead(client, names, me, mark, now)
            if ahead:
                return None, TURN_POLL * ahead
            me.turn = True
        hold = self.backend.acquire(key, token, expire)
        if hold is None:
            return None, TURN_POLL
        _waiters.pop((self.alias, key, waiter), None)
        done_here(self.alias, key, waiter)
        client.delete(names.mark(me.ticket), noreply=False)
        self._move_head(client, names, me.ticket)
        return hold, 0.0

    def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        return wait_here(self.alias, key, waiter, timeout, keep=True)

    def leave_line(self, key: str, waiter: str) -> None:
        done_here(self.alias, key, waiter)
        me = _waiters.pop((self.alias, key, waiter), None)
        if me is None:
            return
        client, names = self.backend._client(key), _Names(key)

        def leave() -> None:
            client.delete(names.mark(me.ticket), noreply=False)
            self._move_head(client, names, me.ticket)

        self.backend.wire.once_more(client, leave)
        wake_here(self.alias, key)  # the next waiter here, if its turn came

    # -- the counters --------------------------------------------------------------

    def _join(self, client: Any, names: _Names) -> int:
        """A new ticket: the tail's count before this waiter's."""
        count = client.incr(names.tail, 1, noreply=False)
        if count is None:  # no line yet (or it was lost): made, then counted
            client.add(names.tail, b"0", COUNTERS_TTL, noreply=False)
            count = client.incr(names.tail, 1, noreply=False)
            if count is None:  # (gone again at once: evicted; order is lost)
                return 0
        return int(count) - 1

    def _ahead(
        self, client: Any, names: _Names, me: _Waiter, mark: float, now: float
    ) -> int:
        """How many tickets are before ``me``'s (0: its turn), in one read
        while the head moves. A head that has not moved for ``mark`` seconds
        is looked at: a waiter whose mark expired (it died, or left without
        moving the head) is passed over."""
        got = client.get_many([names.head, names.tail])
        first, tail = _number(got.get(names.head)), _number(got.get(names.tail))
        for _ in range(_PASS_OVER):
            if first >= me.ticket or first >= tail:
                return 0  # its turn, or a ticket of a line since lost
            if first != me.seen:
                me.seen, me.since = first, now
            if now - me.since < mark or client.get(names.mark(first)) is not None:
                return me.ticket - first
            head, cas = client.gets(names.head)
            if _number(head) == first:
                moved = b"%d" % (first + 1)
                if cas is None:
                    client.add(names.head, moved, COUNTERS_TTL, noreply=False)
                else:
                    client.cas(names.head, moved, cas, COUNTERS_TTL, noreply=False)
            first = _number(client.get(names.head))
        return 1

    def _move_head(self, client: Any, names: _Names, ticket: int) -> None:
        """``head`` past ``ticket`` if ``ticket`` is the head: a waiter served
        or leaving at its turn hands the turn on; one leaving from further
        back, or served out of its turn (after its line was lost), leaves
        the head where it is (moving it would pass over the live waiters
        before it)."""
        for _ in range(_MOVES):
            head, cas = client.gets(names.head)
            if _number(head) != ticket:
                return
            value = b"%d" % (ticket + 1)
            if cas is None:
                if client.add(names.head, value, COUNTERS_TTL, noreply=False):
                    return
            elif client.cas(names.head, value, cas, COUNTERS_TTL, noreply=False):
                return
