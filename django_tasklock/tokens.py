"""What each acquisition is given: an owner token, and a fencing token if asked.

The owner token is the value stored under the lock: unique per acquisition, so
release and extend can tell this holder from every other, and readable, so a
person (or ``manage.py tasklock status``) can tell who holds a lock. The fencing
token is drawn from a counter per lock id; ``fence_counter`` says where that
counter is and what a missing one starts from.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import socket
import threading
import time
from typing import Final

from .backends import FenceCounter
from .conf import MAX_EXPIRE

__all__ = [
    "FENCE_COUNTER_TTL",
    "fence_counter",
    "holder_alive",
    "new_token",
    "process_alive",
    "token_host",
    "token_owner",
]

#: Shortest life of a fencing counter after its last acquisition, in seconds.
FENCE_COUNTER_TTL: Final = 24 * 60 * 60


class _Tokens:
    """Unique tokens without a system call per acquisition: a random 64-bit prefix
    per process (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = f"{os.getpid()}:{secrets.token_hex(8)}"
        self.counter = itertools.count()

    def new(self, owner: str) -> str:
        """``owner:pid:random:thread:count``, where owner is ``oid@host`` or
        ``host``."""
        # next() on itertools.count is atomic under the GIL: threads never share one.
        return f"{owner}:{self.prefix}:{threading.get_ident()}:{next(self.counter)}"


_tokens = _Tokens()
#: A new token for ``owner`` (see ``_Tokens.new``); a bound method, called once
#: per acquire.
new_token = _tokens.new


def token_owner(value: object) -> tuple[str, int] | None:
    """The owner (``oid@host`` or ``host``) and the pid in a token ``new_token``
    made; None for any other value (other code's, such as the recipe's oid)."""
    if not isinstance(value, str):
        return None
    parts = value.rsplit(":", 4)
    if len(parts) != 5 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def token_host(owner: str) -> str:
    """The host in a token's owner: ``oid@host#task id``, ``host#task id``..."""
    return owner.partition("#")[0].rpartition("@")[2]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (its pid namespace) still runs; a
    zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it exists


def holder_alive(value: object) -> bool | None:
    """Whether the process whose token ``value`` is still runs: True or False
    for a process of this host (hosts are told apart by hostname, so one pid
    namespace per hostname), None for another host's or a value not made by
    ``new_token``."""
    owner = token_owner(value)
    if owner is None or token_host(owner[0]) != socket.gethostname():
        return None
    return process_alive(owner[1])


def fence_counter(key: str, expire: float) -> FenceCounter:
    """The counter at ``key`` for a lock stored for ``expire`` seconds.

    A missing counter starts from the current time in microseconds: it counted
    one per acquisition since it was made, far slower than the clock, so every
    token it gave out is below that. It lives a day after its last use, or twice
    the lock's expiry if longer.
    """
    if expire <= FENCE_COUNTER_TTL / 2:
        ttl = FENCE_COUNTER_TTL
    else:
        ttl = min(MAX_EXPIRE, 2 * math.ceil(expire))
    return FenceCounter(key, time.time_ns() // 1000, ttl)
