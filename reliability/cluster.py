"""Fault cases 44-46: locks on a real Redis Cluster (three primaries, a replica
each) through django-valkey's ClusterValkeyCache. Shared with
``tests/backends/redis/test_cluster.py``, which asserts on the same scenarios.

44. many processes, one lock id: at most one holder at a time;
45. a primary SIGKILLed holding twenty locks it never replicated (its replica cut
    off), the replica promoted: a process that never saw the old primary takes
    none of them while the grace runs (and, the control, every one without it);
46. a lock's hash slot moved between two primaries, keys and all, back and
    forth for as long as a storm runs;
47. and 48. cases 28 and 29 (a Celery pool child SIGKILLed, a whole worker on
    another host SIGKILLed) with the workers' locks on the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reliability.faults import Row
from tests.processes import process_context
from tests.services import Redis, RedisCluster
from tests.workers import hammer, most_at_once, overlaps, storm

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "CLUSTER_CACHE",
    "Failover",
    "Reshard",
    "cluster_storm",
    "during_moves",
    "failover",
    "on_cluster",
    "reshard",
]

CLUSTER_CACHE = "django_valkey.cluster_cache.cache.ClusterValkeyCache"
#: RESTART_GRACE in case 45: short, so that the case also measures when new
#: locks are granted again.
FAILOVER_GRACE = 8.0


@contextlib.contextmanager
def on_cluster(cluster: RedisCluster, alias: str, **tasklock: Any) -> Iterator[str]:
    """CACHES alias ``alias`` on ``cluster``, here and in processes started
    meanwhile, as TASKLOCK's cache."""
    from django.conf import settings
    from django.test import override_settings

    from django_tasklock.backends import close_thread_connections

    config = {alias: {"BACKEND": CLUSTER_CACHE, "LOCATION": cluster.url}}
    before = os.environ.get("TASKLOCK_TEST_EXTRA_CACHES")
    os.environ["TASKLOCK_TEST_EXTRA_CACHES"] = json.dumps(config)
    options = {"CACHE": alias, "LOCK_EXPIRE": 60, **tasklock}
    try:
        with override_settings(CACHES={**settings.CACHES, **config}, TASKLOCK=options):
            yield alias
            close_thread_connections()
    finally:
        if before is None:
            os.environ.pop("TASKLOCK_TEST_EXTRA_CACHES", None)
        else:
            os.environ["TASKLOCK_TEST_EXTRA_CACHES"] = before


def try_to_take(tasklock: dict[str, object], lock_ids: list[str]) -> list[str]:
    """In a process that never saw the cluster before: try each id once; what
    became of each ("taken", "refused", or the error's text)."""
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock, LockBackendError

    settings.TASKLOCK = tasklock
    outcomes = []
    for lock_id in lock_ids:
        try:
            outcomes.append(
                "taken" if Lock(lock_id, expire=60).acquire() else "refused"
            )
        except LockBackendError as exc:
            outcomes.append(str(exc))
    return outcomes


def first_granted(tasklock: dict[str, object], lock_id: str, limit: float) -> float:
    """In a process that never saw the cluster before: try ``lock_id`` every
    0.2 s until it is granted; when (``time.monotonic()``, the machine's
    clock), or -1 if not within ``limit`` seconds."""
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock, LockBackendError

    settings.TASKLOCK = tasklock
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        lock = Lock(lock_id, expire=60)
        with contextlib.suppress(LockBackendError):
            if lock.acquire():
                granted = time.monotonic()
                lock.release()
                return granted
        time.sleep(0.2)
    return -1.0


@dataclass
class Failover:
    """What case 45 measured in one try."""

    ids: list[str]
    #: What a new process got for each id while the grace ran.
    outcomes: list[str]
    #: Holders whose lock was put back in place (their token stored again).
    put_back: int
    #: Holders that found their lock lost once settled (``lock_lost``).
    told: int
    #: Seconds from the kill until the cluster was whole again.
    promoted_after: float
    #: Seconds from the kill until every holder's lock was stored again (put
    #: back, or taken by another).
    settled_after: float
    #: What a new process got for each id once the grace was over.
    later: list[str] = field(default_factory=list)
    #: Seconds from the kill until a new lock on the promoted primary was
    #: granted (-1: not within the grace and 15 s).
    granted_after: float = -1.0
    #: Per id, whether its holder already knew its lock lost (its own
    #: liveness record may have lapsed: a process starved past LIVENESS is
    #: told so) when the later try came.
    knew: list[bool] = field(default_factory=list)

    @property
    def taken(self) -> int:
        """Second holders: a lock taken while its holder still held it by its
        own clock (a holder that knew it lost the lock is not robbed)."""
        knew = self.knew or [False] * len(self.later)
        later = sum(
            o == "taken" and not k for o, k in zip(self.later, knew, strict=True)
        )
        return self.outcomes.count("taken") + later

    @property
    def taken_from_told(self) -> int:
        """Locks taken once the grace was over from holders that knew them lost."""
        return sum(
            o == "taken" and k for o, k in zip(self.later, self.knew, strict=False)
        )

    @property
    def refused_naming(self) -> int:
        """Tries refused naming the promotion (the others, refused as held,
        came after the holders had put their locks back)."""
        return sum("took over its slots" in outcome for outcome in self.outcomes)

    @property
    def refused(self) -> int:
        return self.refused_naming + self.outcomes.count("refused")

    #: The holders' process's longest stall from the kill until its locks
    #: settled (a thread's ticks every 0.1 s, less the tick): past LIVENESS,
    #: a holder may rightly have let its record lapse and lost its locks.
    stalled: float = 0.0


