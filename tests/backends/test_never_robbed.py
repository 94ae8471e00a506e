"""The restart checks fail closed: the review's F1, F3, F5 and F7, each against
real memcached servers.

A pool's server restarted empty has lost the locks it held while their
holders still run. Each test builds one deployment in which today's layer
once answered "fine" without a positive answer, or let a safety duty wait on a
server it has nothing to do with, and shows the lock a live holder holds is
not handed out (or that the answer comes in a bound, where it never came).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import pytest

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import backend_for
from django_tasklock.locks import liveness
from tests.helpers import close_connections, wait_until
from tests.services import Memcached, wait_for_closed

pytestmark = pytest.mark.slow

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
IDS = [f"robbed-{n}" for n in range(60)]


def forget_runs() -> None:
    """Forget what this process learnt of the servers' runs, and its
    connections: as a process started now would be."""
    from django_tasklock.backends.memcached import restarts

    close_connections()
    with restarts._runs_mutex:
        restarts._runs.clear()
    restarts._refused.clear()
    restarts._unlearnable.clear()


@pytest.fixture
def pool(settings):
    servers = [Memcached().start() for _ in range(2)]
    settings.CACHES = {
        **settings.CACHES,
        "pool": {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in servers]},
    }
    settings.TASKLOCK = {
        "CACHE": "pool",
        "LOCK_EXPIRE": 30,
        "RESTART_GRACE": 60,
        "LIVENESS": None,
    }
    forget_runs()
    yield servers
    for server in servers:
        if server.process is not None:
            with contextlib.suppress(ProcessLookupError):
                server.process.send_signal(signal.SIGCONT)
    liveness.forget_records()
    forget_runs()
    for server in servers:
        server.stop()


def id_on(server: Memcached) -> str:
    backend = backend_for("pool")
    return next(
        i for i in IDS if backend._client(backend.key_for(i)).server[1] == server.port
    )


@contextlib.contextmanager
def closing_listener(port: int):
    """On ``port``: accept every connection, read its request and close it
    unanswered, as a stopping server, a container's port proxy or a load balancer with no
    backend does. Yields how many it closed."""
    wait_for_closed(port)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(16)
    closed = [0]
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            # The request read first, so the close is a clean one (FIN), not
            # a reset: what a client sees of a server that stops mid-request.
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                conn.recv(4096)
            conn.close()
            closed[0] += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield closed
    finally:
        done.set()
        listener.close()
        thread.join(5)


def test_f1_a_closed_connection_is_not_taken_for_a_proxy(pool):
    """F1: a contender meets a connection accepted and closed on the node's
    port while it restarts. That must not mark the node unlearnable: once it
    is back empty, its ids stay refused for the grace."""
    victim = pool[0]
    lock_id = id_on(victim)
    holder = Lock(lock_id)
    assert holder.acquire()  # the run learnt, and recorded on the other node
    forget_runs()  # the contender: a process that never saw the run
    victim.stop(signal.SIGKILL)
    with closing_listener(victim.port) as closed:
        with pytest.raises(LockBackendError):
            Lock(lock_id).acquire()
        assert closed[0] >= 1, "the contender never reached the listener"
    victim.start()
    with pytest.raises(LockBackendError, match="RESTART_GRACE"):
        Lock(lock_id).acquire()


def test_f1_a_real_proxy_is_still_known_by_its_answers(pool):
    """The positive test a proxy must pass: ``version`` answered, ``stats``
    closed. A memcached answers both; the listener answers neither."""
    from django_tasklock.backends.memcached.wire import closes_on_stats

    victim = pool[0]
    address = ("127.0.0.1", victim.port)
    assert closes_on_stats(address, 2.0) is False  # memcached: stats answered
    victim.stop(signal.SIGKILL)
    with closing_listener(victim.port):
        assert closes_on_stats(address, 2.0) is False  # version not answered
    victim.start()


def test_f5_a_pooled_alias_learns_the_run_and_refuses_after_a_restart(settings, pool):
    """F5: with ``use_pooling`` pymemcache's PooledClient hides its sockets; the
    locks go through a client of this package's, unpooled, whose connections
    are learnt, so a restart under a live holder is refused as without
    pooling."""
    caches = dict(settings.CACHES)
    caches["pool"] = {**caches["pool"], "OPTIONS": {"use_pooling": True}}
    settings.CACHES = caches
    victim = pool[0]
    lock_id = id_on(victim)
    assert Lock(lock_id).acquire()
    forget_runs()
    victim.stop(signal.SIGKILL)
    victim.start()
    with pytest.raises(LockBackendError, match="RESTART_GRACE"):
        Lock(lock_id).acquire()


def _in_a_thread(function, limit: float):
    """``function()``'s outcome, or "no answer" after ``limit`` seconds."""
    outcome: list[object] = ["no answer"]

    def run() -> None:
        try:
            outcome[0] = function()
        except Exception as exc:
            outcome[0] = exc
        finally:
            close_connections()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    return outcome[0]


