"""A live holder is never robbed, in the deployments users run: a pool of
memcached servers (one restarted, one stalled), a timeout in the contender's own
cache client, memcached as a container's pid 1, Redis with a stale replica,
/proc hidden from other users, a task argument whose repr() raises, and
django-redis told to ignore errors. Each holder here is a real process on
"another host" (its own hostname), so only its liveness record tells a
contender that it lives."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from django.core.cache import caches

from django_tasklock import Lock, LockBackendError, single_instance
from django_tasklock.backends import backend_for
from django_tasklock.locks import liveness
from django_tasklock.status import lock_status
from tests.conftest import background, close_connections, wait_until
from tests.faultproxy import FaultProxy
from tests.services import Memcached, Redis, free_port, stop_and_wait
from tests.workers import Holder

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
LIVENESS = 3.0
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def deployment(settings, monkeypatch):
    """Add CACHES aliases here and in the holder processes a test starts."""
    added: dict[str, dict[str, object]] = {}

    def add(alias: str, config: dict[str, object], **tasklock: object) -> str:
        added[alias] = config
        monkeypatch.setenv("TASKLOCK_TEST_EXTRA_CACHES", json.dumps(added))
        settings.CACHES = {**settings.CACHES, alias: config}
        settings.TASKLOCK = {
            "CACHE": alias,
            "LIVENESS": LIVENESS,
            "LOCK_EXPIRE": 60,
            **tasklock,
        }
        return alias

    yield add
    close_connections()
    for alias in added:
        with contextlib.suppress(Exception):
            backend_for(alias).close()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(*args, **kwargs) -> Holder:
        holder = Holder(*args, **kwargs)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.process.pid, signal.SIGCONT)
        holder.close()


@pytest.fixture
def servers():
    started: list[Memcached | Redis] = []

    def start(server):
        started.append(server.start())
        return server

    yield start
    for server in started:
        if server.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


def refused_for(lock_id: str, seconds: float) -> int:
    """Try ``lock_id`` from this process, every 50 ms for ``seconds``; how many
    tries were refused. Fails the test at once if one took it."""
    tries = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lock = Lock(lock_id, expire=30)
        try:
            took = lock.acquire()
        except LockBackendError as exc:  # a restarted server's grace: refused
            if "restarted" not in str(exc):
                raise
            took = False
        if took:
            lock.release()
        assert not took, f"took {lock_id!r} from its live holder after {tries} tries"
        tries += 1
        time.sleep(0.05)
    return tries


def records_on(server: Memcached) -> list[str]:
    """The liveness records ``server`` holds."""
    held = server.keys()  # (every key, from the server: not a dict)
    return [key for key in held if "tasklock-alive" in key]


def server_of(alias: str, lock_id: str) -> str:
    """The address of the pool server Django's cache puts ``lock_id`` on."""
    cache = caches[alias]
    server = cache._cache._get_client(cache.make_key(lock_id)).server
    return f"{server[0]}:{server[1]}"


def pool_holder(alias, holders, pair, name):
    """A holder on another host whose lock is on one server of ``pair`` while
    Django's cache would put its liveness record on the other (where earlier
    builds kept it): tried with fresh lock ids until the hashes fall so."""
    from django_tasklock.locks.liveness import record_id

    for attempt in range(40):
        lock_id = f"{name}-{attempt}"
        holder = holders(alias, lock_id, host="tasklock-pool-host")
        process = holder.token.rsplit(":", 4)[1].removesuffix("-s")
        record = record_id("tasklock-pool-host", process)
        lock_server, record_server = server_of(alias, lock_id), server_of(alias, record)
        if lock_server != record_server:
            other = next(s for s in pair if s.address == record_server)
            return holder, lock_id, other
        holder.close()
    raise AssertionError("no lock id put the lock and the record on two servers")


# -- 1. a pool server restarted ---------------------------------------------------


