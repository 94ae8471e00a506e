"""Locks on a real Redis Cluster (three primaries, a replica each) through
django-valkey's ClusterValkeyCache: every key of one lock in one hash slot,
owner checks that survive NOSCRIPT, and many processes that never overlap."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import pytest
from django.core.cache import caches

from django_tasklock import Lock, Semaphore, memcache_lock
from django_tasklock.backends import backend_for
from django_tasklock.console import take_inventory
from django_tasklock.keys import fence_id, lock_group
from reliability.cluster import (
    FAILOVER_GRACE,
    cluster_storm,
    during_moves,
    failover,
    reshard,
)
from tests.workers import Holder, most_at_once, overlaps

if TYPE_CHECKING:
    from tests.services import RedisCluster

CLUSTER = "django_valkey.cluster_cache.cache.ClusterValkeyCache"


@pytest.fixture
def on_cluster(redis_cluster: RedisCluster, settings: object) -> RedisCluster:
    """The session's cluster (the CACHES alias ``cluster``, here and in the
    processes the tests spawn), emptied, as TASKLOCK's cache."""
    settings.TASKLOCK = {"CACHE": "cluster", "LOCK_EXPIRE": 60}  # type: ignore[attr-defined]
    redis_cluster.flush()
    return redis_cluster


def slot(cluster: RedisCluster, key: str) -> int:
    return int(cluster.ask(cluster.nodes[0], "CLUSTER", "KEYSLOT", key))


def test_a_lock_its_fence_and_its_derived_ids_share_one_slot(on_cluster):
    backend = backend_for("cluster")
    ids = [
        "feed-1",
        fence_id("feed-1"),
        "feed-1#slot-2",
        "feed-1-run-abc",
        "feed-1-queued",
    ]
    assert {lock_group(lock_id) for lock_id in ids} == {"feed-1"}
    assert len({slot(on_cluster, backend.key_for(lock_id)) for lock_id in ids}) == 1
    # Other locks spread over the primaries.
    primaries = {
        on_cluster.primary_of(backend.key_for(f"feed-{n}")).port for n in range(40)
    }
    assert len(primaries) == 3


def test_lock_cycle_with_fence_extend_and_owner_checks(on_cluster):
    lock = Lock("cycle", expire=30)
    assert lock.acquire()
    # The fence script touches the lock and its counter: one slot, no CROSSSLOT.
    first = lock.fence
    assert isinstance(first, int)
    rival = Lock("cycle", expire=30)
    assert not rival.acquire()
    assert lock.extend(40) and 30 < lock.ttl() <= 40  # type: ignore[operator]
    assert lock.release() and not lock.locked()
    assert rival.acquire() and rival.fence > first  # type: ignore[operator]
    assert rival.release()
    with memcache_lock("recipe", "oid") as acquired:
        assert acquired
        with memcache_lock("recipe", "oid") as again:
            assert not again


def test_release_is_owner_checked_after_the_primaries_forget_their_scripts(on_cluster):
    """NOSCRIPT (a failover, a restart, SCRIPT FLUSH) never turns a release into
    an error nor into an unchecked delete: the script is sent whole."""
    lock = Lock("noscript", expire=30)
    assert lock.acquire()
    backend = backend_for("cluster")
    key = backend.key_for("noscript")
    primary = on_cluster.primary_of(key)
    # Another owner's lock now stands where this holder's was.
    on_cluster.ask(primary, "SCRIPT", "FLUSH")
    raw = backend.raw(key)
    assert raw is not None
    backend._redis(key).set(key, backend._encode("someone-else"), px=30_000)
    on_cluster.ask(primary, "SCRIPT", "FLUSH")
    assert not lock.release()  # told lost, and the other owner's lock left alone
    assert backend.peek(key).value == "someone-else"  # type: ignore[union-attr]
    backend._redis(key).delete(key)
    again = Lock("noscript", expire=30)
    assert again.acquire()
    on_cluster.ask(primary, "SCRIPT", "FLUSH")
    assert again.release() and not again.locked()


def test_a_semaphores_slots_are_read_in_one_slot(on_cluster):
    holders = [Semaphore("sem", 3, expire=30) for _ in range(4)]
    assert [holder.acquire() for holder in holders] == [True, True, True, False]
    for holder in holders[:3]:
        assert holder.release()
    assert holders[3].acquire() and holders[3].release()


@pytest.mark.slow
def test_eight_processes_never_overlap_on_the_cluster(on_cluster):
    holds, refused = cluster_storm(1000)
    assert len(holds) >= 1000 and refused > 0
    assert overlaps(holds) == 0 and most_at_once(holds) == 1


