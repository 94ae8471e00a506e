"""What each acquisition is given: an owner token, and a fencing token if asked.

The owner token is the value stored under the lock: unique per acquisition, so
release and extend can tell this holder from every other, and readable, so a
person (or ``manage.py tasklock status``) can tell who holds a lock. The fencing
token is drawn from a counter per lock id; ``fence_counter`` says where that
counter is and what a missing one starts from.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import secrets
import socket
import time
from _thread import get_ident
from typing import Final

from .conf import MAX_EXPIRE
from .keys import record_id
from .values import FenceCounter, token_process

__all__ = [
    "FENCE_COUNTER_TTL",
    "KEEPS_RECORD",
    "KEPT_ELSEWHERE",
    "TOKENS",
    "fence_counter",
    "holder_alive",
    "holder_record_id",
    "local_verdict",
    "new_live_token",
    "new_token",
    "process_alive",
    "process_identity",
    "this_process",
    "token_host",
    "token_owner",
    "token_process",
]

#: Shortest life of a fencing counter after its last acquisition, in seconds.
FENCE_COUNTER_TTL: Final = 24 * 60 * 60


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields after the command name in ``/proc/<pid>/stat`` (state first);
    None if there is no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()
    except OSError:
        return None


def _process_space() -> str:
    """This boot of this machine and this pid namespace, as 8 hex digits: a pid
    and a start time mean one process only within one space."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as boot:
            boot_id = boot.read().strip()
        namespace = os.readlink("/proc/self/ns/pid").encode()
    except OSError:
        return ""
    return hashlib.md5(boot_id + namespace, usedforsecurity=False).hexdigest()[:8]


_SPACE: Final = _process_space()


def process_identity(pid: int) -> str:
    """How tokens name process ``pid`` of this host: ``pid-start-space``, where
    start is its start time in clock ticks since boot (it tells a reused pid from
    the process that had it) and space names this boot and pid namespace; the
    bare pid where /proc cannot say."""
    fields = _proc_stat(pid)
    if not _SPACE or fields is None or len(fields) < 20:
        return str(pid)
    return f"{pid}-{int(fields[19])}-{_SPACE}"


class _Tokens:
    """Unique tokens without a system call per acquisition: a random 64-bit prefix
    per process (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.process = process_identity(os.getpid())
        random = secrets.token_hex(8)
        self.prefix = f"{self.process}:{random}"
        self.live_prefix = f"{self.process}{KEEPS_RECORD}:{random}"
        self.counter = itertools.count()

    def new(self, owner: str) -> str:
        """``owner:process:random:thread:count``, where owner is ``oid@host`` or
        ``host`` and process is ``pid-start-space`` (see ``process_identity``)."""
        # next() on itertools.count is atomic under the GIL: threads never share one.
        return f"{owner}:{self.prefix}:{get_ident()}:{next(self.counter)}"

    def new_live(self, owner: str) -> str:
        """As ``new``, for a process that keeps a liveness record beside the
        lock (``locks.liveness``): process is ``pid-start-space-s``."""
        return f"{owner}:{self.live_prefix}:{get_ident()}:{next(self.counter)}"


#: Written after the process identity of a holder that keeps a liveness record
#: beside each of its locks (``locks.liveness``).
KEEPS_RECORD: Final = "-s"
#: What earlier builds wrote instead, for a record wherever Django's cache put
#: it: such a record cannot tell a live holder from a dead one safely, so their
#: locks are left to expire.
KEPT_ELSEWHERE: Final = "-r"

_tokens = _Tokens()
#: This process's token maker: ``TOKENS.live_prefix in token`` tells whether a
#: token this process made promises a liveness record (``new_live``).
TOKENS = _tokens
#: A new token for ``owner`` (see ``_Tokens.new``); bound methods, called once
#: per acquire.
new_token = _tokens.new
new_live_token = _tokens.new_live


def this_process() -> str:
    """This process's identity, as its tokens write it."""
    return _tokens.process


def token_owner(value: object) -> tuple[str, int] | None:
    """The owner (``oid@host`` or ``host``) and the pid in a token ``new_token``
    made; None for any other value."""
    parsed = token_process(value)
    if parsed is None:
        return None
    return parsed[0], int(parsed[1].partition("-")[0])


def token_host(owner: str) -> str:
    """The host in a token's owner: ``oid@host#task id``, ``host#task id``..."""
    return owner.partition("#")[0].rpartition("@")[2]


def holder_record_id(owner: str, process: str) -> str:
    """The id of the liveness record of the process a token names, from the
    token's owner and process (``token_process``), its flag dropped."""
    bare = process.removesuffix(KEEPS_RECORD).removesuffix(KEPT_ELSEWHERE)
    return record_id(token_host(owner), bare)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (its pid namespace) still runs; a
    zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    fields = _proc_stat(pid)
    return fields is None or fields[0] != b"Z"  # no /proc: kill(0) said it exists


def local_verdict(host: str, process: str) -> tuple[bool | None, str]:
    """Whether the process a token names still runs, judged on this host alone:
    True or False with the reason, or None where this host cannot tell
    (another hostname, another boot or pid namespace of this one, a process
    that exists but that /proc hides from this user, as ``hidepid`` does)."""
    if host != socket.gethostname():
        return None, f"on another host ({host})"
    bare = process.removesuffix(KEEPS_RECORD).removesuffix(KEPT_ELSEWHERE)
    pid_text, _, rest = bare.partition("-")
    start, _, space = rest.partition("-")
    pid = int(pid_text)
    if not rest:  # a bare pid: this host without /proc
        if process_alive(pid):
            return True, f"process {pid} runs"
        return False, f"process {pid} is gone"
    if space != _SPACE:
        return None, f"process {pid} of another boot or pid namespace of {host}"
    fields = _proc_stat(pid)
    if fields is None:
        # Gone, or hidden: /proc mounted with hidepid, or not readable here.
        # Only the kernel's word that no such pid exists is "gone"; a pid that
        # exists may be the holder's or a newer process's: nobody can tell.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False, f"process {pid} is gone"
        except OSError:
            pass
        return None, f"process {pid} exists, but /proc does not show it to this user"
    if fields[0] == b"Z":
        return False, f"process {pid} has exited (not yet reaped by its parent)"
    if len(fields) < 20 or fields[19].decode() != start:
        return False, f"process {pid} is gone (its pid now names another process)"
    return True, f"process {pid} runs"


def holder_alive(value: object) -> bool | None:
    """Whether the process whose token ``value`` is still runs: True or False
    for a process of this host, None for one this host cannot look at or a
    value not made by ``new_token`` (``locks.liveness`` asks the store then)."""
    parsed = token_process(value)
    if parsed is None:
        return None
    return local_verdict(token_host(parsed[0]), parsed[1])[0]


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