@pytest.mark.slow
def test_a_restarted_pool_server_robs_no_live_holder(deployment, holders, servers):
    pair = [servers(Memcached()), servers(Memcached())]
    alias = deployment(
        "pool", {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in pair]}
    )
    holder, lock_id, other = pool_holder(alias, holders, pair, "pool-restart")
    assert refused_for(lock_id, 0.3) > 0  # seen alive before
    other.stop(signal.SIGKILL)
    other.start()
    assert refused_for(lock_id, LIVENESS + 2) > 10
    assert holder.ask("check") == "check True False"
    assert holder.ask("release") == "released True"


# -- 2. a pool server stalled -------------------------------------------------------


@pytest.mark.slow
def test_a_stalled_pool_server_robs_no_live_holder(deployment, holders, servers):
    # A stall within the budget (LIVENESS - a beat - 1 s) of the server that
    # does not hold the lock; earlier builds kept the record there, and
    # pymemcache wrote it elsewhere while the server was marked dead.
    pair = [servers(Memcached()), servers(Memcached())]
    alias = deployment(
        "pool",
        {
            "BACKEND": MEMCACHED,
            "LOCATION": [s.address for s in pair],
            "OPTIONS": {"timeout": 0.5},
        },
        LIVENESS=8.0,
    )
    holder, lock_id, other = pool_holder(alias, holders, pair, "pool-stall")
    stop_and_wait(other.process.pid)
    try:
        assert refused_for(lock_id, 5.0) > 10
    finally:
        os.kill(other.process.pid, signal.SIGCONT)
    # Well past the record's life after the stall: still the holder's.
    assert refused_for(lock_id, 8.0 + 2) > 10
    assert holder.ask("check") == "check True False"
    assert holder.ask("release") == "released True"


@pytest.mark.slow
def test_a_lock_servers_stall_past_the_budget_is_told_to_its_holder(
    deployment, holders, servers
):
    pair = [servers(Memcached()), servers(Memcached())]
    alias = deployment(
        "pool",
        {
            "BACKEND": MEMCACHED,
            "LOCATION": [s.address for s in pair],
            "OPTIONS": {"timeout": 0.5},
        },
    )
    holder, lock_id, _other = pool_holder(alias, holders, pair, "pool-long-stall")
    own = next(s for s in pair if s.address == server_of(alias, lock_id))
    stop_and_wait(own.process.pid)
    stopped = time.monotonic()
    try:
        wait_until(lambda: time.monotonic() - stopped > LIVENESS + 2)
    finally:
        os.kill(own.process.pid, signal.SIGCONT)
    taker = Lock(lock_id, expire=30)
    took = taker.acquire(blocking=True, timeout=LIVENESS + 5)
    # The holder's record lapsed while its server stalled: it was told,
    # whether or not a contender got in first.
    assert holder.ask("check") == "check False True"
    if took:
        assert holder.ask("release") == "released False"
        assert taker.release()


# -- 3. a timeout in the contender's own cache client ----------------------------------


def test_a_timeout_in_the_contenders_cache_client_is_not_a_dead_holder(
    deployment, holders, servers
):
    server = servers(Memcached())
    alias = deployment(
        "timing-out",
        {"BACKEND": MEMCACHED, "LOCATION": server.address, "OPTIONS": {"timeout": 0.5}},
    )
    holder = holders(alias, "timed-out", host="tasklock-timeout-host")
    stop_and_wait(server.process.pid)
    try:
        # The application's own call times out; pymemcache then answers None
        # for a second without asking the server.
        with pytest.raises(TimeoutError):
            caches[alias].get("anything")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert caches[alias].get("anything-else") is None  # (not asked)
    status = lock_status("timed-out", cache=alias)
    assert status.owner is not None and status.owner.alive is True, status.owner
    assert not status.stale
    assert refused_for("timed-out", 1.0) > 5
    assert holder.ask("check") == "check True False"