@pytest.mark.parametrize(
    ("backend", "options", "says"),
    [
        (
            CLUSTER,
            {"BASE_CLIENT_KWARGS": {"read_from_replicas": True}},
            "read_from_replicas",
        ),
        (
            "django_valkey.cache.ValkeyCache",
            {"CLIENT_CLASS": "django_valkey.client.ShardClient"},
            "DefaultClient",
        ),
        (
            CLUSTER,
            {"CLIENT_CLASS": "django_valkey.client.DefaultClient"},
            "Give locks an alias with that client",
        ),
    ],
)
def test_valkey_aliases_that_cannot_lock_are_refused(
    settings, redis_cluster, backend, options, says
):
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from django_tasklock import LockConfigurationError

    location = redis_cluster.url if backend == CLUSTER else "redis://127.0.0.1:1/0"
    config = {"BACKEND": backend, "LOCATION": location, "OPTIONS": options}
    settings.CACHES = {**settings.CACHES, "refused": config}
    settings.TASKLOCK = {"CACHE": "refused"}
    with pytest.raises(LockConfigurationError, match=says):
        Lock("refused").acquire()
    with pytest.raises(SystemCheckError, match=r"django_tasklock\.E004"):
        call_command("check")


def test_standalone_valkey_cache_locks_on_its_primary(settings, redis_server):
    """django-valkey's ValkeyCache on one server (valkey-py talks to Redis 7 as
    to Valkey): the lock, its owner read back through the cache, its fence."""
    config = {
        "BACKEND": "django_valkey.cache.ValkeyCache",
        "LOCATION": redis_server.url,
    }
    settings.CACHES = {**settings.CACHES, "valkey": config}
    settings.TASKLOCK = {"CACHE": "valkey", "LOCK_EXPIRE": 30}
    lock = Lock("standalone", oid="me")
    assert lock.acquire() and isinstance(lock.fence, int)
    assert caches["valkey"].get("standalone").startswith("me@")
    assert not Lock("standalone").acquire()
    assert lock.release() and caches["valkey"].get("standalone") is None
    backend = backend_for("valkey")
    assert backend.kind == "Valkey"
    # Its own pickling of a token is byte for byte the client's encode().
    assert backend._pickled is not None
    client = caches["valkey"].client
    assert backend._encode("me@host:1-2-x:ab:3:4") == client.encode(
        "me@host:1-2-x:ab:3:4"
    )


def test_a_compressed_valkey_alias_encodes_through_its_client(settings, redis_server):
    compressor = "django_valkey.compressors.zlib.ZlibCompressor"
    config = {
        "BACKEND": "django_valkey.cache.ValkeyCache",
        "LOCATION": redis_server.url,
        "OPTIONS": {"COMPRESSOR": compressor, "CACHE_COMPRESS_MIN_LENGTH": 1},
    }
    settings.CACHES = {**settings.CACHES, "zipped": config}
    settings.TASKLOCK = {"CACHE": "zipped", "LOCK_EXPIRE": 30}
    lock = Lock("zipped", oid="me")
    assert lock.acquire()
    assert backend_for("zipped")._pickled is None
    assert caches["zipped"].get("zipped").startswith("me@")
    assert lock.release()


@pytest.mark.parametrize("kind", ["window", "smooth"])
def test_rate_limits_decide_in_the_slots_primary(on_cluster, kind):
    from django_tasklock import RateLimiter

    limiter = RateLimiter(f"cluster-{kind}", "3/20s", kind=kind)
    admissions = [limiter.admit() for _ in range(4)]
    assert [bool(a) for a in admissions] == [True, True, True, False]
    assert 0 < admissions[-1].retry_after <= 20
    assert limiter.state()["kind"] == kind
    assert limiter.reset() is True and limiter.admit()


def test_single_instance_skips_a_duplicate_and_status_reads_the_holder(on_cluster):
    from django.core.management import call_command

    from django_tasklock import single_instance

    ran = []

    @single_instance(on_contention="skip")
    def job(feed: str) -> str:
        ran.append(feed)
        # The same call while this one runs: skipped, not run twice.
        assert job(feed) is None
        return "done"

    assert job("a") == "done" and ran == ["a"]
    lock = Lock("status-on-cluster", expire=60, oid="worker-1")
    assert lock.acquire()
    fence = lock.fence
    from io import StringIO

    out = StringIO()
    call_command("tasklock", "status", "status-on-cluster", stdout=out)
    text = out.getvalue()
    assert "worker-1@" in text and str(fence) in text, text
    assert lock.release()


