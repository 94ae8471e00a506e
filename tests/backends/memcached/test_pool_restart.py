"""A memcached node of a pool SIGKILLed and restarted empty while holders run.

The locks it held are gone, but their holders still run. A process that never
saw the node before must not hand those ids out again while the old holders'
locks would still be valid: new locks on a restarted node are refused for
RESTART_GRACE seconds (LOCK_EXPIRE by default), learnt from the records each
process leaves on the pool's other nodes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import backend_for
from tests.helpers import close_connections
from tests.processes import process_context
from tests.services import Memcached
from tests.workers import hold_and_restart_busiest, setup_django, take_until_all

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
EXPIRE = 4
IDS = [f"pool-{n}" for n in range(60)]


@pytest.fixture
def pool(settings):
    servers = [Memcached().start() for _ in range(3)]
    caches_setting = {
        **settings.CACHES,
        "pool": {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in servers]},
    }
    settings.CACHES = caches_setting
    # Without liveness records: these tests measure the grace alone (then
    # LOCK_EXPIRE), not the holders putting their locks back (tests/
    # test_recovery.py and fault row 32 do).
    settings.TASKLOCK = {"CACHE": "pool", "LOCK_EXPIRE": EXPIRE, "LIVENESS": None}
    yield servers
    close_connections()
    for server in servers:
        server.stop()


def hold_all_and_restart_one(servers):
    """Take every id here; SIGKILL the node holding the most and restart it."""
    locks, valid_until, on_victim = hold_and_restart_busiest(servers, "pool", IDS)
    assert 5 <= len(on_victim) < len(IDS), "the ids did not spread over the pool"
    return locks, valid_until, on_victim


@pytest.fixture
def second_process():
    """A fresh process, started and set up before anything restarts: the
    grace runs from the restart, and a busy machine may take seconds to start
    a process and set Django up."""
    context = process_context()
    with context.Pool(1, initializer=setup_django) as workers:
        workers.apply(os.getpid)  # started, and set up
        yield workers


def second_holders(workers, settings, tasklock):
    """The fresh process takes every id; when it took each, the errors it met
    on the way and the last of them."""
    return workers.apply(take_until_all, (settings.CACHES, tasklock, IDS, EXPIRE + 6))


@pytest.mark.slow
def test_a_restarted_node_hands_out_no_lock_a_live_holder_still_has(
    settings, pool, second_process
):
    locks, valid_until, on_victim = hold_all_and_restart_one(pool)
    restarted_at = time.monotonic()
    result = second_holders(
        second_process,
        settings,
        {"CACHE": "pool", "LOCK_EXPIRE": EXPIRE, "LIVENESS": None},
    )
    taken = result["taken"]
    early = {i: valid_until[i] - at for i, at in taken.items() if at < valid_until[i]}
    # Said apart: an early take on the restarted node is a grace that did not
    # hold; one on another node, a lock that server dropped before the
    # holder's count of its sure life ran out.
    assert early == {}, (
        f"second holders while the first still held (seconds early): {early}; "
        f"on the restarted node: {sorted(set(early) & set(on_victim))}; taken "
        f"{[round(taken[i] - restarted_at, 2) for i in sorted(early)]}s after "
        f"the restart; errors met: {result['errors']}, the last: "
        f"{result['last_error'][:300]!r}"
    )
    assert set(taken) == set(IDS), "not every id was taken once its lock had gone"
    assert result["errors"] > 0 and "restarted" in result["last_error"], result
    # The restarted node's ids waited out the grace, counted from its start.
    waited = min(taken[i] for i in on_victim) - restarted_at
    assert waited >= EXPIRE - 2, waited
    # The first holders learn of the loss at their release.
    assert sum(not lock.release() for lock in locks) >= len(on_victim)


@pytest.mark.slow
def test_without_the_grace_the_restarted_node_hands_its_ids_out_again(
    settings, pool, second_process
):
    """The same measurement with RESTART_GRACE 0: second holders appear, so
    the zero above is the grace's doing. (Locks of 30 s here, so that a slow
    start of the second process cannot outlast them.)"""
    settings.TASKLOCK = {"CACHE": "pool", "LOCK_EXPIRE": 30, "LIVENESS": None}
    _locks, valid_until, on_victim = hold_all_and_restart_one(pool)
    result = second_holders(
        second_process,
        settings,
        {"CACHE": "pool", "LOCK_EXPIRE": 30, "RESTART_GRACE": 0, "LIVENESS": None},
    )
    early = {i for i, at in result["taken"].items() if at < valid_until[i]}
    assert early == set(on_victim)


def id_on_first_node(settings, pool):
    """A 60 s grace, no liveness records; the pool's first node and an id on it."""
    settings.TASKLOCK = {
        "CACHE": "pool",
        "LOCK_EXPIRE": EXPIRE,
        "RESTART_GRACE": 60,
        "LIVENESS": None,
    }
    victim = pool[0]
    backend = backend_for("pool")
    lock_id = next(
        i for i in IDS if backend._client(backend.key_for(i)).server[1] == victim.port
    )
    return victim, lock_id