def failover(grace: float, locks: int = 20) -> Failover:
    """On a cluster of its own: ``locks`` locks its victim primary acknowledged
    and never replicated, held by this process (which keeps liveness
    records), the primary SIGKILLed, its replica promoted; then a new process
    tries each of them (``RESTART_GRACE`` = ``grace``), the holders put back
    what they still hold or are told, and once the grace is over a new process
    tries them again and takes a fresh id on the promoted primary."""
    import redis

    from django_tasklock import Lock
    from django_tasklock.backends import backend_for
    from django_tasklock.backends.redis import failover as promotions

    cluster = RedisCluster().start()
    try:
        # LIVENESS no longer than the grace, as by default (the grace is
        # LIVENESS): a holder that could not put its locks back within the
        # grace has let its record lapse too, and knows its locks lost.
        options = {"RESTART_GRACE": grace, "LIVENESS": FAILOVER_GRACE}
        with on_cluster(cluster, "failover", **options) as alias:
            from django.conf import settings

            tasklock = dict(settings.TASKLOCK)
            backend = backend_for(alias)
            # Not the node clients start from (LOCATION): a new client must
            # reach the cluster through it.
            owners = {
                f"failover-{n}": cluster.primary_of(backend.key_for(f"failover-{n}"))
                for n in range(400)
            }
            victim = next(
                node for node in owners.values() if node is not cluster.nodes[0]
            )
            on_victim = [lock_id for lock_id, node in owners.items() if node is victim]
            ids, fresh = on_victim[:locks], on_victim[locks]
            warm = Lock(ids[0])  # this process's connection to the victim, made now
            assert warm.acquire()
            assert warm.release()
            # The replica cannot resync: cut off, and refused by a password set
            # after this process's own connection authenticated.
            cluster.ask(victim, "CONFIG", "SET", "requirepass", "cut-off")
            with redis.Redis(port=victim.port, password="cut-off") as primary:
                primary.execute_command("CLIENT", "KILL", "TYPE", "replica")
            holders = [Lock(lock_id, expire=60) for lock_id in ids]
            assert all(holder.acquire() for holder in holders)
            ticker = Ticker()
            killed_at = time.monotonic()
            victim.stop(signal.SIGKILL)
            cluster.wait_until_ok()
            promoted_after = time.monotonic() - killed_at
            context = process_context()
            with context.Pool(1) as pool:
                outcomes = pool.apply(try_to_take, (tasklock, ids))
                put_back = _settle(backend, holders)
                result = Failover(
                    ids,
                    outcomes,
                    put_back,
                    # Told now (lock_lost), if not before: a lock taken by
                    # another is not put back, and its holder learns of it
                    # when it next looks (a check, a renewal, its release).
                    sum(not holder.owned() for holder in holders),
                    promoted_after,
                    time.monotonic() - killed_at,
                )
                result.stalled = ticker.stop()
                if grace:
                    limit = grace + 15
                    granted = pool.apply(first_granted, (tasklock, fresh, limit))
                    if granted > 0:
                        result.granted_after = granted - killed_at
                    result.knew = [holder.lost for holder in holders]
                    result.later = pool.apply(try_to_take, (tasklock, ids))
            for holder in holders:
                holder.release_quietly()
            return result
    finally:
        promotions.forget()
        cluster.stop()


