"""New locks refused on a cluster primary that took over recently.

Replication is asynchronous: a lock the old primary acknowledged may be missing
on the replica promoted in its place, while its holder still runs. Like a
memcached restart (``memcached/restarts.py``), such a primary refuses new locks
for a grace (``TASKLOCK['RESTART_GRACE']``: by default ``LIVENESS``, within
which live holders put back what it lost, or ``LOCK_EXPIRE`` without liveness
records, by which time every lock it may have lost has expired anyway).

How a process knows (``Promotions.learn``), per primary, from the primary
itself (never a replica, and "could not tell" refuses rather than grants):

- ``INFO``: its replication id (new with every promotion and every restart),
  whether it was promoted (``second_repl_offset`` is set: it continues an old
  primary's history) and how long it has run;
- a mark of ours on it for that run (``tasklock-primary-mark:{tag}:<replid>``,
  the tag in the lowest slot the primary serves by its own ``CLUSTER NODES``):
  since when that run refuses new locks, written by the first process to learn
  the run. A process that comes later counts the grace from it, not from its
  own first sight; a promoted replica inherits marks of the old run, which name
  another replication id and are never read;
- a record of each primary's run on every other primary
  (``tasklock-primary-run:``), which tells a restart in place from a new
  deployment for a process that never saw the primary before.

A primary that runs with a marked replication id is known. One promoted that
no mark names took over now (late rather than early: the grace counts from
this sight). One never promoted that restarted (this process knew another run
under its address, another primary records another run, or one of them did
not answer) came back empty: its run started ``uptime`` seconds ago. A primary
neither promoted nor restarted by any record is a new deployment, nothing to
refuse.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ...conf import settings

__all__ = ["LEARNT", "MARK_PREFIX", "RUN_PREFIX", "Promotions", "relearn"]

logger = logging.getLogger(__name__)

MARK_PREFIX = "tasklock-primary-mark:"
#: Per primary address, on every other primary: the replication id of the
#: run last seen there (how a restart in place is told by a new process).
RUN_PREFIX = "tasklock-primary-run:"
#: How often a process asks a primary it knows again (a restart in place keeps
#: its address; a promotion moves the slot to another address at once).
LEARN_EVERY = 2.0
_MAY_HAVE = "may have restarted"

# Per primary address: (replication id, when its run as primary started on
# time.monotonic(), or None when nothing is refused there, when to ask again).
_learnt: dict[str, tuple[str, float | None, float]] = {}
#: The same table, read by the cluster backend's fast path (a primary known,
#: refusing nothing, and not due to be asked again).
LEARNT = _learnt
#: Per primary address whose first sight here could not tell whether it
#: restarted: why (a refusal says so instead of "took over").
_unknown: dict[str, str] = {}
_tags: dict[str, str] = {}
#: Per hash slot, a hash tag in it (found once: the CRC is computed in Python).
_slot_tags: dict[int, str] = {}
_mutex = threading.Lock()


def _lowest_slot(nodes: object) -> int:
    """The lowest hash slot the node that answered ``CLUSTER NODES`` serves
    (its ``myself`` entry, as valkey-py parses the reply, or the raw text);
    raises ValueError if it serves none."""
    if isinstance(nodes, dict):
        entries = [
            (str(entry.get("flags", "")), [str(r[0]) for r in entry.get("slots", [])])
            for entry in nodes.values()
        ]
    else:
        text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
        entries = [
            (fields[2], [part.split("-")[0] for part in fields[8:]])
            for fields in (line.split() for line in text.splitlines())
            if len(fields) > 2
        ]
    for flags, starts in entries:
        if "myself" in flags.split(","):
            numbers = [int(start) for start in starts if start.isdigit()]
            if numbers:
                return min(numbers)
    raise ValueError("the node serves no hash slot (not a primary now)")


def relearn(name: str) -> None:
    """A new connection to the primary at ``name`` (host:port): ask its run
    again before a lock taken there stands. A restart in place keeps the
    address and breaks every connection, so what was learnt of the run
    before is not trusted past a reconnection (the fast path would otherwise
    trust it for up to ``LEARN_EVERY``: a lock granted on a primary restarted
    empty, within its grace)."""
    with _mutex:
        learnt = _learnt.get(name)
        if learnt is not None and learnt[2] > 0.0:
            _learnt[name] = (learnt[0], learnt[1], 0.0)


class Promotions:
    """The failover checks of one cluster alias (its cluster client's)."""

    def __init__(self, errors: tuple[type[BaseException], ...]) -> None:
        self.errors = errors

    def started(self, client: Any, slot: int) -> float | None:
        """When the primary of hash slot ``slot`` (as the client routes to it
        now, after any redirection) took over, on ``time.monotonic()``, if
        less than the grace ago; else None."""
        node = client.nodes_manager.slots_cache[slot][0]
        learnt = _learnt.get(node.name)
        if learnt is None or learnt[2] <= time.monotonic():
            learnt = self.learn(client, node)
        return learnt[1]

    def refusal(self, client: Any, slot: int) -> str | None:
        """Why a new lock in hash slot ``slot`` must not stand, or None: the
        slot's primary took over less than the grace ago."""
        started = self.started(client, slot)
        if started is None:
            return None
        node = client.nodes_manager.slots_cache[slot][0]
        now = time.monotonic()
        left = started + settings.FAILOVER_GRACE - now
        if left <= 0:
            return None
        ago = f"{now - started:.0f}s ago"
        why = _unknown.get(node.name)
        what = (
            f"took over its slots {ago} (a failover, or a restart that came back empty)"
            if why is None
            else f"{why} {ago}, so whether it came back empty is not known"
        )
        return (
            f"the cluster primary {node.name} {what}: locks the old primary held "
            "may be gone while their holders still run, so new locks on it are "
            f"refused for {math.ceil(left)}s more (TASKLOCK['RESTART_GRACE'], by "
            "default LIVENESS)"
        )

    def learn(self, client: Any, node: Any) -> tuple[str, float | None, float]:
        """Read ``node``'s run and our mark on it; remember and return
        (replication id, start of a run to refuse on, when to ask again)."""
        info = node.valkey_connection.info("replication")
        replid = str(info["master_replid"])
        now = time.monotonic()
        before = _learnt.get(node.name)
        if before is not None and before[0] == replid:  # the run it knew
            started = before[1]
        else:
            started = self._first_sight(client, node, info, before, now)
        if started is not None and started + settings.FAILOVER_GRACE <= now:
            started = None
        learnt = (replid, started, now + LEARN_EVERY)
        with _mutex:
            _learnt[node.name] = learnt
        return learnt

    def _first_sight(
        self,
        client: Any,
        node: Any,
        info: dict[str, Any],
        before: tuple[str, float | None, float] | None,
        now: float,
    ) -> float | None:
        """When the run of ``node`` this process sees for the first time started
        refusing new locks (None: it refuses none), from our mark of that run
        on it or, for the first process to see the run, from its INFO and the
        records of its runs on the other primaries; that process writes the
        mark, so every process counts the same grace."""
        connection = node.valkey_connection
        replid = str(info["master_replid"])
        started: float | None
        promoted = int(info.get("second_repl_offset", -1)) != -1
        uptime = float(connection.info("server")["uptime_in_seconds"])
        # A mark per run: a promoted replica inherits its old primary's keys,
        # marks included, which name the old run and are never read again.
        mark_key = f"{MARK_PREFIX}{{{self._tag(client, node)}}}:{replid}"
        raw = connection.get(mark_key)
        mark = raw.decode() if isinstance(raw, bytes) else raw
        wall = time.time()
        unknown = None
        if mark is not None:
            started = now - max(wall - float(mark), 0.0)
        elif promoted:
            started = now  # late rather than early: from this first sight
            self._announce(node, "was promoted from a replica", "")
        else:
            why = self._restarted(client, node, replid, before)
            if why:
                started = now - uptime
                self._announce(node, why, f" {uptime:.0f}s ago")
                if why.startswith(_MAY_HAVE):
                    unknown = why
            else:
                started = None  # a new deployment: nothing it held is missing
        with _mutex:
            if unknown is None:
                _unknown.pop(node.name, None)
            else:
                _unknown[node.name] = unknown
        if mark is None:
            # Since when the run refuses new locks (0: long ago, for none), for
            # those that come later (nx: two first sights keep the earlier).
            since = 0.0 if started is None else wall - (now - started)
            connection.set(mark_key, f"{since:.3f}", nx=True)
            self._record_run(client, node, replid)
        return started

    def _restarted(
        self,
        client: Any,
        node: Any,
        replid: str,
        before: tuple[str, float | None, float] | None,
    ) -> str:
        """Why a primary never promoted, whose run no process marked, follows
        a restart ("" for a new deployment): this process knew another run
        under its address, or another primary keeps a record of another run,
        or one of them did not answer ("could not tell" is never "fine")."""
        if before is not None:
            return "restarted"
        key = RUN_PREFIX + node.name
        unanswered = []
        for other in client.get_primaries():
            if other.name == node.name:
                continue
            try:
                raw = other.valkey_connection.get(self._on(client, other, key))
            except self.errors:
                unanswered.append(other.name)
                continue
            if raw is not None:
                recorded = raw.decode() if isinstance(raw, bytes) else str(raw)
                return "" if recorded == replid else "restarted empty"
        if unanswered:
            return (
                f"{_MAY_HAVE} (no answer from {', '.join(unanswered)} for the "
                "record of its run); it started"
            )
        return ""

    def _record_run(self, client: Any, node: Any, replid: str) -> None:
        """Record ``node``'s run on every other primary, so that a process
        that never saw it knows a restart in place for one."""
        key = RUN_PREFIX + node.name
        for other in client.get_primaries():
            if other.name == node.name:
                continue
            try:
                other.valkey_connection.set(self._on(client, other, key), replid)
            except self.errors:
                continue

    def _on(self, client: Any, node: Any, key: str) -> str:
        """``key`` behind a hash tag of one of ``node``'s slots."""
        return "{" + self._tag(client, node) + "}" + key

    def _tag(self, client: Any, node: Any) -> str:
        """A hash tag in the lowest slot ``node`` serves by its own word
        (``CLUSTER NODES``), so every process names the same keys on it
        whatever its map of the slots says (a map is updated a slot at a time
        after a failover, as ``MOVED`` replies come)."""
        tag = _tags.get(node.name)
        if tag is not None:
            return tag
        try:
            slot = _lowest_slot(node.valkey_connection.execute_command("CLUSTER NODES"))
        except ValueError as exc:  # a primary demoted meanwhile: ask again
            raise self.errors[0](f"{node.name}: {exc}") from exc
        tag = _slot_tags.get(slot)
        if tag is None:
            for number in range(1_000_000):
                candidate = f"tasklock-{number}"
                if client.keyslot("{" + candidate + "}") == slot:
                    tag = _slot_tags[slot] = candidate
                    break
            else:  # pragma: no cover (every slot has a tag below 100,000)
                raise RuntimeError(f"no hash tag found in slot {slot}")
        with _mutex:
            _tags[node.name] = tag
        return tag

    @staticmethod
    def _announce(node: Any, what: str, when: str) -> None:
        grace = settings.FAILOVER_GRACE
        refused = (
            f"New locks on it are refused for {grace}s"
            if grace
            else "New locks on it are not refused (RESTART_GRACE is 0)"
        )
        logger.warning(
            "Cluster primary %s %s%s: locks its slots held before may be gone "
            "while their holders still run. %s (TASKLOCK['RESTART_GRACE'], by "
            "default LIVENESS).",
            node.name,
            what,
            when,
            refused,
        )


def forget() -> None:
    """Forget every primary learnt (tests: a new cluster reuses addresses)."""
    with _mutex:
        _learnt.clear()
        _unknown.clear()
        _tags.clear()
