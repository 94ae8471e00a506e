"""A live holder is never robbed, in the deployments users run: a pool of
memcached servers (one restarted, one stalled), a timeout in the contender's own
cache client, a record read that fails (django-redis told to ignore errors
too), memcached as a container's pid 1, Redis with a stale replica, /proc
hidden from other users, and a task argument whose repr() raises. The
scenarios are ``reliability.deployments``' (the fault table's rows 34-43): each
holder is a real process on "another host" (its own hostname), so only its
liveness record tells a contender that it lives."""

from __future__ import annotations

import time

import pytest

from django_tasklock import Lock
from django_tasklock.backends import backend_for
from django_tasklock.locks import liveness
from reliability import deployments
from reliability.deployments import LIVENESS, MEMCACHED, Memcached
from tests.helpers import background, wait_until

pytestmark = pytest.mark.long(seconds=90)


def assert_never_robbed(outcome: deployments.Outcome, least_tries: int) -> None:
    """Nobody took the live holder's lock, and it still holds it: unless it,
    or the server of its lock, stood still for half LIVENESS or more and it
    was told (``deployments.starved``: the safe direction, as the fault
    table's rows judge it)."""
    assert outcome.taken == 0, outcome
    assert outcome.tries >= least_tries, outcome
    if not deployments.starved(outcome):
        assert outcome.kept is True, outcome  # its own check(): still held
    assert outcome.released is True, outcome


@pytest.mark.slow
def test_a_restarted_pool_server_robs_no_live_holder():
    assert_never_robbed(deployments.pool_server_restarted(), 10)


@pytest.mark.slow
def test_a_stalled_pool_server_robs_no_live_holder():
    # Within the budget (LIVENESS - a beat - 1 s): earlier builds kept the
    # record on the stalled server, and pymemcache wrote it elsewhere while
    # it was marked dead.
    assert_never_robbed(deployments.pool_server_stalled(), 10)


@pytest.mark.slow
def test_a_lock_servers_stall_past_the_budget_is_told_to_its_holder():
    outcome = deployments.lock_server_stalled_too_long()
    # The record lapsed while its server stalled: the holder is told, whether
    # or not a contender got in first.
    assert outcome.kept is False, outcome
    assert outcome.released is True, outcome


def test_a_timeout_in_the_contenders_cache_client_is_not_a_dead_holder():
    outcome = deployments.client_timed_out()
    assert outcome.verdict is not None and outcome.verdict[0] is True, outcome
    assert_never_robbed(outcome, 3)


@pytest.mark.parametrize("ignoring_redis", [False, True], ids=["memcached", "ignoring"])
def test_a_record_read_that_fails_leaves_the_lock_held(ignoring_redis):
    # django-redis with IGNORE_EXCEPTIONS answers None for any error through
    # Django's client: the record is read through the lock backend instead.
    outcome = deployments.record_unreadable(ignoring_redis=ignoring_redis)
    assert outcome.verdict is not None and outcome.verdict[0] is None, outcome
    assert "could not be read" in outcome.verdict[1]
    assert outcome.figures["refused"] >= 2
    assert_never_robbed(outcome, 1)


@pytest.mark.slow
def test_a_quick_restart_of_memcached_as_pid_1_is_seen():
    assert_never_robbed(deployments.pid_one_restarted(), 10)


@pytest.mark.slow
def test_a_stale_replica_never_judges_a_live_holder():
    outcome = deployments.replica_cut()
    assert outcome.verdict is not None and outcome.verdict[0] is True, outcome
    assert_never_robbed(outcome, 3)


def test_a_process_hidden_by_hidepid_is_not_judged_gone():
    outcome = deployments.hidden_by_hidepid()
    assert outcome.verdict is not None and outcome.verdict[0] is True, outcome
    assert_never_robbed(outcome, 1)


def test_an_argument_whose_repr_raises_stops_no_liveness_beat():
    outcome = deployments.unprintable_argument(beats=10)
    # Beats while it held, over ten periods' span: half at least (a beat the
    # listing stopped makes none); and released after the run.
    assert outcome.tries >= 5 and outcome.released is True, outcome
    assert outcome.kept is True, outcome
    assert outcome.verdict is not None and outcome.verdict[0] is True, outcome


