"""Telling a restarted memcached: it comes back empty, so new locks on it wait.

A restarted memcached has lost every lock it held while their holders may still
run; handing the same ids out again at once would run their work twice. Each
new connection reads which run of the server it reaches (its pid and start
time, from ``stats``, and a mark of ours it keeps), and a server seen in
another run before refuses new locks for ``TASKLOCK['RESTART_GRACE']``
seconds. The runs are remembered per process and recorded on the pool's other
servers and in the mark, so a process started after the restart knows too.

The pid and start time alone miss a quick restart in a container, where
memcached always runs as pid 1 and a restart within a couple of seconds keeps
the start time: the run mark, ``tasklock-run-mark`` on each server, added with
``add`` (so every process agrees on one per run) and never expiring, is gone
after any restart whatever the pid. An evicted or flushed mark looks like a
restart too, which only matters when the server started recently (the grace
runs from its start).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
from typing import Any

from pymemcache.client.hash import HashClient
from pymemcache.exceptions import (
    MemcacheError,
    MemcacheUnexpectedCloseError,
    MemcacheUnknownCommandError,
)

from ...conf import MAX_EXPIRE
from ...conf import settings as tasklock_settings
from .wire import (
    CLOCK_READ_MOST,
    CLOCK_READS,
    CLOCK_RECHECK,
    _clocks,
    _read_stats,
    _server_name,
    clock_suspect,
    closes_on_stats,
    observe_clock,
)

__all__ = ["NodeRestarted", "Restarts", "RunUnknown"]

logger = logging.getLogger(__name__)


class NodeRestarted(MemcacheError):  # type: ignore[misc]
    """New locks refused on a memcached server that restarted recently."""


class RunUnknown(MemcacheError):  # type: ignore[misc]
    """New locks refused on a memcached server whose run could not be told."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"{why}: which run of the server answers is unknown, so new locks on "
            "it are refused (a restarted server hands out ids live holders still "
            "have). Locks held there are kept; try again once it answers"
        )


def _probe_timeout(client: Any) -> float:
    """Seconds a probe of ``client``'s server may wait: its own timeout, and
    never longer than ``TASKLOCK['SOCKET_TIMEOUT']``."""
    ours = tasklock_settings.SOCKET_TIMEOUT
    theirs = getattr(client, "timeout", None)
    return min(ours, theirs) if theirs else ours


# Restart detection (see Restarts.learn). Per server: the run of it last
# seen, as (pid, start time on the server's clock, run mark); servers whose stats cannot be
# read (a proxy); and, for servers seen to restart, when that run started (on
# time.monotonic()), new locks on them refused until RESTART_GRACE has passed.
_runs: dict[Any, tuple[int, int, str]] = {}
_unlearnable: set[Any] = set()
_refused: dict[Any, float] = {}
_runs_mutex = threading.Lock()
#: Two sightings of one run may put its start a second apart (whole-second clock).
_START_SLACK = 2
#: memcached reports an uptime up to this many seconds longer than it has run.
_UPTIME_AHEAD = 3


def _record_key(server: Any) -> str:
    return "tasklock-run-" + _server_name(server).replace(":", "-")


#: The key of a server's run mark (see ``Restarts._mark``).
MARK_KEY = "tasklock-run-mark"


def _same_run(seen: tuple[int, int, str], now: tuple[int, int, str]) -> bool:
    # A record from before run marks has an empty one: pid and start decide.
    same_mark = not seen[2] or seen[2] == now[2]
    return same_mark and seen[0] == now[0] and abs(seen[1] - now[1]) <= _START_SLACK


def _refuse(server: Any, run: tuple[int, int, str], uptime: int, was: str) -> None:
    """Refuse new locks on ``server``, seen ``uptime`` seconds into a run that
    follows a restart, until RESTART_GRACE has passed since it started."""
    grace = tasklock_settings.RESTART_GRACE
    # When it started, on this process's monotonic clock, late rather than
    # early: memcached's uptime runs up to 2 s ahead, in whole seconds.
    started = time.monotonic() - max(uptime - _UPTIME_AHEAD, 0)
    _refused[server] = started
    left = started + grace - time.monotonic()
    if left > 0:
        logger.warning(
            "memcached at %s restarted about %ds ago (pid %d, %s) and came back "
            "empty: locks it held are gone while their holders may still run. "
            "New locks on it are refused for %.0fs more "
            "(TASKLOCK['RESTART_GRACE'] = %ss).",
            _server_name(server),
            uptime,
            run[0],
            was,
            left,
            grace,
        )


