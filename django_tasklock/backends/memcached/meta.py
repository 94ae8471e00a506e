"""memcached's meta protocol as the locks speak it, with no socket: the
commands, how a run of bytes splits into replies, and what each reply means.

The sync backend (on pymemcache's sockets, ``wire``) and the async one (on an
event loop's connections, ``aio``) both build and read every meta
command here; each adds only its own sending and reading. A reply is kept
whole, as it came: its line with the CR LF, and for a ``VA`` reply the value
after it with its own CR LF.

The owner check of a write (``while_ours``) is written once too, as a
generator of steps both backends drive: read the item, or write at a CAS id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from pymemcache.exceptions import MemcacheError

from ...values import unique_value

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

_T = TypeVar("_T")

__all__ = [
    "MOVES_IN_A_ROW",
    "READ",
    "TEXT_FLAG",
    "add",
    "cas_of",
    "count_and_read",
    "delete",
    "deleted",
    "drawn",
    "drive",
    "exists",
    "flag",
    "kept_moving",
    "no_cas",
    "present",
    "read",
    "read_ttl",
    "removed",
    "reply_end",
    "settled",
    "split",
    "swap",
    "swapped",
    "taken",
    "ttl_of",
    "value_of",
    "while_ours",
]

#: pymemcache's serde marks str values with flag 16 (FLAG_TEXT): a token
#: stored with it reads back as a str through ``cache.get(lock_id)``.
TEXT_FLAG: Final = 16

#: How many times in a row an owner-checked write (a release, an extend) may
#: find its holder's own unique value under yet another CAS id, and read it
#: again. Each time is a page move of memcached's slab rebalancer between the
#: read and the write; a busy rebalancer moved one lock of 100,000 twice in a
#: row (the console benchmark), which a single recheck reported lost.
MOVES_IN_A_ROW: Final = 5


# -- commands ----------------------------------------------------------------------


def add(key: bytes, data: bytes, ttl: int) -> bytes:
    """``ms`` in add mode: ``data`` stored at ``key`` for ``ttl`` only if no
    item is there, answering the new item's CAS id (``taken``)."""
    return b"ms %s %d T%d F16 ME c\r\n%s\r\n" % (key, len(data), ttl, data)


def swap(key: bytes, data: bytes, cas: int, ttl: int) -> bytes:
    """``ms`` with a CAS id: stored only while the item's CAS id is ``cas``,
    answering the new one (``swapped``)."""
    return b"ms %s %d C%d T%d F16 c\r\n%s\r\n" % (key, len(data), cas, ttl, data)


def delete(key: bytes, cas: int | None = None) -> bytes:
    """``md``: the item removed (only while its CAS id is ``cas``, if given)."""
    if cas is None:
        return b"md %s\r\n" % key
    return b"md %s C%d\r\n" % (key, cas)


def read(key: bytes, flags: bool = False) -> bytes:
    """``mg`` for the item's value and CAS id (``flags``: its client flags
    too), read by ``value_of``."""
    return b"mg %s v c f\r\n" % key if flags else b"mg %s v c\r\n" % key


def exists(key: bytes) -> bytes:
    """``mg`` with no flags: ``HD`` if the item is there, ``EN`` if not."""
    return b"mg %s\r\n" % key


def read_ttl(key: bytes) -> bytes:
    """``mg`` for the seconds the item has left (``ttl_of``)."""
    return b"mg %s t\r\n" % key


def count_and_read(counter: bytes, ttl: int, floor: int, key: bytes) -> bytes:
    """Two commands in one send: ``ma`` adds 1 to ``counter`` (made at
    ``floor`` for ``ttl`` if missing), then ``mg`` reads the item at ``key``
    (``drawn`` reads both replies)."""
    return b"ma %s N%d J%d T%d v\r\n" % (counter, ttl, floor, ttl) + read(key)


# -- replies -----------------------------------------------------------------------