def test_a_live_holder_on_another_host_keeps_its_lock(on_cluster, settings, caplog):
    """A holder on another host (a hostname of its own) renews its liveness
    record beside its lock, in the lock's hash slot. A contender here looks
    at it (crash recovery, every half second) for longer than LIVENESS and
    must find it alive each time: read anywhere else, the record is missing
    and the live holder's lock is taken.

    A take is a robbery only while the holder still believes it holds: one
    whose holder was told (its record's renewal starved past LIVENESS, as
    two CPU hogs beside the suite can do) is the safe direction, and the
    window starts again with a new holder, three times at most."""
    settings.TASKLOCK = {"CACHE": "cluster", "LOCK_EXPIRE": 60, "LIVENESS": 3}
    for window in range(3):
        holder = Holder("cluster", "held-elsewhere", host="elsewhere-1", liveness=3)
        try:
            looks = 0
            started = time.monotonic()
            while time.monotonic() - started < 3 * 3:
                taker = Lock("held-elsewhere")
                with caplog.at_level(logging.WARNING, logger="django_tasklock"):
                    taken = taker.acquire()
                if taken:
                    believed = holder.ask("check")
                    evidence = on_cluster.evidence()
                    taker.release()
                    assert believed.startswith("check False"), (
                        f"a live holder robbed {time.monotonic() - started:.2f}s "
                        f"into window {window} (it {holder.ask('stall')}, "
                        f"{holder.ask('record')}); the "
                        f"contender said: {caplog.text}\nthe nodes:\n{evidence}"
                    )
                    print(f"window {window}: the holder starved and was told")
                    break
                looks += 1
                time.sleep(0.5)
            else:
                assert looks >= 10
                assert holder.ask("check").startswith("check True")
                assert holder.ask("release") == "released True"
                return
        finally:
            holder.close()
    raise AssertionError("the holder starved in each of three windows")


def test_a_lock_is_never_taken_without_its_holders_record_beside_it(
    on_cluster, settings
):
    """A take writes the holder's liveness record beside the lock, in the
    same script, every time: a record written moments before may be gone (a
    flush, an eviction, a failover), and a lock found without one is its
    holder's dead to a contender on another host. (The checker's find, seed
    20261129, cluster: the take skipped the record it had written within
    half its life, a flush had removed it, and a live holder was robbed.)"""
    from django_tasklock.backends import backend_for

    settings.TASKLOCK = {"CACHE": "cluster", "LOCK_EXPIRE": 60, "LIVENESS": 5}
    backend: Any = backend_for("cluster")
    first = Lock("beside-its-record")
    assert first.acquire()
    key = backend.key_for("beside-its-record")
    record_key = backend._record_key(key)
    client = backend._redis(key)
    assert client.exists(record_key) == 1
    assert first.release()
    client.delete(record_key)  # what a flush of that primary does
    again = Lock("beside-its-record")
    assert again.acquire()
    try:
        assert client.exists(record_key) == 1, "a lock without its holder's record"
    finally:
        again.release()


@pytest.mark.slow
@pytest.mark.parametrize(
    "grace", [0, FAILOVER_GRACE], ids=["no grace (control)", "grace"]
)
def test_a_failover_that_lost_locks_grants_none_of_them_again(grace):
    """Twenty locks acknowledged by a primary that never replicated them (its
    replica cut off), held by this process, then the primary SIGKILLed and its
    replica promoted. A process that never saw the old primary takes none of
    them while the grace runs; the holders, alive, put every one back, so
    after the grace it still takes none, while a fresh lock on that primary
    is granted. Without the grace (the control) it takes every one: twenty
    second holders, which is what the grace exists to prevent, and each
    holder is told."""
    result = failover(grace)
    assert len(result.ids) == 20
    if grace == 0:
        assert result.taken == 20, result.outcomes
        assert result.told == 20 and result.put_back == 0
    else:
        assert result.taken == 0, (result.outcomes, result.later)
        # Refused naming the promotion, or as held once put back.
        assert result.refused == 20, result.outcomes
        assert result.put_back == 20 and result.told == 0
        assert result.later == ["refused"] * 20, result.later
        # Granted once the grace, counted from the promotion's first sight,
        # is over: not before the kill plus the grace; and not refused for
        # long after (15 s of slack: a fully loaded machine starts the taking
        # process's tries late).
        assert grace <= result.granted_after <= result.promoted_after + grace + 15


@pytest.mark.slow
def test_a_slot_moved_back_and_forth_under_a_storm_loses_and_doubles_nothing(
    on_cluster,
):
    """Eight processes take and release one lock while its hash slot moves
    between two primaries, keys and all, for as long as they run: every release finds its
    own lock (a lost one fails the hammer), and no two holds overlap; a lock of
    the same slot held throughout moves with its fence and stays its holder's."""
    result = reshard(on_cluster, "cluster", 3000)
    assert len(result.moves) >= 2, result.moves
    assert all(moved >= 2 for moved in result.moves), result.moves
    assert during_moves(result) > 0  # the storm met the moves
    assert len(result.holds) >= 3000
    assert overlaps(result.holds) == 0 and most_at_once(result.holds) == 1
    assert result.kept, f"the lock held throughout, checked {result.kept_for:.1f}s on"
    assert result.fence_grew


