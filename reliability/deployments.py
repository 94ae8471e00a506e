"""Fault cases 34-41: a live holder is never robbed in the deployments users
run. Each builds one deployment from real servers (a pool of two memcached
servers, memcached as a container's pid 1, Redis with a replica, django-redis
told to ignore errors), starts a holder on "another host" (a ``tests.holder``
process with a hostname of its own, so only its liveness record tells that it
lives), breaks the deployment as the case says, and has a contender here try
for the lock every 50 ms. ``tests/backends/test_liveness_deployments.py`` runs each
scenario once and asserts on its outcome; ``run`` makes the table's rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reliability.faults import ROOT, Row
from tests.faultproxy import FaultProxy
from tests.helpers import wait_until
from tests.services import Memcached, Redis, free_port, stop_and_wait
from tests.workers import Holder

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
REDIS = "django.core.cache.backends.redis.RedisCache"
LIVENESS = 3.0


@dataclass
class Outcome:
    """What a scenario measured. ``tries``: the contender's tries while the
    holder lived; ``taken``: those that took its lock; ``kept``: the
    holder's own ``check()`` afterwards (True: still held, False: told it
    lost it); ``released``: its release; ``verdict``: what ``tasklock status``
    said of the holder at the scenario's worst moment."""

    tries: int = 0
    taken: int = 0
    kept: bool | None = None
    released: bool | None = None
    verdict: tuple[bool | None, str] | None = None
    figures: dict[str, float] = field(default_factory=dict)
    #: The holder's longest stall (its process starved or stopped), seconds.
    stall: float = 0.0
    #: How long the server of its lock and record stood still (SIGSTOPped by
    #: the scenario), seconds: its renewals could not land meanwhile.
    server_stall: float = 0.0
    #: What told the holder its lock was lost (``lock_lost``'s during and
    #: reason), "-" if nothing did.
    told: str = "-"


@dataclass
class Deployment:
    """The servers, aliases and holders of one scenario; stopped on exit."""

    stack: contextlib.ExitStack
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)

    def server(self, server: Memcached | Redis) -> Any:
        server.start()

        def stop() -> None:
            if server.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.process.pid, signal.SIGCONT)
            server.stop()

        self.stack.callback(stop)
        return server

    def proxy(self, port: int) -> FaultProxy:
        proxy = FaultProxy(port)
        self.stack.callback(proxy.close)
        return proxy

    def alias(self, name: str, config: dict[str, Any], **tasklock: Any) -> str:
        """Add CACHES alias ``name`` here and in the holders started after;
        the scenario's locks go to it."""
        from django.test import override_settings

        self.caches[name] = config
        os.environ["TASKLOCK_TEST_EXTRA_CACHES"] = json.dumps(self.caches)
        from django.conf import settings

        caches = {**settings.CACHES, name: config}
        tasklock = {"CACHE": name, "LIVENESS": LIVENESS, "LOCK_EXPIRE": 60, **tasklock}
        self.stack.enter_context(override_settings(CACHES=caches, TASKLOCK=tasklock))
        return name

    def holder(self, alias: str, lock_id: str, host: str) -> Holder:
        from django.conf import settings

        liveness = settings.TASKLOCK.get("LIVENESS", LIVENESS)
        holder = Holder(alias, lock_id, host=host, liveness=liveness)

        def close() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder.process.pid, signal.SIGCONT)
            holder.close()

        self.stack.callback(close)
        return holder


@contextlib.contextmanager
def deployment() -> Iterator[Deployment]:
    from django_tasklock.backends import close_thread_connections
    from django_tasklock.locks.liveness import forget_records

    before = os.environ.get("TASKLOCK_TEST_EXTRA_CACHES")
    with contextlib.ExitStack() as stack:
        try:
            yield Deployment(stack)
        finally:
            forget_records()
            close_thread_connections()
            if before is None:
                os.environ.pop("TASKLOCK_TEST_EXTRA_CACHES", None)
            else:
                os.environ["TASKLOCK_TEST_EXTRA_CACHES"] = before