class Ticker:
    """A thread that ticks every 0.1 s until stopped; the longest gap between
    two ticks past the 0.1 s asked: how long this process stood still."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._over.wait(0.1):
            now = time.monotonic()
            self.longest = max(self.longest, now - last - 0.1)
            last = now

    def stop(self) -> float:
        self._over.set()
        self._thread.join()
        return self.longest


def _settle(backend: Any, holders: list[Any], limit: float = 20.0) -> int:
    """Wait until every holder's lock is stored again: put back by its holder
    (its token) or taken by another; how many were put back. Read from the
    store, not through ``owned()``, which would report a missing lock lost
    before its holder's next beat could put it back."""
    deadline = time.monotonic() + limit
    while True:
        stored = [backend.peek(holder.acquisition.key) for holder in holders]
        if all(peek is not None for peek in stored) or time.monotonic() > deadline:
            return sum(
                peek is not None and peek.value == holder.token
                for peek, holder in zip(stored, holders, strict=True)
            )
        time.sleep(0.1)


@dataclass
class Reshard:
    """What case 46 measured."""

    holds: list[tuple[float, float]]
    #: Keys moved with each move of the slot.
    moves: list[int] = field(default_factory=list)
    #: When each move began and ended (``time.monotonic()``, the holds' clock).
    spans: list[tuple[float, float]] = field(default_factory=list)
    #: The lock of the same slot held throughout: still its holder's after.
    kept: bool = False
    #: Its fence was drawn before and a new holder's after was greater.
    fence_grew: bool = False
    #: Seconds from its take to the check that it was kept.
    kept_for: float = 0.0


def reshard(cluster: RedisCluster, alias: str, wanted: int) -> Reshard:
    """Eight processes take and release one lock ``wanted`` times between them
    while its slot moves between two primaries, back and forth for as long as
    they run, keys and all; a lock of the same slot is held throughout."""
    from django.conf import settings

    from django_tasklock import Lock
    from django_tasklock.backends import backend_for

    key = backend_for(alias).key_for("reshard-storm")
    slot_number = int(cluster.ask(cluster.nodes[0], "CLUSTER", "KEYSLOT", key))
    first = cluster.primary_of(key)
    second = next(
        node
        for node in cluster.nodes
        if node is not first
        and node.process is not None
        and cluster.ask(node, "INFO", "replication").get("role") == "master"
    )
    result = Reshard([])
    over = threading.Event()

    def move_back_and_forth() -> None:
        source, target = first, second
        while not over.is_set():
            began = time.monotonic()
            result.moves.append(cluster.move_slot(slot_number, source, target))
            result.spans.append((began, time.monotonic()))
            source, target = target, source
            over.wait(0.3)

    # A lock of the same group (so in the same slot) held throughout, with its
    # fencing counter: keys that move with every move of the slot. Not renewed,
    # so it outlives the whole run (a storm's eight processes starting beside
    # two CPU hogs took it past a 60 s expiry: gone, not moved away).
    keeper = Lock("reshard-storm-run-keeper", expire=600)
    assert keeper.acquire()
    fence = keeper.fence
    mover = threading.Thread(target=move_back_and_forth)
    try:
        mover.start()
        results = storm(
            hammer, 8, wanted, (dict(settings.TASKLOCK), "reshard-storm"), ("lock",)
        )
    finally:
        over.set()
        mover.join()
    result.holds = [hold for process_holds, _ in results for hold in process_holds]
    result.kept_for = time.monotonic() - keeper.acquired_at  # type: ignore[operator]
    result.kept = keeper.owned() and keeper.extend(60)
    rival = Lock("reshard-storm-run-keeper", expire=60)
    result.kept = result.kept and not rival.acquire() and keeper.release()
    result.fence_grew = rival.acquire() and (rival.fence or 0) > (fence or 0)
    rival.release()
    return result


def run(redis: Redis, quick: bool) -> list[Row]:
    cluster = RedisCluster().start()
    rows = []
    try:
        with on_cluster(cluster, "cluster"):
            rows.append(_storm_row(quick))
            rows.append(_reshard_row(cluster, quick))
            rows += _celery_rows(redis, 1 if quick else 3)
        rows.append(_failover_row(quick))
    finally:
        cluster.stop()
    return sorted(rows, key=lambda row: int(row.case.split(".", 1)[0]))


def _celery_rows(redis: Redis, tries: int) -> list[Row]:
    """Cases 28 and 29 with the locks on the cluster: real ``celery worker``
    processes whose TASKLOCK CACHE is the cluster alias."""
    from reliability import recovery
    from reliability.calls import _broker
    from tests import tasks
    from tests.workers import start_workers, stop_workers

    broker = _broker(redis)
    tasks.forget_runs()
    before = os.environ.get("TASKLOCK_TEST_CACHE")
    os.environ["TASKLOCK_TEST_CACHE"] = "cluster"  # the workers', here and far
    try:
        workers = start_workers(broker, ["fault-cluster"], concurrency=4)
        try:
            return [
                recovery.child_killed(tries, "47. cluster: pool child SIGKILLed"),
                recovery.worker_killed_elsewhere(
                    broker, tries, "48. cluster: worker elsewhere SIGKILLed"
                ),
            ]
        finally:
            stop_workers(workers)
    finally:
        if before is None:
            os.environ.pop("TASKLOCK_TEST_CACHE", None)
        else:
            os.environ["TASKLOCK_TEST_CACHE"] = before