def test_a_record_read_that_fails_leaves_the_lock_held(deployment, holders, servers):
    # The record's read (only) never reaches the store: unknown, not dead.
    server = servers(Memcached())
    proxy = FaultProxy(server.port)
    try:
        alias = deployment("direct", {"BACKEND": MEMCACHED, "LOCATION": server.address})
        holder = holders(alias, "unreadable", host="tasklock-unreadable")
        deployment("proxied", {"BACKEND": MEMCACHED, "LOCATION": proxy.address})
        proxy.refuse(b"tasklock-alive")
        status = lock_status("unreadable", cache="proxied")
        assert status.owner is not None and status.owner.alive is None
        assert "could not be read" in status.owner.why
        lock = Lock("unreadable", cache="proxied", expire=30)
        assert not lock.acquire()
        assert proxy.refused >= 2
        proxy.heal()
        assert holder.ask("check") == "check True False"
    finally:
        proxy.close()


# -- 4. memcached as a container's pid 1 ----------------------------------------------


@dataclass
class PidOneMemcached(Memcached):
    """memcached as pid 1 of a pid namespace of its own, as in a container."""

    binary: str = "unshare"
    args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [
            "--pid",
            "--kill-child",
            "--mount-proc",
            "memcached",
            *super().command(),
        ]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        # unshare ignores SIGTERM while it waits; killed, it kills memcached.
        super().stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_quick_restart_of_memcached_as_pid_1_is_seen(deployment, holders, servers):
    server = servers(PidOneMemcached())
    assert server.stats()["pid"] == "1"
    alias = deployment(
        "container",
        {"BACKEND": MEMCACHED, "LOCATION": server.address},
        RESTART_GRACE=LIVENESS + 2,
    )
    holder = holders(alias, "in-a-container", host="tasklock-container-host")
    assert refused_for("in-a-container", 0.2) > 0  # this process saw the run
    server.stop(signal.SIGKILL)
    server.start()
    assert server.stats()["pid"] == "1"
    # Refused for the grace, then found put back by its live holder.
    assert refused_for("in-a-container", LIVENESS + 4) > 10
    assert holder.ask("check") == "check True False"
    assert holder.ask("release") == "released True"


# -- 5. Redis with a replica that lost its primary ------------------------------------


@pytest.mark.slow
def test_a_stale_replica_never_judges_a_live_holder(deployment, holders, servers):
    primary = servers(Redis())
    replica = servers(Redis(args=["--replicaof", "127.0.0.1", str(primary.port)]))
    alias = deployment(
        "replicated",
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": [primary.url, replica.url],
        },
    )
    holder = holders(alias, "replicated", host="tasklock-replicated-host")
    with redis.Redis(port=replica.port) as client:
        wait_until(lambda: client.info("replication")["master_link_status"] == "up")
        wait_until(lambda: len(client.keys("*tasklock-alive*")) == 1)
        (record,) = client.keys("*tasklock-alive*")
        # Cut from its primary: it keeps serving what it has (Redis's default),
        # and the record there lapses while the holder renews it on the primary.
        client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        wait_until(lambda: client.get(record) is None, LIVENESS + 5)
        assert client.get(caches[alias].make_key("replicated")) is not None
    assert refused_for("replicated", 1.0) > 5
    assert holder.ask("check") == "check True False"
    assert holder.ask("release") == "released True"


# -- 6. /proc hidden from other users ---------------------------------------------------


def test_a_process_hidden_by_hidepid_is_not_judged_gone(deployment, store_default):
    # The holder: a process of root's on this host, holding a lock with a
    # token naming it and its record beside the lock, as a live holder keeps
    # it. The contender: another user (nobody, allowed to read the
    # interpreter's files under /root and nothing more), in a mount namespace
    # whose /proc is mounted hidepid=2.
    from django_tasklock.locks.liveness import record_id
    from django_tasklock.tokens import KEEPS_RECORD, process_identity

    holder = subprocess.Popen(["sleep", "60"])
    try:
        wait_until(
            lambda: Path(f"/proc/{holder.pid}/stat").read_text().split()[2] == "S"
        )
        process = process_identity(holder.pid) + KEEPS_RECORD
        host = socket.gethostname()
        token = f"{host}:{process}:{'0' * 16}:1:0"
        backend = backend_for(store_default)
        key = backend.keys_for("hidden-holder")[0]
        assert backend.acquire(key, token, 60) is not None
        backend.write_record(
            backend.record_place(key), record_id(host, process.removesuffix(KEEPS_RECORD)),
            f"{time.time():.3f}", 60,
        )  # fmt: skip
        contender = (
            "mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 "
            "--regid=65534 --clear-groups --inh-caps=+dac_read_search "
            '--ambient-caps=+dac_read_search "$@"'
        )
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", contender,
             "-", sys.executable, "-m", "tests.contender", store_default,
             str(LIVENESS), "hidden-holder"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("refused "), result.stdout
        assert "renewed its liveness record" in result.stdout
        assert lock_status("hidden-holder", cache=store_default).value == token
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def store_default(settings):
    settings.TASKLOCK = {"CACHE": "default", "LIVENESS": LIVENESS, "LOCK_EXPIRE": 60}
    return "default"