def contend(
    outcome: Outcome, lock_id: str, seconds: float, *, least: int = 1, **lock: Any
) -> None:
    """Try ``lock_id`` every 50 ms for ``seconds``, and at least ``least``
    times (a starved process may make few tries in a short window), counting
    tries and takes (a take is released at once). A restarted memcached's
    grace refuses."""
    from django_tasklock import Lock, LockBackendError

    deadline = time.monotonic() + seconds
    tried = 0
    while time.monotonic() < deadline or tried < least:
        tried += 1
        taker = Lock(lock_id, expire=30, **lock)
        try:
            took = taker.acquire()
        except LockBackendError as exc:
            if "restarted" not in str(exc):
                raise
            took = False
        outcome.tries += 1
        if took:
            outcome.taken += 1
            taker.release()
        time.sleep(0.05)


def finish(outcome: Outcome, holder: Holder) -> Outcome:
    """The holder's own word: does it still hold its lock, and how long did it
    stand still; then its release."""
    outcome.kept = {"check True False": True, "check False True": False}.get(
        holder.ask("check")
    )
    outcome.stall = float(holder.ask("stall").split()[1])
    outcome.told = holder.ask("told").removeprefix("told ")
    outcome.released = holder.ask("release") == "released True"
    return outcome


def verdict(lock_id: str, alias: str) -> tuple[bool | None, str] | None:
    from django_tasklock.status import lock_status

    owner = lock_status(lock_id, cache=alias).owner
    return None if owner is None else (owner.alive, owner.why)


def server_of(alias: str, key_id: str) -> str:
    """The pool server Django's cache puts ``key_id`` on."""
    from django.core.cache import caches

    cache = caches[alias]
    server = cache._cache._get_client(cache.make_key(key_id)).server
    return f"{server[0]}:{server[1]}"


def pool_holder(deployed: Deployment, alias: str, name: str) -> tuple[Holder, str, str]:
    """A holder whose lock is on one server of the pool while Django's cache
    would put its liveness record on the other (where earlier builds kept it):
    fresh lock ids until the hashes fall so. The holder, its lock id, and the
    address of the other server."""
    from django_tasklock.locks.liveness import record_id
    from django_tasklock.tokens import KEEPS_RECORD

    host = "tasklock-pool-host"
    for attempt in range(40):
        lock_id = f"{name}-{attempt}"
        holder = deployed.holder(alias, lock_id, host)
        process = holder.token.rsplit(":", 4)[1].removesuffix(KEEPS_RECORD)
        lock_server = server_of(alias, lock_id)
        record_server = server_of(alias, record_id(host, process))
        if lock_server != record_server:
            return holder, lock_id, record_server
        holder.ask("release")
    raise AssertionError("no lock id put the lock and the record on two servers")


def _pair(
    deployed: Deployment, **options: Any
) -> tuple[list[Memcached], dict[str, Any]]:
    """Two memcached servers, and a CACHES entry for them as one pool."""
    pair = [deployed.server(Memcached()), deployed.server(Memcached())]
    config = {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in pair]}
    if options:
        config["OPTIONS"] = options
    return pair, config


# -- the scenarios --------------------------------------------------------------------


def pool_server_restarted(liveness: float = 6.0) -> Outcome:
    """34. Two memcached servers; the server that does not hold the lock
    SIGKILLed and started again on its port. (LIVENESS 6 s: memcached keeps a
    record of LIVENESS - 2 s for sure, so with 3 s a holder starved for a
    second on a loaded machine counts its own record lapsed, and is told it
    lost a lock nobody took.)"""
    outcome = Outcome()
    with deployment() as deployed:
        pair, config = _pair(deployed)
        alias = deployed.alias("pool", config, LIVENESS=liveness)
        holder, lock_id, other = pool_holder(deployed, alias, "pool-restart")
        contend(outcome, lock_id, 0.3)  # seen alive before
        victim = next(server for server in pair if server.address == other)
        victim.stop(signal.SIGKILL)
        victim.start()
        contend(outcome, lock_id, liveness + 2)
        # What ``tasklock status`` says of the live holder now: never dead.
        outcome.verdict = verdict(lock_id, alias)
        return finish(outcome, holder)