def test_f7_a_stalled_node_does_not_hold_up_a_lock_on_a_healthy_one(settings, pool):
    """F7: a fresh process locks an id on healthy A while B is SIGSTOPped. The
    restart check reads A's run record on B, with a timeout of ours: the lock
    is answered (here refused, as A's record is unreadable and A is younger
    than the grace) within a bound, never left waiting."""
    healthy, stalled = pool
    lock_id = id_on(healthy)
    assert stalled.process is not None
    stalled.process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    outcome = _in_a_thread(lambda: Lock(lock_id).acquire(), 15)
    spent = time.monotonic() - started
    assert outcome != "no answer", "no answer in 15 s"
    assert isinstance(outcome, LockBackendError), outcome
    assert "RESTART_GRACE" in str(outcome), outcome
    # One read of B timed out (SOCKET_TIMEOUT, 2 s by default): the answer
    # came in a few socket timeouts.
    assert spent < 10, f"answered after {spent:.1f}s"


def test_f3_a_stalled_roster_node_does_not_stop_the_record_on_a_healthy_one(
    settings, pool
):
    """F3: the holder's lock and liveness record on A, its roster slot on B
    (the roster reads every slot, on both nodes); B SIGSTOPped. The record on
    A is still renewed well past LIVENESS, so no contender can judge the live
    holder dead."""
    from django_tasklock.locks.roster import slot_key

    settings.TASKLOCK = {**settings.TASKLOCK, "LIVENESS": 5}
    backend = backend_for("pool")
    made = settings.CACHES["pool"]
    # The first slot (the one a lone process claims) on B; A listed first, so
    # that A's record is the one whose thread kept the roster before.
    slot = backend._client(backend.cache.make_and_validate_key(slot_key(0)))
    stalled = next(s for s in pool if s.port == slot.server[1])
    healthy = next(s for s in pool if s is not stalled)
    close_connections()
    settings.CACHES = {
        **settings.CACHES,
        "pool": {**made, "LOCATION": [healthy.address, stalled.address]},
    }
    backend = backend_for("pool")
    keeper_place = backend.record_places()[0]
    assert keeper_place[1] == healthy.port
    lock = Lock(id_on(healthy), expire=60)
    assert lock.acquire()
    records = liveness._records["pool"]
    wait_until(lambda: records.roster.slot is not None, 10)
    assert records.roster.slot == 0
    record = records.beside(keeper_place)
    record_key = backend.key_for(records.id).encode()
    assert stalled.process is not None
    stalled.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    beats = record.beats
    # Past LIVENESS (5 s) and then some: a record left unrenewed is gone.
    wait_until(lambda: time.monotonic() - stopped > 7, 10, every=0.1)
    assert record.beats >= beats + 10, (beats, record.beats)
    assert healthy.raw(b"mg " + record_key).startswith(b"HD"), "record gone"
    assert lock.check()
    stalled.process.send_signal(signal.SIGCONT)
    assert lock.release()
