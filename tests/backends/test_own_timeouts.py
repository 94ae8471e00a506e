"""Every socket this package opens has a timeout of its own, whatever the
alias's OPTIONS say: a server stalled as a whole (SIGSTOP: a frozen VM or
container) makes a lock's call raise ``LockBackendError`` within
``TASKLOCK['SOCKET_TIMEOUT']`` and a little, on every flavour of store and in
the async API, where the cache's own client (no timeout set) waits for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_tasklock import Lock, LockBackendError
from tests.helpers import close_connections, wait_until
from tests.services import Memcached, Redis, RedisCluster, Sentinel, stop_and_wait

pytestmark = pytest.mark.slow

#: The timeout of ours the tests set, and the most an answer may take: a
#: reply's timeout (the async API's watch may add a quarter), a retry of a
#: dropped command with its own, and a busy machine's slack. (Measured: 1.0 s
#: on pylibmc, 2.0 s on the Redis clients, 2.3 s async memcached; with the
#: clients' own timeouts, pylibmc's 5 s, the others never.)
OURS = 1.0
BOUND = 2.5 * OURS + 1.5


def answered_within(call: Callable[[], object], seconds: float) -> tuple[object, float]:
    """What ``call`` returned or raised, and how long it took; ("no answer",
    seconds) if it had not ended within ``seconds`` (its thread is left to a
    server that is woken afterwards)."""
    outcome: list[object] = ["no answer"]
    done = threading.Event()

    def run() -> None:
        try:
            outcome[0] = call()
        except BaseException as exc:  # what it raised is the answer
            outcome[0] = exc
        finally:
            close_connections()
            done.set()

    started = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    done.wait(seconds)
    return outcome[0], time.monotonic() - started


@contextlib.contextmanager
def stopped(process: Any) -> Iterator[None]:
    # Until every thread of it has stopped: the signal takes effect
    # asynchronously, and a loaded server answered a take sent right after it.
    stop_and_wait(process.pid)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def alias(settings: Any, config: dict[str, object]) -> None:
    """``config`` as the alias "stalling", the one TASKLOCK locks in."""
    settings.CACHES = {**settings.CACHES, "stalling": config}
    settings.TASKLOCK = {
        "CACHE": "stalling",
        "SOCKET_TIMEOUT": OURS,
        "LIVENESS": None,
        "LOCK_EXPIRE": 30,
    }


def stalls_within_bound(
    lock_id: str,
    process: Any,
    asynchronous: bool,
    bound: float = BOUND,
    warm_ids: Iterator[str] | None = None,
) -> None:
    """A lock taken and released on a warm connection (of ``warm_ids``, ids
    tried in turn, where given); then, the server stopped, a take raises
    within the bound (not "no answer")."""
    if asynchronous:
        warm = Lock(f"{lock_id}-warm")

        async def take() -> bool:
            assert await warm.aacquire()
            assert await warm.arelease()
            with stopped(process):
                return await Lock(lock_id).aacquire()

        outcome, spent = answered_within(lambda: asyncio.run(take()), 30)
    else:
        # Set-up, not the measure: a new Sentinel on a loaded machine may miss
        # a 1 s timeout of ours at first (MasterNotFoundError beside two hogs),
        # and a take whose reply timed out may have stored its token, which
        # then stands until the background removal gets to it: each try after
        # the first on an id of its own.
        names = warm_ids or itertools.chain(
            [f"{lock_id}-warm"], (f"{lock_id}-warm-{n}" for n in itertools.count())
        )
        tried: list[object] = []
        wait_until(
            lambda: _warmed(Lock(next(names)), tried),
            60,
            about=lambda: f"{len(tried)} tries, the last: {tried[-1:]!r}",
            every=0.05,
        )
        with stopped(process):
            outcome, spent = answered_within(Lock(lock_id).acquire, 30)
    assert isinstance(outcome, LockBackendError), (outcome, spent)
    assert spent < bound, f"answered after {spent:.1f}s"


def _warmed(lock: Lock, tried: list[object]) -> bool:
    """Take and release ``lock``; False if the store would not answer yet
    (what it answered kept in ``tried``, for the message if it never does)."""
    try:
        outcome: object = lock.acquire() and lock.release()
    except LockBackendError as exc:
        outcome = exc
    tried.append(outcome)
    return outcome is True


@pytest.fixture(scope="module")
def private_redis() -> Iterator[Redis]:
    server = Redis().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def private_memcached() -> Iterator[Memcached]:
    server = Memcached().start()
    yield server
    server.stop()


REDIS_ALIASES = {
    "django": lambda url: {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": url,
    },
    "django-redis": lambda url: {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": url,
    },
    "django-valkey": lambda url: {
        "BACKEND": "django_valkey.cache.ValkeyCache",
        "LOCATION": url.replace("redis://", "valkey://"),
    },
}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("client", sorted(REDIS_ALIASES))
def test_a_stalled_redis_answers_within_the_bound(
    settings, private_redis, client, asynchronous
):
    alias(settings, REDIS_ALIASES[client](private_redis.url))
    stalls_within_bound(f"stalled-{client}", private_redis.process, asynchronous)


@pytest.mark.parametrize(
    ("client", "asynchronous"),
    [("PyMemcacheCache", False), ("PyMemcacheCache", True), ("PyLibMCCache", False)],
    ids=["pymemcache-sync", "pymemcache-async", "pylibmc-sync"],
)
def test_a_stalled_memcached_answers_within_the_bound(
    settings, private_memcached, client, asynchronous
):
    alias(
        settings,
        {
            "BACKEND": f"django.core.cache.backends.memcached.{client}",
            "LOCATION": private_memcached.address,
        },
    )
    stalls_within_bound(f"stalled-{client}", private_memcached.process, asynchronous)


def test_a_stalled_sentinel_primary_answers_within_the_bound(settings):
    """django-redis's SentinelClient, its SOCKET_TIMEOUT option unset; the
    Sentinel slow to judge the primary down, so no failover comes."""
    primary = Redis().start()
    sentinel = Sentinel(primary=primary, down_after=60000).start()
    try:
        config = sentinel.cache()
        config["OPTIONS"] = {  # type: ignore[index]
            name: value
            for name, value in config["OPTIONS"].items()  # type: ignore[attr-defined]
            if name != "SOCKET_TIMEOUT"
        }
        alias(settings, config)
        stalls_within_bound("stalled-sentinel", primary.process, asynchronous=False)
    finally:
        close_connections()
        sentinel.stop()
        primary.stop()


def test_a_stalled_cluster_primary_holds_up_only_its_own_slots(settings):
    """A primary of a cluster stopped (its replica not promoted within the
    test): a lock in its slots raises within the bound, and one on another
    primary this process knew is taken (by a fresh thread's client, which may
    first ask the stopped node for the slots: within the bound too).

    A primary first seen meanwhile, on a cluster younger than the grace, is
    refused, and the refusal says why: whether it restarted empty is told by
    the record of its run on the other primaries, and the stopped one does
    not answer ("could not tell" never grants). Every warm-up is on an id of
    a chosen primary, so which primaries were seen before the stop is fixed.

    The stopped primary is not LOCATION's node: a fresh thread's client
    learns the cluster from that node alone."""
    from django_tasklock.backends import backend_for

    cluster = RedisCluster(node_timeout=60000).start()
    try:
        alias(
            settings,
            {
                "BACKEND": "django_valkey.cluster_cache.cache.ClusterValkeyCache",
                "LOCATION": cluster.url,
            },
        )
        backend: Any = backend_for("stalling")
        client = backend._redis("")

        def on(port: int) -> Iterator[str]:
            """Lock ids whose keys are in the slots of the primary at ``port``."""
            for n in itertools.count():
                lock_id = f"stalled-cluster-{n}"
                if client.get_node_from_key(backend.key_for(lock_id)).port == port:
                    yield lock_id

        # Django's caches are per thread, and a fresh thread's cluster client
        # starts from LOCATION's node alone: with that node stopped it reaches
        # no node at all (LockBackendError, "cannot be connected"). The node
        # stopped is another.
        first = cluster.nodes[0].port
        known, stalled, unseen = sorted(
            (node.port for node in client.get_primaries()), key=lambda p: p != first
        )
        stopped_node = next(node for node in cluster.nodes if node.port == stalled)
        elsewhere, first_seen = next(on(known)), next(on(unseen))
        wait_until(lambda: _warmed(Lock(f"{elsewhere}-warm"), []), 60)
        bound = 2 * (client.cluster_error_retry_attempts + 1) * OURS + 2
        # The cluster client tries a command that timed out again, after
        # asking a node for the slots (which may be the stopped one), as many
        # times as its cluster_error_retry_attempts say: each try a timeout
        # or two.
        in_stalled = on(stalled)  # the lock measured, then the warm-ups' ids
        stalls_within_bound(
            next(in_stalled), stopped_node.process, False, bound, in_stalled
        )
        with stopped(stopped_node.process):
            outcome, spent = answered_within(Lock(elsewhere).acquire, 30)
            refused, refused_in = answered_within(Lock(first_seen).acquire, 30)
        assert outcome is True, outcome
        assert spent < bound, f"a healthy primary's lock took {spent:.1f}s"
        assert isinstance(refused, LockBackendError), refused
        assert f"no answer from 127.0.0.1:{stalled}" in str(refused), refused
        assert "whether it came back empty is not known" in str(refused), refused
        assert refused_in < bound, f"the refusal took {refused_in:.1f}s"
        # LOCATION's node stopped: a fresh thread's client finds no node, and
        # that is an outage like any other (the cluster client's own
        # exception is not one of its ValkeyErrors).
        with stopped(cluster.nodes[0].process):
            unreached, _ = answered_within(Lock(elsewhere).acquire, 30)
        assert isinstance(unreached, LockBackendError), unreached
        assert "cannot be connected" in str(unreached), unreached
    finally:
        close_connections()
        cluster.stop()
