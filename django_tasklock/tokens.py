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
import threading
import time
from typing import Final

from .backends import FenceCounter
from .conf import MAX_EXPIRE

__all__ = ["FENCE_COUNTER_TTL", "fence_counter", "new_token", "token_owner"]

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