# -- 7. a task argument whose repr() raises ---------------------------------------------


class Unprintable(str):
    """A task argument whose repr() raises (a model whose __str__ reads a row
    deleted since); JSON still sends it as the str it is."""

    def __repr__(self) -> str:
        raise LookupError("the row is gone")


@single_instance(key="name", expire=30)
def held_until(name, release):
    release.wait(30)


def test_an_argument_whose_repr_raises_stops_no_liveness_beat(store_default):
    from django_tasklock.locks.roster import slot_key

    release = threading.Event()
    thread, outcome = background(held_until, Unprintable("bad"), release)
    try:
        wait_until(lambda: "default" in liveness._records, 10)
        records = liveness._records["default"]
        wait_until(lambda: records.roster.runs, 10)
        record = records.keeper
        assert record is not None
        beats = record.beats
        # Ten beats later (a tenth of LIVENESS each), still beating and listed.
        wait_until(lambda: record.beats >= beats + 10, 10)
        assert record._thread is not None and record._thread.is_alive()
        assert record.valid_until > time.monotonic()
        # Listed, the argument shown for what it is.
        assert records.roster.slot is not None
        listed = caches["default"].get(slot_key(records.roster.slot))
        assert "<Unprintable: repr() raised LookupError>" in listed
    finally:
        release.set()
        thread.join()
    assert outcome == {"result": None}


# -- 8. django-redis told to ignore errors -------------------------------------------------


def test_django_redis_ignoring_errors_never_judges_a_live_holder(
    deployment, holders, servers
):
    server = servers(Redis())
    proxy = FaultProxy(server.port)
    try:
        alias = deployment(
            "ignoring",
            {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": server.url},
        )
        holder = holders(alias, "ignored-errors", host="tasklock-ignoring-host")
        deployment(
            "ignoring-proxied",
            {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{proxy.address}/0",
                "OPTIONS": {"IGNORE_EXCEPTIONS": True},
            },
        )
        proxy.refuse(b"tasklock-alive")
        # Django's client would answer None here: the record read raises.
        assert caches["ignoring-proxied"].get("tasklock-alive:x") is None
        lock = Lock("ignored-errors", cache="ignoring-proxied", expire=30)
        assert not lock.acquire()
        owner = lock_status("ignored-errors", cache="ignoring-proxied").owner
        assert owner is not None and owner.alive is None, owner
        assert proxy.refused >= 3
        proxy.heal()
        assert holder.ask("check") == "check True False"
        assert holder.ask("release") == "released True"
    finally:
        proxy.close()
        close_connections()


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


@pytest.mark.slow
def test_a_dead_holders_lock_changed_after_the_judgement_is_not_taken(
    deployment, holders, servers
):
    # Contender A judges the holder dead, and before its conditional write
    # lands contender B has taken the lock: A's write must fail, whatever it
    # reads afresh.
    server = servers(Memcached())
    proxy = FaultProxy(server.port)
    try:
        alias = deployment("direct", {"BACKEND": MEMCACHED, "LOCATION": server.address})
        holder = holders(alias, "judged", host="tasklock-judged-host")
        deployment("slow-judge", {"BACKEND": MEMCACHED, "LOCATION": proxy.address})
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
    finally:
        proxy.close()


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