def reply_end(buffer: bytes, start: int) -> int:
    """Where the reply starting at ``start`` in ``buffer`` ends (past its CR
    LF, and past a ``VA`` reply's value, which may hold CR LF itself); -1 if
    it has not all come yet. Raises ValueError for a ``VA`` header without a
    length."""
    end = buffer.find(b"\r\n", start)
    if end < 0:
        return -1
    stop = end + 2
    if buffer.startswith(b"VA ", start):
        stop += int(buffer[start + 3 : end].split(b" ", 1)[0]) + 2
        if len(buffer) < stop:
            return -1
    return stop


def split(buffer: bytes, count: int) -> list[bytes] | None:
    """The first ``count`` replies in ``buffer``, whole; None if more must be
    read. A server that answers ``ERROR`` answers every command after it so,
    and a data line too: the replies end at the first such."""
    replies: list[bytes] = []
    start = 0
    while len(replies) < count:
        try:
            stop = reply_end(buffer, start)
        except ValueError:
            raise MemcacheError(
                f"unexpected reply header from memcached: {buffer[start:]!r}"
            ) from None
        if stop < 0:
            return None
        reply = buffer[start:stop]
        replies.append(reply)
        start = stop
        if reply.startswith(b"ERROR"):
            break
    return replies


def flag(line: bytes, name: bytes) -> int | None:
    """The number after flag ``name`` (one letter) in a reply line (for a
    ``VA`` reply, its header: the value may hold any words), or None."""
    for word in line.split()[1:]:
        if word[:1] == name:
            return int(word[1:])
    return None


def cas_of(reply: bytes, head: bytes) -> int | None:
    """The ``c`` flag of a reply starting with ``head``, or None."""
    if not reply.startswith(head):
        return None
    return flag(reply, b"c")


def taken(reply: bytes) -> int | None:
    """What an add-mode ``ms`` answered: the new item's CAS id (0 from a
    server that gives none: ``no_cas``); None if another item was there.
    Raises for any other reply."""
    if reply[:4] == b"HD c":  # (the common reply, read first: every take)
        digits = reply[4:-2]
        if digits.isdigit():
            return int(digits)
    if reply.startswith(b"NS"):
        return None
    if not reply.startswith(b"HD"):
        raise MemcacheError(f"unexpected reply to ms: {reply!r}")
    return flag(reply, b"c") or 0


def no_cas(server: str) -> MemcacheError:
    """The error for a server that stores items without CAS ids."""
    return MemcacheError(
        f"memcached at {server} runs without CAS ids (-C), so a lock cannot be "
        "owner-checked; restart it without -C"
    )


def swapped(reply: bytes) -> int | None:
    """What ``swap`` answered: the new CAS id (0 if the server gave none);
    None if the item had another CAS id or was gone."""
    if reply.startswith(b"HD"):
        return flag(reply, b"c") or 0
    if reply.startswith((b"EX", b"NF")):
        return None
    raise MemcacheError(f"unexpected reply to ms: {reply!r}")


def removed(reply: bytes) -> bool | None:
    """What an ``md`` with the holder's CAS id answered, on the connection
    that took the item: True if it removed the item, False if no item was
    there; None otherwise (``EX``: another CAS id, another holder's item or
    the holder's moved by the slab rebalancer), for the value to tell."""
    head = reply[:2]
    if head == b"HD":
        return True
    if head == b"NF":
        return False
    return None


def deleted(reply: bytes) -> bool:
    """Whether an ``md`` that answered ``reply`` removed the item (False: it
    had another CAS id, or was gone). Raises for any other reply."""
    if reply.startswith(b"HD"):
        return True
    if reply.startswith((b"EX", b"NF")):
        return False
    raise MemcacheError(f"unexpected reply to md: {reply!r}")


def value_of(reply: bytes) -> tuple[bytes, int, int] | None:
    """A ``read`` reply's value, CAS id and client flags (0 when not asked);
    None if no item was there."""
    if reply.startswith(b"EN"):
        return None
    header, _, data = reply.partition(b"\r\n")
    cas = cas_of(header, b"VA")
    if cas is None:
        raise MemcacheError(f"unexpected reply to mg: {header!r}")
    return data[:-2], cas, flag(header, b"f") or 0