def test_this_process_refuses_a_node_it_saw_restart(settings, pool, caplog):
    victim, lock_id = id_on_first_node(settings, pool)
    holder = Lock(lock_id)
    assert holder.acquire()  # a node first seen (a new deployment): not refused
    victim.stop(signal.SIGKILL)
    with pytest.raises(LockBackendError, match="ConnectionRefused"):
        Lock(lock_id).acquire()  # down: a clear error, never another node
    victim.start()
    with pytest.raises(LockBackendError, match=r"RESTART_GRACE") as refused:
        Lock(lock_id).acquire()
    assert "restarted" in str(refused.value)
    assert any("came back empty" in r.getMessage() for r in caplog.records)
    assert holder.release() is False  # its lock went with the restart
    # The grace over (here: set to 0), the node gives out locks again.
    settings.TASKLOCK = {
        "CACHE": "pool",
        "LOCK_EXPIRE": EXPIRE,
        "RESTART_GRACE": 0,
        "LIVENESS": None,
    }
    assert Lock(lock_id).acquire()


def test_django_client_fails_instead_of_rehashing_with_these_options(settings, pool):
    """The cookbook recipe goes through Django's client, whose pymemcache
    HashClient moves a dead node's keys to the others after retry_attempts
    failures. With retry_attempts high and retry_timeout 0 it raises instead."""
    victim = pool[0]
    settings.CACHES = {
        **settings.CACHES,
        "failing": {
            "BACKEND": MEMCACHED,
            "LOCATION": [s.address for s in pool],
            "OPTIONS": {"retry_attempts": 1_000_000, "retry_timeout": 0},
        },
        "rehashing": {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in pool]},
    }
    client = caches["failing"]._cache
    key = next(
        k
        for k in (f"recipe-{n}" for n in range(200))
        if client._get_client(caches["failing"].make_key(k)).server[1] == victim.port
    )
    victim.stop(signal.SIGKILL)
    for _ in range(20):
        with pytest.raises(ConnectionRefusedError):
            caches["failing"].add(key, "true", 60)
    # Django's defaults: refused once, then False ("held", silently), then the
    # key moves to another node and add() succeeds there: a second holder.
    results = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and True not in results:
        try:
            results.append(caches["rehashing"].add(key, "true", 60))
        except ConnectionRefusedError:
            results.append("refused")
        time.sleep(0.1)
    assert "refused" in results and False in results and results[-1] is True, results
    victim.start()


def as_a_fresh_process():
    """Forget what this process learnt of the servers' runs, and its
    connections: as a process started now would be."""
    from django_tasklock.backends.memcached import restarts

    close_connections()
    with restarts._runs_mutex:
        restarts._runs.clear()
    restarts._refused.clear()


def test_a_process_that_learns_of_the_restart_later_still_refuses(settings, pool):
    """The first process to see the restart records the new run on the pool's
    other nodes; a process that never saw the old run reads that record, and
    must still know the run is a restart (it is marked so), not a new
    deployment. Before the mark, a holder's liveness thread that reconnected
    first made every later process hand the ids out at once."""
    victim, lock_id = id_on_first_node(settings, pool)
    assert Lock(lock_id).acquire()  # learns the run, records it
    victim.stop(signal.SIGKILL)
    victim.start()
    with pytest.raises(LockBackendError, match="RESTART_GRACE"):
        Lock(lock_id).acquire()  # sees the restart, records the new run
    as_a_fresh_process()
    with pytest.raises(LockBackendError, match="RESTART_GRACE"):
        Lock(lock_id).acquire()


def test_a_node_whose_run_record_no_other_node_answers_for_is_taken_for_restarted(
    settings, pool, caplog
):
    """A process that never saw the node before reads the record of its run on
    the pool's other nodes. When none of them answers, it cannot tell a
    restart from a new deployment: "could not tell" is never "fine", so new
    locks on the node wait out the grace (counted from the node's start) rather
    than hand out an id a live holder may still have."""
    victim, lock_id = id_on_first_node(settings, pool)
    holder = Lock(lock_id)
    assert holder.acquire()  # learns the run, records it on the other nodes
    victim.stop(signal.SIGKILL)
    victim.start()
    for other in pool[1:]:
        other.stop(signal.SIGKILL)
    as_a_fresh_process()
    with pytest.raises(LockBackendError, match="RESTART_GRACE"):
        Lock(lock_id).acquire()
    [said] = [r.getMessage() for r in caplog.records if "came back" in r.getMessage()]
    for other in pool[1:]:
        assert other.address in said, said