def cluster_storm(wanted: int) -> tuple[list[tuple[float, float]], int]:
    """Eight processes take and release one lock id on TASKLOCK's cache until
    they have held it ``wanted`` times: their holds, and their refused tries."""
    from django.conf import settings

    tasklock = dict(settings.TASKLOCK)
    results = storm(hammer, 8, wanted, (tasklock, "cluster-storm"), ("lock",))
    holds = [hold for process_holds, _ in results for hold in process_holds]
    return holds, sum(count for _, count in results)


def _storm_row(quick: bool) -> Row:
    started = time.monotonic()
    holds, refused = cluster_storm(1000 if quick else 5000)
    spent = time.monotonic() - started
    most = most_at_once(holds)
    row = Row(
        "44. cluster: contention, 8 processes, one id",
        len(holds) + refused,
        overlaps(holds),
        int(most > 1),
    )
    row.figures.append(
        f"{len(holds)} acquisitions (the storm's target) in {spent:.1f}s, "
        f"{len(holds) / spent:.0f}/s; {refused} refused; most at once {most}"
    )
    return row


def during_moves(result: Reshard) -> int:
    """Holds that began while the slot was moving (its keys half on each
    primary: ASK redirections)."""
    return sum(
        any(began <= start <= ended for began, ended in result.spans)
        for start, _ in result.holds
    )


def _reshard_row(cluster: RedisCluster, quick: bool) -> Row:
    result = reshard(cluster, "cluster", 1000 if quick else 5000)
    wrong = int(not result.kept) + int(not result.fence_grew)
    wrong += sum(moved < 2 for moved in result.moves)
    amid = during_moves(result)
    wrong += int(len(result.moves) < 2 or not amid)  # the storm never met a move
    row = Row(
        "46. cluster: slot moved under a storm",
        len(result.holds),
        overlaps(result.holds),
        wrong,
    )
    row.figures.append(
        f"slot moved {len(result.moves)} times ({sum(result.moves)} keys) while "
        f"the storm ran, {amid} of its holds begun mid-move; "
        f"the lock held throughout kept {int(result.kept)}/1, fence grew "
        f"{int(result.fence_grew)}/1"
    )
    return row


def _failover_row(quick: bool) -> Row:
    tries = 1 if quick else 3
    attempts = wrong = second = refused = naming = back = from_told = knew = 0
    promoted: list[float] = []
    settled: list[float] = []
    granted: list[float] = []
    stalls: list[float] = []
    for _ in range(tries):
        result = failover(grace=FAILOVER_GRACE)
        attempts += len(result.ids)
        second += result.taken
        refused += result.refused
        naming += result.refused_naming
        back += result.put_back
        from_told += result.taken_from_told
        knew += sum(result.knew)
        # Every holder keeps its lock (put back) or, only if its process
        # stood still for half of LIVENESS or more (measured), may know it
        # lost it; a fresh lock is granted once the grace is over.
        missing = len(result.ids) - result.put_back
        if result.stalled >= FAILOVER_GRACE / 2:
            missing = max(0, missing - sum(result.knew))
        wrong += result.taken + missing
        stalls.append(result.stalled)
        wrong += int(result.granted_after < 0)
        promoted.append(result.promoted_after)
        settled.append(result.settled_after)
        granted.append(result.granted_after)
    control = failover(grace=0)
    row = Row(
        "45. cluster primary killed, 20 unreplicated",
        attempts,
        second,
        wrong,
    )
    row.figures.append(
        f"second holders {second}/{attempts} (during and after the "
        f"{FAILOVER_GRACE:.0f}s grace); refused {refused}/{attempts} ({naming} "
        f"naming the promotion, the others held again); put back by their live "
        f"holders {back}/{attempts} (holders starved past LIVENESS that knew "
        f"their lock lost {knew}, taken from them once the grace was over "
        f"{from_told}; the holders' process stood still {max(stalls):.1f}s "
        f"at most), "
        f"{max(settled):.1f}s after the kill at most; replica promoted "
        f"{min(promoted):.1f}-{max(promoted):.1f}s after the kill; new locks "
        f"granted again {min(granted):.1f}-{max(granted):.1f}s after it; without "
        f"the grace {control.taken}/{len(control.ids)} retaken and "
        f"{control.told} holders told"
    )
    wrong_control = control.taken != len(control.ids)  # the case did not happen
    row.wrong += int(wrong_control or control.told != len(control.ids))
    return row