def present(reply: bytes) -> bool:
    """Whether an ``exists`` reply found the item."""
    if reply.startswith(b"HD"):
        return True
    if reply.startswith(b"EN"):
        return False
    raise MemcacheError(f"unexpected reply to mg: {reply!r}")


def ttl_of(reply: bytes) -> float | None:
    """The seconds left that a ``read_ttl`` reply gives (inf: no expiry);
    None if no item was there."""
    if not reply.startswith(b"HD"):
        return None
    seconds = flag(reply, b"t")
    return float("inf") if seconds is None or seconds < 0 else float(seconds)


def drawn(replies: list[bytes]) -> tuple[int, bytes, int] | None:
    """``count_and_read``'s two replies: the number drawn, and the item's
    value and CAS id (None if it is gone). Raises ValueError when the
    counter holds no number."""
    counted, item = replies
    if not counted.startswith(b"VA "):
        raise ValueError(counted)
    number = int(counted.partition(b"\r\n")[2][:-2])
    found = value_of(item)
    if found is None:
        return None
    return number, found[0], found[1]


# -- the owner check of a write ------------------------------------------------------


#: A step of ``while_ours``: read the item (send back its value and CAS id,
#: or None if it is gone).
READ: Final = -1


def kept_moving(key: str) -> MemcacheError:
    """The error when the item at ``key`` kept the holder's value but moved
    ``MOVES_IN_A_ROW`` times under its write: not a loss, so not told as one."""
    return MemcacheError(
        f"the item {key!r} still holds this holder's token but memcached gave it "
        f"a new CAS id {MOVES_IN_A_ROW} times in a row (its slab rebalancer moving "
        "pages): the write was not made. It expires on its own, or crash recovery "
        "frees it; if this repeats, see memcached's slab_automove setting"
    )


class Held(Protocol):
    """What the owner check needs of a hold: the CAS id the holder knows, and
    the connection that proves it (None: the value tells)."""

    cas: int
    sock: Any


def settled(hold: Held, token: object, done: object) -> bool:
    """Whether a write at the holder's CAS id that gave ``done`` (None:
    nothing written) settles its owner check: it wrote, or the holder's value
    could not prove a move (not unique). Else the item moved or is another's,
    and from now on its value tells (``hold.sock`` is forgotten)."""
    if done is not None or not unique_value(token):
        return True
    hold.sock = None
    return False


def while_ours(
    key: str, hold: Held, token: object, tries: int = MOVES_IN_A_ROW
) -> Generator[int, Any, Any]:
    """An owner-checked write, as steps: each yields ``READ`` (send back the
    item's ``(value, cas)``, None if it is gone) or the CAS id to write at
    (send back what the write gave, None where nothing was written: another
    CAS id by then, or gone). Returns what the write gave, or None if the
    item was not the holder's (``drive`` runs it with two functions).

    A CAS id alone proves nothing but on the connection that took the item
    (the drivers write at once there, and come here only if that write
    settled nothing, with a try less): a restarted server hands ids out
    again from 1. The stored token decides (random per acquisition, written
    by no one else); a value other code may store proves it only with the
    CAS id the holder knows. A unique value of the holder's under a new CAS
    id is its item moved by the slab rebalancer: the new id is learnt, and
    the write tried again, ``tries`` times in all (``MOVES_IN_A_ROW``)."""
    for _ in range(tries):
        found = yield READ
        if found is None or found[0] != token:
            return None
        cas = found[1]
        if cas != hold.cas:
            if not unique_value(token):
                return None
            hold.cas = cas
        done = yield cas
        if settled(hold, token, done):
            return done
    raise kept_moving(key)


def drive(
    steps: Generator[int, Any, _T],
    read: Callable[[], object],
    write: Callable[[int], object],
) -> _T:
    """Run ``while_ours``'s ``steps`` with a blocking ``read`` and ``write``."""
    step = next(steps)
    while True:
        try:
            step = steps.send(read() if step == READ else write(step))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