def pool_server_stalled(stall: float = 5.0, liveness: float = 8.0) -> Outcome:
    """35. Two memcached servers, ``timeout: 0.5``; the server that does not
    hold the lock SIGSTOPped for ``stall`` seconds (within the budget,
    LIVENESS - a beat - 1 s), then resumed."""
    outcome = Outcome()
    with deployment() as deployed:
        pair, config = _pair(deployed, timeout=0.5)
        alias = deployed.alias("pool", config, LIVENESS=liveness)
        holder, lock_id, other = pool_holder(deployed, alias, "pool-stall")
        victim = next(server for server in pair if server.address == other)
        assert victim.process is not None
        stop_and_wait(victim.process.pid)
        try:
            contend(outcome, lock_id, stall)
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        contend(outcome, lock_id, liveness + 2)  # past the record's life
        outcome.verdict = verdict(lock_id, alias)
        return finish(outcome, holder)


def lock_server_stalled_too_long() -> Outcome:
    """36 (with 35, by design). The lock's own server SIGSTOPped past LIVENESS:
    its holder's record there lapses; a contender may take the lock, and the
    holder is told."""
    from django_tasklock import Lock

    outcome = Outcome()
    with deployment() as deployed:
        pair, config = _pair(deployed, timeout=0.5)
        alias = deployed.alias("pool", config)
        holder, lock_id, _other = pool_holder(deployed, alias, "pool-long-stall")
        own = next(s for s in pair if s.address == server_of(alias, lock_id))
        assert own.process is not None
        stop_and_wait(own.process.pid)
        stopped = time.monotonic()
        try:
            wait_until(lambda: time.monotonic() - stopped > LIVENESS + 2)
        finally:
            os.kill(own.process.pid, signal.SIGCONT)
        taker = Lock(lock_id, expire=30)
        outcome.tries = 1
        outcome.taken = int(taker.acquire(blocking=True, timeout=LIVENESS + 5))
        finish(outcome, holder)
        if outcome.taken:
            outcome.released = outcome.released is False and taker.release()
        return outcome