def _clock(
    client: Any, server_now: int, sent: float, received: float, same: bool
) -> None:
    """Learn the clock of ``client``'s server (``observe_clock``) from a read
    of its ``time``: a run's first read again after ``CLOCK_RECHECK`` when it
    is suspect (a stalled server answers before its clock catches up), and
    again when it was too slow; with no good read, the lock is refused (an
    expiry on a clock read wrong could end before its holder counts)."""
    server = client.server
    if not same:
        _clocks.pop(server, None)  # another run counts from another start
    elif server in _clocks:
        observe_clock(server, server_now, sent, received)  # only ever raises it
        return

    def again() -> tuple[int, float, float]:
        began = time.monotonic()
        read = int(_read_stats(client)[b"time"])
        return read, began, time.monotonic()

    if clock_suspect(server_now):
        time.sleep(CLOCK_RECHECK)
        server_now, sent, received = again()
    for _ in range(CLOCK_READS):
        if observe_clock(server, server_now, sent, received):
            return
        server_now, sent, received = again()
    raise RunUnknown(
        f"memcached at {_server_name(server)} took over {CLOCK_READ_MOST}s to "
        f"answer each of {CLOCK_READS} reads of its clock"
    )


class Restarts:
    """The restart checks of one cache alias's servers (``hash_client``'s)."""

    def __init__(
        self, hash_client: Any, errors: tuple[type[BaseException], ...]
    ) -> None:
        self.hash_client = hash_client
        self.errors = errors
        #: Per server client, the connection whose server run was learnt.
        self.learnt: dict[Any, Any] = {}

    def known(self, client: Any) -> None:
        """Learn the run of the server ``client`` reaches, unless its
        connection's was learnt already (``learn``); raises when it cannot be
        told, so that no lock is taken on a server whose run is unknown."""
        sock = getattr(client, "sock", False)
        if sock is False:
            # A client that hides its connections (pymemcache's PooledClient)
            # cannot be learnt per connection: refused, never passed.
            raise RunUnknown(
                f"the client of memcached at {_server_name(client.server)} keeps "
                "no connection of its own to learn the server's run on"
            )
        if sock is None or self.learnt.get(client) is not sock:
            self.learn(client)
            self.learnt[client] = client.sock

    def learn(self, client: Any) -> None:
        """Read which run of the server this new connection reaches, and refuse
        new locks on it for RESTART_GRACE seconds if it restarted.

        A restarted memcached comes back empty: the locks it held are gone while
        their holders may still run, and handing the same ids out again would
        run their work twice. A restart is known when this process saw another
        run of the server before, or when another server of the pool keeps a
        record of another run (each process that learns a server's run records
        it on the pool's other servers). A server first seen with no record is a
        new deployment, not a restart. A proxy, known by its answers (it answers
        ``version`` and not ``stats``), does not pass ``stats`` on; servers
        behind it are not checked. A server whose record could not be read
        (another server of the pool did not answer) is taken for restarted:
        "could not tell" is never "fine", and the grace runs from the server's
        start, so it costs nothing once the server has run that long.

        Raises when the run could not be told (``RunUnknown``, or the
        connection's error): the lock is refused, and the next one asks again.
        """
        server = client.server
        if server in _unlearnable:
            return
        try:
            sent = time.monotonic()
            stats = _read_stats(client)
            received = time.monotonic()
        except MemcacheUnexpectedCloseError as exc:
            # Closed before answering: twemproxy does that to ``stats``, and so
            # does a server on its way down, a container's port proxy while it
            # restarts, or a load balancer with no backend. Only the first is
            # let through, and only when it proves itself one.
            client.close()
            if not closes_on_stats(server, _probe_timeout(client)):
                raise RunUnknown(
                    f"memcached at {_server_name(server)} closed the connection "
                    "instead of answering stats, and does not answer as a proxy "
                    "does (version answered, stats refused)"
                ) from exc
            _unlearnable.add(server)
            return
        except MemcacheUnknownCommandError:
            _unlearnable.add(server)  # answers, with no stats: a proxy
            return
        try:
            pid, server_now = int(stats[b"pid"]), int(stats[b"time"])
            uptime = int(stats[b"uptime"])
        except (KeyError, ValueError) as exc:
            raise RunUnknown(
                f"memcached at {_server_name(server)} answered stats without "
                "a readable pid, time and uptime"
            ) from exc
        mark, marked_restart = self._mark(client)
        run = (pid, server_now - uptime, mark)
        with _runs_mutex:
            seen = _runs.get(server)
            _runs[server] = run
        was, seen = self._restart(server, run, seen, marked_restart)
        _clock(
            client, server_now, sent, received, _same_run(seen, run) if seen else False
        )
        if was:
            _refuse(server, run, server_now - run[1], was)
        if seen is None or not _same_run(seen, run):
            self._record_run(server, run, bool(was))
        if was and not marked_restart:
            # Said in the mark too, for processes that never saw the old run.
            with contextlib.suppress(*self.errors):
                client.set(MARK_KEY, f"{mark}:r", 0, noreply=False)

    def _restart(
        self,
        server: Any,
        run: tuple[int, int, str],
        seen: tuple[int, int, str] | None,
        marked_restart: bool,
    ) -> tuple[str, tuple[int, int, str] | None]:
        """Why ``run`` of ``server`` follows a restart ("" if it does not), and
        the run seen before it (by this process, or recorded by another)."""
        told = "a restart another process recorded"
        if seen is None and marked_restart:
            # A record of this very run marked as a restart: another process
            # saw it replace an earlier one (and recorded it first), so this is
            # a restart too, with the same grace from the same start.
            return told, None
        if seen is None:
            recorded, unanswered = self._recorded_run(server)
            if unanswered:
                return (
                    f"taken so as {unanswered} did not answer for its record: "
                    "a restart cannot be ruled out",
                    None,
                )
            if recorded is None:
                return "", None  # first seen, with no record: a new deployment
            seen = recorded[0]
            if recorded[1] and _same_run(seen, run):
                return told, seen
        if _same_run(seen, run):
            return "", seen
        return (f"was {seen[0]}" if seen[0] != run[0] else "its run mark is new"), seen

    @staticmethod
    def _mark(client: Any) -> tuple[str, bool]:
        """The server's run mark, added now if it has none, and whether a
        process marked this run as following a restart."""
        for _ in range(3):
            value = client.get(MARK_KEY)
            if value is None and client.add(
                MARK_KEY, secrets.token_hex(8), 0, noreply=False
            ):
                continue  # read back: ours, or another process's that won
            if value is not None:
                mark, _, flag = str(value).partition(":")
                return mark, flag == "r"
        raise RunUnknown(
            f"memcached at {_server_name(client.server)} keeps no run mark "
            f"({MARK_KEY!r} is gone each time it is added: evicted at once?)"
        )

    def _others(self, server: Any) -> list[Any]:
        hash_client = self.hash_client
        if not isinstance(hash_client, HashClient):
            return []
        return [c for c in hash_client.clients.values() if c.server != server]

    def _recorded_run(
        self, server: Any
    ) -> tuple[tuple[tuple[int, int, str], bool] | None, str]:
        """The run of ``server`` recorded on another server of the pool, and
        whether the process that recorded it saw it replace an earlier run
        (``pid:start:mark:r``); None if no other server has a record. Then the
        servers that did not answer ("" if every one did): with none found,
        the record may be on one of them."""
        unanswered = []
        for other in self._others(server):
            try:
                value = other.get(_record_key(server))
            except self.errors:
                unanswered.append(_server_name(other.server))
                continue
            if value is not None:
                pid, start, *rest = str(value).split(":")
                # (pid:start[:r] before run marks)
                mark = rest[0] if rest and rest[0] != "r" else ""
                return ((int(pid), int(start), mark), rest[-1:] == ["r"]), ""
        return None, ", ".join(unanswered)

    def _record_run(
        self, server: Any, run: tuple[int, int, str], restarted: bool
    ) -> None:
        value = f"{run[0]}:{run[1]}:{run[2]}" + (":r" if restarted else "")
        for other in self._others(server):
            try:
                other.set(_record_key(server), value, MAX_EXPIRE)
            except self.errors:
                continue

    def refuse_if_restarted(self, client: Any) -> None:
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
