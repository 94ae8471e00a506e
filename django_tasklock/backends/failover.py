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
- a mark of ours on it (``tasklock-primary-mark:{tag}``, a tag in one of its
  slots): the replication id the first process to learn this primary's run
  saw, and since when it runs as primary. A process that comes later finds the
  mark and counts the grace from it, not from its own first sight.

A primary that runs with the mark's replication id is known. One promoted that
the mark does not name took over now (late rather than early: the grace counts
from this sight). One never promoted that restarted (this process knew another
replication id under its address) came back empty: its run started
``uptime`` seconds ago. A primary neither promoted nor seen before is a fresh
node, nothing to refuse.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ..conf import settings

__all__ = ["LEARNT", "MARK_PREFIX", "Promotions"]

logger = logging.getLogger(__name__)

MARK_PREFIX = "tasklock-primary-mark:"
#: How often a process asks a primary it knows again (a restart in place keeps
#: its address; a promotion moves the slot to another address at once).
LEARN_EVERY = 2.0

# Per primary address: (replication id, when its run as primary started on
# time.monotonic(), or None when nothing is refused there, when to ask again).
_learnt: dict[str, tuple[str, float | None, float]] = {}
#: The same table, read by the cluster backend's fast path (a primary known,
#: refusing nothing, and not due to be asked again).
LEARNT = _learnt
_tags: dict[str, str] = {}
_mutex = threading.Lock()


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
        return (
            f"the cluster primary {node.name} took over its slots "
            f"{now - started:.0f}s ago (a failover, or a restart that came back "
            "empty): locks the old primary held may be gone while their holders "
            f"still run, so new locks on it are refused for {math.ceil(left)}s "
            "more (TASKLOCK['RESTART_GRACE'], by default LIVENESS)"
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
        refusing new locks (None: it refuses none), from our mark on it or, for
        the first process to see it, from its INFO; that process writes the
        mark."""
        connection = node.valkey_connection
        replid = str(info["master_replid"])
        started: float | None
        promoted = int(info.get("second_repl_offset", -1)) != -1
        uptime = float(connection.info("server")["uptime_in_seconds"])
        mark_key = MARK_PREFIX + "{" + self._tag(client, node) + "}"
        raw = connection.get(mark_key)
        mark = raw.decode() if isinstance(raw, bytes) else raw
        wall = time.time()
        marked_replid, _, marked_since = (mark or "").partition(" ")
        if mark and marked_replid == replid:
            started = now - max(wall - float(marked_since), 0.0)
        elif promoted:
            started = now
            self._announce(node, "was promoted from a replica", "")
        elif before is not None:  # another run than the one it knew
            started = now - uptime
            self._announce(node, "restarted", f" {uptime:.0f}s ago")
        else:
            started = None  # a fresh primary: nothing it held can be missing
        # Since when the run refuses new locks; 0 (long ago) for none.
        since = 0.0 if started is None else wall - (now - started)
        if not (mark and marked_replid == replid):
            # The first to learn this run says since when it runs, for those
            # that come later (nx: two first sights keep the earlier word).
            connection.set(mark_key, f"{replid} {since:.3f}", nx=True)
        return started

    @staticmethod
    def _tag(client: Any, node: Any) -> str:
        """A hash tag in one of ``node``'s slots (found once per node)."""
        tag = _tags.get(node.name)
        if tag is not None and client.get_node_from_key("{" + tag + "}") is node:
            return tag
        slots = client.nodes_manager.slots_cache
        for number in range(100_000):
            tag = f"tasklock-{number}"
            owners = slots.get(client.keyslot("{" + tag + "}"))
            if owners and owners[0].name == node.name:
                _tags[node.name] = tag
                return tag
        raise RuntimeError(f"no hash tag found in a slot of {node.name}")

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
        _tags.clear()