def client_timed_out() -> Outcome:
    """37. One memcached, ``timeout: 0.5``, SIGSTOPped while this process's
    own cache client reads from it: pymemcache then answers None for
    ``retry_timeout`` (3 s here, 1 s by default) without asking the server."""
    from django.core.cache import caches

    outcome = Outcome()
    with deployment() as deployed:
        server = deployed.server(Memcached())
        config = {
            "BACKEND": MEMCACHED,
            "LOCATION": server.address,
            "OPTIONS": {"timeout": 0.5, "retry_timeout": 3},
        }
        alias = deployed.alias("timing-out", config)
        holder = deployed.holder(alias, "timed-out", "tasklock-timeout-host")
        stopped = time.monotonic()
        stop_and_wait(server.process.pid)  # type: ignore[union-attr]
        try:
            with contextlib.suppress(TimeoutError):
                caches[alias].get("anything")
                raise AssertionError("the read did not time out")
        finally:
            os.kill(server.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
            outcome.server_stall = time.monotonic() - stopped
        started = time.monotonic()
        assert caches[alias].get("anything-else") is None  # not asked
        outcome.verdict = verdict("timed-out", alias)
        contend(outcome, "timed-out", 3.0 - (time.monotonic() - started), least=3)
        return finish(outcome, holder)


def record_unreadable(ignoring_redis: bool = False) -> Outcome:
    """38 and 39. The read of the holder's record (only) never reaches the store: a
    proxy closes the connection instead. On memcached, or on django-redis with
    ``IGNORE_EXCEPTIONS`` (whose client answers None for any error)."""
    outcome = Outcome()
    with deployment() as deployed:
        if ignoring_redis:
            server: Any = deployed.server(Redis())
            direct = {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": server.url,
            }
        else:
            server = deployed.server(Memcached())
            direct = {"BACKEND": MEMCACHED, "LOCATION": server.address}
        alias = deployed.alias("direct", direct)
        holder = deployed.holder(alias, "unreadable", "tasklock-unreadable")
        proxy = deployed.proxy(server.port)
        if ignoring_redis:
            proxied = {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{proxy.address}/0",
                "OPTIONS": {"IGNORE_EXCEPTIONS": True},
            }
        else:
            proxied = {"BACKEND": MEMCACHED, "LOCATION": proxy.address}
        proxied_alias = deployed.alias("proxied", proxied)
        proxy.refuse(b"tasklock-alive")
        outcome.verdict = verdict("unreadable", proxied_alias)
        contend(outcome, "unreadable", 0.5)
        outcome.figures["refused"] = proxy.refused
        proxy.heal()
        return finish(outcome, holder)


class PidOneMemcached(Memcached):
    """memcached as pid 1 of a pid namespace of its own, as in a container."""

    def __init__(self) -> None:
        super().__init__(binary="unshare")

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


def pid_one_restarted() -> Outcome:
    """40. memcached as a container's pid 1, SIGKILLed and started again at
    once (same pid, same start second)."""
    outcome = Outcome()
    with deployment() as deployed:
        server = deployed.server(PidOneMemcached())
        assert server.stats()["pid"] == "1"
        config = {"BACKEND": MEMCACHED, "LOCATION": server.address}
        alias = deployed.alias("container", config, RESTART_GRACE=LIVENESS + 2)
        holder = deployed.holder(alias, "in-a-container", "tasklock-container-host")
        contend(outcome, "in-a-container", 0.2)  # this process saw the run
        server.stop()
        started = time.monotonic()
        server.start()
        outcome.figures["down"] = time.monotonic() - started
        assert server.stats()["pid"] == "1"
        # Refused for the grace, then found put back by its live holder.
        contend(outcome, "in-a-container", LIVENESS + 4)
        outcome.verdict = verdict("in-a-container", alias)
        return finish(outcome, holder)


def replica_cut() -> Outcome:
    """41. RedisCache on a primary and a replica (reads go to the replica);
    the replica cut from its primary keeps serving what it has, Redis's
    default, and the holder's record there lapses."""
    import redis
    from django.core.cache import caches

    outcome = Outcome()
    with deployment() as deployed:
        primary = deployed.server(Redis())
        replica = deployed.server(
            Redis(args=["--replicaof", "127.0.0.1", str(primary.port)])
        )
        config = {"BACKEND": REDIS, "LOCATION": [primary.url, replica.url]}
        alias = deployed.alias("replicated", config)
        holder = deployed.holder(alias, "replicated", "tasklock-replicated-host")
        with redis.Redis(port=replica.port) as client:
            wait_until(lambda: client.info("replication")["master_link_status"] == "up")
            wait_until(lambda: len(client.keys("*tasklock-alive*")) == 1)
            (record,) = client.keys("*tasklock-alive*")
            client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            cut = time.monotonic()
            wait_until(lambda: client.get(record) is None, LIVENESS + 5)
            outcome.figures["lapsed"] = time.monotonic() - cut
            assert client.get(caches[alias].make_key("replicated")) is not None
        outcome.verdict = verdict("replicated", alias)
        contend(outcome, "replicated", 1.0, least=3)
        return finish(outcome, holder)


def hidden_by_hidepid() -> Outcome:
    """42. A holder of root's on this host; a contender of another user's
    (nobody, allowed to read the interpreter's files and nothing more) whose
    /proc is mounted ``hidepid=2``: it cannot see the holder's process. It
    tries for 3 s, every 0.1 s (looking at the holder every half second)."""
    from django_tasklock.backends import backend_for
    from django_tasklock.locks.liveness import record_id
    from django_tasklock.tokens import KEEPS_RECORD, process_identity

    outcome = Outcome()
    with deployment() as deployed:
        server = deployed.server(Memcached())
        alias = deployed.alias(
            "hidden", {"BACKEND": MEMCACHED, "LOCATION": server.address}
        )
        holder = subprocess.Popen(["sleep", "60"])
        deployed.stack.callback(holder.wait)
        deployed.stack.callback(holder.kill)
        # The holder's token and record beside its lock, as a live holder
        # keeps them.
        process = process_identity(holder.pid) + KEEPS_RECORD
        host = socket.gethostname()
        token = f"{host}:{process}:{'0' * 16}:1:0"
        backend = backend_for(alias)
        key = backend.keys_for("hidden-holder")[0]
        assert backend.acquire(key, token, 60) is not None
        record = record_id(host, process.removesuffix(KEEPS_RECORD))
        backend.write_record(
            backend.record_place(key), record, f"{time.time():.3f}", 60
        )
        contender = (
            "mount -t proc -o hidepid=2 proc /proc && exec setpriv --reuid=65534 "
            "--regid=65534 --clear-groups --inh-caps=+dac_read_search "
            '--ambient-caps=+dac_read_search "$@"'
        )
        private = shlex.split("unshare --mount --propagation private sh -c")
        command = [*private, contender, "-", sys.executable, "-m", "tests.contender"]
        command += [alias, str(LIVENESS), "hidden-holder", "3"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
        )
        assert result.returncode == 0, result.stderr
        tries, takes, why = result.stdout.strip().split(" ", 2)
        outcome.tries, outcome.taken = int(tries), int(takes)
        outcome.verdict = ("renewed" in why, why)
        peek = backend.peek(key)
        outcome.kept = peek is not None and peek.value == token
        outcome.released = backend.discard(key, token)
        return outcome


class Unprintable(str):
    """A task argument whose repr() raises (a model whose __str__ reads a row
    deleted since); JSON still sends it as the str it is."""

    def __repr__(self) -> str:
        raise LookupError("the row is gone")


def unprintable_argument(beats: int = 10) -> Outcome:
    """43. A run of a ``@single_instance`` function whose argument's repr()
    raises, listed by the liveness thread's beat: the record must be renewed
    on, ``beats`` times while it holds."""
    from django.core.cache import caches

    from django_tasklock import single_instance
    from django_tasklock.locks import liveness
    from django_tasklock.locks.roster import slot_key

    outcome = Outcome()
    release = threading.Event()

    @single_instance(key="name", expire=30)
    def held_until(name: str) -> None:
        release.wait(30)

    def run_it() -> None:
        from tests.helpers import close_connections

        try:
            held_until(Unprintable("bad"))
        finally:
            close_connections()

    with deployment() as deployed:
        server = deployed.server(Memcached())
        alias = deployed.alias(
            "listing", {"BACKEND": MEMCACHED, "LOCATION": server.address}
        )
        thread = threading.Thread(target=run_it)
        thread.start()
        try:
            wait_until(lambda: alias in liveness._records, 10)
            records = liveness._records[alias]
            wait_until(lambda: bool(records.roster.runs), 10)
            record = records.keeper
            assert record is not None
            before = record.beats
            started = time.monotonic()
            # A fixed span, not a wait for the beats: what is counted is what
            # the thread did in it (``beats`` periods' worth).
            stopped = threading.Event()
            stopped.wait(beats * record.every)
            outcome.tries = record.beats - before
            outcome.figures["seconds"] = time.monotonic() - started
            outcome.kept = record.valid_until > time.monotonic()
            listed = caches[alias].get(slot_key(records.roster.slot or 0)) or ""
            outcome.verdict = (
                "<Unprintable: repr() raised LookupError>" in listed,
                listed[:200],
            )
        finally:
            release.set()
            thread.join()
        # Released by the decorator as the run returned: the id is free.
        outcome.released = not _held(alias)
        return outcome


def _held(alias: str) -> bool:
    """Whether this process still holds a lock of ``alias`` it took with a
    liveness record (any, by the store: a lock released is gone there)."""
    from django_tasklock.backends import backend_for
    from django_tasklock.locks import liveness

    records = liveness._records.get(alias)
    if records is None:
        return False
    backend = backend_for(alias)
    acquisitions = [acq for acq in records.held.values() if acq.hold is not None]
    return any(backend.locked(acq.key) for acq in acquisitions)


# -- the table's rows ---------------------------------------------------------------------


#: What a holder is told when its liveness record's renewal came too late.
LAPSED = "liveness record may have lapsed"


def starved(outcome: Outcome) -> bool:
    """A holder told it lost its lock that nobody took, having stood still, or
    its server having stood still, long enough (half ``LIVENESS``) for its
    liveness record or heartbeat to lapse, or told so by its record's own
    renewal coming late (on memcached, with ``LIVENESS`` 3 s, a record is
    sure for 1 s and written every 0.3 s: a write delayed 0.7 s on a loaded
    machine, the thread that makes it short of a tick's stall): the safe
    direction, judged by what must hold (no second holder, the holder told),
    not by the lock it was meant to keep."""
    stood = max(outcome.stall, outcome.server_stall)
    late = stood >= LIVENESS / 2 or LAPSED in outcome.told
    return outcome.kept is False and not outcome.taken and late


def _row(case: str, runs: list[Outcome], *, least_tries: int = 1) -> Row:
    """One row from the outcomes of one scenario's runs. Overlaps: tries that
    took a live holder's lock. Wrong: a run whose contender tried fewer than
    ``least_tries`` times, whose holder no longer held its lock (unless it was
    starved: ``starved``) or could not release it, or whose status called
    the holder dead."""
    bad = [
        outcome
        for outcome in runs
        if outcome.tries < least_tries
        or (
            (outcome.kept is not True or outcome.released is not True)
            and not starved(outcome)
        )
        or (outcome.verdict is not None and outcome.verdict[0] is False)
    ]
    row = Row(case, len(runs), sum(o.taken for o in runs), len(bad))
    tries = sum(o.tries for o in runs)
    row.figures.append(f"{tries} tries, {row.overlaps} took the live holder's lock")
    hungry = [max(o.stall, o.server_stall) for o in runs if starved(o)]
    if hungry:
        row.figures.append(
            f"holder starved and told it lost its lock {len(hungry)} "
            f"(it or its server stood still up to {max(hungry):.1f}s, or its "
            "record's renewal came late; nobody took it)"
        )
    for outcome in bad:  # what the summary line's "why" needs
        row.figures.append(
            f"wrong: {outcome.tries} tries, check {outcome.kept}, released "
            f"{outcome.released}, stood still {outcome.stall:.1f}s, told {outcome.told}"
        )
    said = [o.verdict[0] for o in runs if o.verdict is not None]
    if said:
        row.figures.append(
            f"status: alive {said.count(True)}, unknown {said.count(None)}, "
            f"dead {said.count(False)}"
        )
    return row


def _told(case: str, runs: list[Outcome]) -> Row:
    """A row for a stall past the budget: the lock may be taken (no overlap
    counted: its holder was told before it could act again). Wrong: a holder
    not told, or a release that did not go as the outcome says."""
    wrong = sum(o.kept is not False or o.released is not True for o in runs)
    row = Row(case, len(runs), None, wrong)
    taken = sum(o.taken for o in runs)
    told = sum(o.kept is False for o in runs)
    row.figures.append(f"taken {taken}/{len(runs)}; holder told {told}/{len(runs)}")
    return row


def run(quick: bool) -> list[Row]:
    n = 1 if quick else 3

    def runs(scenario: Callable[[], Outcome]) -> list[Outcome]:
        return [scenario() for _ in range(n)]

    rows = [
        _row(
            "34. pool server restarted, lock on the other",
            runs(pool_server_restarted),
            least_tries=10,
        ),
        _row(
            "35. pool server stalled 5s (LIVENESS 8s)",
            runs(pool_server_stalled),
            least_tries=10,
        ),
        _told(
            "36. lock's own server stalled past LIVENESS",
            runs(lock_server_stalled_too_long),
        ),
        _row(
            "37. timeout in the contender's own client",
            runs(client_timed_out),
            least_tries=3,
        ),
        _row("38. record read refused, memcached", runs(record_unreadable)),
        _row(
            "39. record read refused, IGNORE_EXCEPTIONS",
            runs(lambda: record_unreadable(ignoring_redis=True)),
        ),
        _row(
            "40. memcached as pid 1 restarted at once",
            runs(pid_one_restarted),
            least_tries=10,
        ),
        _row(
            "41. Redis replica cut, its record lapsed", runs(replica_cut), least_tries=3
        ),
        _row(
            "42. contender's /proc hidepid=2", runs(hidden_by_hidepid), least_tries=10
        ),
    ]
    listed = runs(unprintable_argument)
    # Half the beats its period allows, at least: a thread stopped by the
    # listing would make none.
    wrong = sum(
        o.tries < 5
        or not o.kept
        or o.released is not True
        or not (o.verdict and o.verdict[0])
        for o in listed
    )
    row = Row("43. repr() raising in a listed run", len(listed), None, wrong)
    row.figures.append(
        "beats while it held: "
        + ", ".join(f"{o.tries} in {o.figures['seconds']:.1f}s" for o in listed)
        + f"; released {sum(o.released is True for o in listed)}/{len(listed)}"
    )
    return [*rows, row]