def test_the_console_reads_sixteen_hash_slots_of_a_clusters_roster(
    redis_cluster, settings
):
    """Listing every lock of a cluster costs what listing one server does, not
    one read per roster slot: the 1,024 roster slots sit 64 to a hash slot, so
    the listing is 16 MGETs, pipelined (a round trip per primary that serves
    any), and its restart check asks only those primaries. The MGETs are
    counted from each primary's MONITOR stream, by this test's own key prefix
    (other test processes share the cluster)."""
    import uuid

    import redis

    from django_tasklock.keys import ROSTER_GROUP, ROSTER_SLOTS
    from django_tasklock.locks.roster import read_roster

    prefix = f"listing-{uuid.uuid4().hex[:8]}"
    config = {**settings.CACHES["cluster"], "KEY_PREFIX": prefix}
    settings.CACHES = {**settings.CACHES, "listing": config}
    settings.TASKLOCK = {"CACHE": "listing", "LOCK_EXPIRE": 60}
    lock = Lock("listed-on-cluster", expire=60)
    assert lock.acquire()
    # Listed: this process's liveness thread has claimed its roster slot (a
    # read of every slot, 16 MGETs of its own) before the count begins.
    deadline = time.monotonic() + 30
    while lock.lock_id not in [e.lock_id for e in take_inventory(["listing"]).listed()]:
        assert time.monotonic() < deadline, "the lock was never listed"
        time.sleep(0.05)
    backend = backend_for("listing")
    primaries = [
        node
        for node in redis_cluster.nodes
        if node.process is not None
        and redis_cluster.ask(node, "INFO", "replication").get("role") == "master"
    ]
    marker = f"end-of-{prefix}"
    mgets = 0
    clients = [redis.Redis(port=node.port) for node in primaries]
    try:
        monitors = [client.monitor() for client in clients]
        for monitor in monitors:
            monitor.__enter__()
        read_roster(backend)
        for node in primaries:
            redis_cluster.ask(node, "ECHO", marker)
        for monitor in monitors:
            while (command := monitor.next_command()["command"]) != f"ECHO {marker}":
                # The listing's reads: ROSTER_GROUP roster keys each (the
                # liveness thread's beat reads back its own slot alone).
                mgets += (
                    command.startswith("MGET ")
                    and prefix in command
                    and len(command.split()) - 1 == ROSTER_GROUP
                )
    finally:
        for client in clients:
            client.close()
    assert mgets == ROSTER_SLOTS // ROSTER_GROUP == 16
    asked = backend.uptimes()
    assert 1 <= len(asked) <= len(primaries)
    assert lock.release()


@pytest.mark.parametrize(
    ("prefix", "check", "locks"),
    [
        ("site}a", "django_tasklock.E022", False),
        ("{site}", "django_tasklock.W004", True),
    ],
    ids=["braces that are no tag", "a tag of its own"],
)
def test_a_cluster_alias_whose_keys_carry_braces_is_checked(
    redis_cluster, settings, prefix, check, locks
):
    """A KEY_PREFIX with a lone '}' would leave a lock's fencing counter and
    records out of its slot: an error, and the first lock refuses. One with a
    tag of its own puts every lock in one slot: a warning, and locks hold."""
    from django.core.checks import run_checks

    from django_tasklock import LockConfigurationError

    config = {"BACKEND": CLUSTER, "LOCATION": redis_cluster.url, "KEY_PREFIX": prefix}
    settings.CACHES = {**settings.CACHES, "tagged": config}
    settings.TASKLOCK = {"CACHE": "tagged", "LOCK_EXPIRE": 60}
    found = [m for m in run_checks() if m.id.startswith("django_tasklock.")]
    assert [m.id for m in found] == [check], found
    assert "Use a KEY_PREFIX" in found[0].hint
    lock = Lock("tagged-lock")
    if locks:
        assert lock.acquire() and lock.fence and lock.release()
    else:
        with pytest.raises(LockConfigurationError, match="E022"):
            lock.acquire()
    caches["tagged"].close()


def test_a_cluster_node_whose_port_is_taken_starts_on_another():
    """A port pair taken between the check and the server's bind (another
    session's listener): the node starts on another pair, and the cluster
    forms."""
    import socket

    from tests.services import Redis, RedisCluster, _cluster_port

    taken = _cluster_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", taken + 10000))  # its bus port
    blocker.listen()
    cluster = RedisCluster()
    cluster.nodes[0] = Redis(args=cluster._node_args(0), port=taken)
    try:
        cluster.start()
        assert cluster.nodes[0].port != taken
        assert cluster.ask(cluster.nodes[0], "CLUSTER", "INFO").startswith(
            "cluster_state:ok"
        )
    finally:
        cluster.stop()
        blocker.close()