@pytest.fixture
def store_default(settings):
    settings.TASKLOCK = {"CACHE": "default", "LIVENESS": LIVENESS, "LOCK_EXPIRE": 60}
    return "default"


def test_a_retried_write_of_a_state_another_process_wrote_is_not_ours(
    store_default, memcached
):
    # A rate limit's state is no token: two processes admitting in the same
    # millisecond from nothing compute the same one. After a dropped first try
    # (that never reached the store), finding an equal value proves nothing.
    backend = backend_for("default")
    key = backend.keys_for("rate-state")[0]
    state = "w 1 1764000000000"
    client = backend._client(key)
    assert client.set(key, state, noreply=False)
    assert backend._acquire_tries(client, key, state, 60, 1) is None
    token_like = "host:123-4-abcdef01-s:0123456789abcdef:1:0"
    assert client.set(key, token_like, noreply=False)
    assert backend._acquire_tries(client, key, token_like, 60, 1) is not None


# -- 9. what the recovery promises, each checked ------------------------------------------


def records_on(server: Memcached) -> list[str]:
    """The liveness records ``server`` holds."""
    held = server.keys()  # (every key, from the server: not a dict)
    return [key for key in held if "tasklock-alive" in key]


@pytest.mark.slow
def test_a_dead_holders_lock_changed_after_the_judgement_is_not_taken():
    # Contender A judges the holder dead, and before its conditional write
    # lands contender B has taken the lock: A's write must fail, whatever it
    # reads afresh.
    with deployments.deployment() as deployed:
        server = deployed.server(Memcached())
        direct = {"BACKEND": MEMCACHED, "LOCATION": server.address}
        alias = deployed.alias("direct", direct)
        holder = deployed.holder(alias, "judged", "tasklock-judged-host")
        proxy = deployed.proxy(server.port)
        deployed.alias("slow-judge", {"BACKEND": MEMCACHED, "LOCATION": proxy.address})
        holder.kill()
        assert records_on(server)
        wait_until(lambda: not records_on(server), LIVENESS + 5)
        proxy.hold(b"tasklock-alive:tasklock-judged-host")  # its record only
        a = Lock("judged", cache="slow-judge", expire=30)
        thread, outcome = background(a.acquire)
        wait_until(lambda: proxy.held == 1, 10)
        b = Lock("judged", cache="direct", expire=30)
        assert b.acquire()  # its own judgement: dead
        proxy.let_go()
        thread.join(10)
        assert outcome == {"result": False}
        assert b.owned() and b.release()


def test_the_record_is_renewed_every_tenth_of_the_bound(store_default):
    lock = Lock("cadence", expire=30)
    assert lock.acquire()
    try:
        record = liveness._records["default"].keeper
        assert record is not None and record.every == pytest.approx(LIVENESS / 10)
        beats, started = record.beats, time.monotonic()
        wait_until(lambda: record.beats >= beats + 20, 20)
        spent = time.monotonic() - started
        # Twenty beats at 0.3 s: 6 s; a doubled interval would take 12 s.
        assert spent < 20 * record.every * 1.5, f"{spent:.1f}s for 20 beats"
    finally:
        lock.release()


def test_a_lock_of_an_earlier_build_is_left_to_expire(store_default):
    # Its token says it keeps a record wherever Django's cache put it ("-r"),
    # which this build does not read: unknown, never dead, in a rolling upgrade.
    from django_tasklock.status import lock_status

    token = "elsewhere.example:4242-100-abcdef12-r:0123456789abcdef:1:0"
    backend = backend_for("default")
    assert backend.acquire(backend.keys_for("from-before")[0], token, 30)
    owner = lock_status("from-before", cache="default").owner
    assert owner is not None and owner.alive is None, owner
    assert "where this build does not look" in owner.why
    assert not Lock("from-before", expire=30).acquire()
