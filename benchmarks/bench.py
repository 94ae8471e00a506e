"""django_tasklock against the cookbook recipe and the raw memcached floor.

    python -m benchmarks.bench [--quick] [--write-docs]

Everything runs in one process tree against one private memcached, in one run, so
the ratios compare like with like on a shared, noisy machine:

1. Cycles: each variant takes and drops one lock, one cycle at a time, in rounds
   that interleave the variants (each round in a new random order) so that drift
   in the machine's speed hits every variant alike. Median and p99 per cycle, and
   each median's ratio to the floor's: raw pymemcache ``add`` + ``delete`` on one
   connection.
2. Contended: 8 processes on one lock id for a fixed time, acquisitions per
   second, for the floor (raw ``add``/``delete``) and for ``Lock``, alternated;
   the same on a private Redis Cluster (three primaries, a replica each),
   against valkey-py's cluster client (SET NX PX + Lua compare-and-delete);
   and on a private PostgreSQL, directly and through PgBouncer in transaction
   pooling mode, against psycopg running the store's own two statements (the
   take, ``INSERT ... ON CONFLICT ... DO UPDATE ... WHERE`` expired, and the
   owner-checked release) by hand on an autocommit connection.
3. End to end: a storm of duplicate Celery tasks over real worker processes
   (prefork, on a private Redis broker), with and without ``@single_instance``,
   time until every task has finished, alternated.

``--write-docs`` replaces the table between the benchmark markers in
docs/explanation/performance.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import psycopg_form, write_section  # noqa: E402
from tests.services import (  # noqa: E402
    Memcached,
    Redis,
    RedisCluster,
    celery_worker,
    stop_process,
)

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

TARGETS = {"memcache_lock": 1.3, "Lock": 1.3, "@single_instance": 1.6}
TABLE_START = ".. benchmark-table-start"
TABLE_END = ".. benchmark-table-end"
PEERS_START = ".. peers-table-start"
PEERS_END = ".. peers-table-end"


def setup_django(memcached: str, redis_url: str | None = None) -> None:
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached
    if redis_url is not None:  # the "redis" CACHES alias, here and in the workers
        os.environ["TASKLOCK_TEST_REDIS"] = redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


# -- 1. cycles ---------------------------------------------------------------------


def cycle_variants(port: int) -> dict[str, Callable[[], object]]:
    from django.core.cache import caches
    from pymemcache.client.base import Client

    from django_tasklock import Lock, Semaphore, memcache_lock, single_instance

    raw = Client(("127.0.0.1", port), default_noreply=False)
    cache = caches["default"]

    def floor() -> None:
        raw.add("bench-floor", b"1", 60)
        raw.delete("bench-floor")

    def recipe() -> None:
        if cache.add("bench-recipe", "true", 60):
            cache.delete("bench-recipe")

    def with_memcache_lock() -> None:
        with memcache_lock("bench-memcache-lock", "oid") as acquired:
            assert acquired

    def with_lock() -> None:
        lock = Lock("bench-lock")
        lock.acquire()
        lock.release()

    def with_semaphore() -> None:
        semaphore = Semaphore("bench-semaphore", 3)
        semaphore.acquire()
        semaphore.release()

    @single_instance(on_contention="raise")
    def decorated(feed_url: str, force: bool = False) -> None:
        pass

    def with_single_instance() -> None:
        decorated("https://feeds.example/a.xml")

    return {
        "floor (raw add+delete)": floor,
        "cookbook recipe (cache.add+delete)": recipe,
        "memcache_lock": with_memcache_lock,
        "Lock": with_lock,
        "Semaphore (limit 3)": with_semaphore,
        "@single_instance": with_single_instance,
    }


def measure_cycles(port: int, rounds: int, per_round: int) -> dict[str, list[int]]:
    variants = cycle_variants(port)
    samples: dict[str, list[int]] = {name: [] for name in variants}
    for variant in variants.values():  # warm up connections and caches
        for _ in range(50):
            variant()
    clock = time.perf_counter_ns
    for _ in range(rounds):
        order = list(variants.items())
        random.shuffle(order)
        for name, variant in order:
            bucket = samples[name]
            for _ in range(per_round):
                started = clock()
                variant()
                bucket.append(clock() - started)
    return samples


def measure_fence_wire(port: int, rounds: int, per_round: int) -> dict[str, list[int]]:
    """What a lock and its fencing token cost on the wire: the acquire's ``ms``,
    and the fence's ``ma`` with the check's ``mg`` pipelined as the memcached
    backend sends them when a holder first reads ``fence`` (after an untimed
    ``ms``); each followed by an untimed ``md``, in random order."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    floor = time.time_ns() // 1000
    take = b"ms bench-wire 5 T60 F16 ME c\r\ntoken\r\n"
    requests = {
        "ms (take the lock)": (b"", take, 1),
        "ma + mg (fence, on first read)": (
            take,
            b"ma bench-wire-fence N86400 J%d T86400 v\r\nmg bench-wire c v\r\n" % floor,
            4,  # VA header and value, twice
        ),
    }

    def exchange(request: bytes, lines: int) -> None:
        sock.sendall(request)
        buffer = b""
        while buffer.count(b"\r\n") < lines:
            buffer += sock.recv(4096)

    samples: dict[str, list[int]] = {name: [] for name in requests}
    clock = time.perf_counter_ns
    try:
        for _ in range(rounds):
            order = list(requests.items())
            random.shuffle(order)
            for name, (setup, request, lines) in order:
                for _ in range(per_round):
                    if setup:
                        exchange(setup, 1)
                    started = clock()
                    exchange(request, lines)
                    samples[name].append(clock() - started)
                    exchange(b"md bench-wire\r\n", 1)
    finally:
        sock.close()
    return samples


def p99(values: list[int]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# -- 2. contended ------------------------------------------------------------------


def _tries(memcached: str, where: str) -> dict[str, Callable[[], bool]]:
    """One try at the contended lock, per variant: the floor (raw ``add`` and
    ``delete`` on memcached; on a cluster valkey-py's ``SET NX PX`` and a Lua
    compare-and-delete; on PostgreSQL the store's take and release by hand,
    through psycopg) and ``Lock``; each True if it held the lock."""
    from django_tasklock import Lock

    if where in ("postgres", "pgbouncer"):
        floor = _postgres_floor(where)
    elif where == "cluster":
        from valkey.cluster import ValkeyCluster

        raw = ValkeyCluster.from_url(os.environ["TASKLOCK_TEST_CLUSTER"])
        delete_if = raw.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) end return 0"
        )
        token = f"{os.getpid()}".encode()

        def floor() -> bool:
            if not raw.set("bench-contended-floor", token, nx=True, px=60_000):
                return False
            delete_if(keys=["bench-contended-floor"], args=[token])
            return True
    else:
        from pymemcache.client.base import Client

        host, port = memcached.split(":")
        client = Client((host, int(port)), default_noreply=False)

        def floor() -> bool:
            if not client.add("bench-contended-floor", b"1", 60):
                return False
            client.delete("bench-contended-floor")
            return True

    cache = None if where == "memcached" else where

    def with_lock() -> bool:
        lock = Lock("bench-contended-lock", cache=cache)
        if not lock.acquire():
            return False
        lock.release()
        return True

    return {"floor": floor, "Lock": with_lock}


def _postgres_floor(where: str) -> Callable[[], bool]:
    """The store's take and owner-checked release, by hand: psycopg on an
    autocommit connection of its own, no prepared statements (as through a
    pooler in transaction mode), to the server or to PgBouncer."""
    import psycopg

    from django_tasklock.backends.postgres import statements

    port = os.environ[
        "TASKLOCK_TEST_PGBOUNCER" if where == "pgbouncer" else "TASKLOCK_TEST_POSTGRES"
    ]
    raw = psycopg.connect(
        f"host=127.0.0.1 port={port} user=tasklock dbname=tasklock",
        autocommit=True,
        prepare_threshold=None,
    )
    params = ("bench-contended-floor", f"{os.getpid()}", 60.0)
    take, arguments = psycopg_form(statements.TAKE, params)
    release, released = psycopg_form(statements.RELEASE, params)

    def floor() -> bool:
        if not raw.execute(take, arguments).fetchall():
            return False
        if not raw.execute(release, released).fetchall():
            raise RuntimeError("the floor's release found its take gone")
        return True

    return floor


# A contending process's tries, made (and each tried once, so that every
# client has connected) before any window opens: a cluster client's start,
# slow on a busy machine, once left a whole window without a try.
_prepared: dict[str, Callable[[], bool]] = {}


def _prepare(memcached: str, where: str) -> None:
    """The pool's initializer: Django set up, the tries made and warmed."""
    setup_django(memcached)
    _prepared.update(_tries(memcached, where))
    for attempt in _prepared.values():
        attempt()


def _ready_pid(_: int) -> int:
    time.sleep(0.05)
    return os.getpid()


def contend(variant: str, start_at: float, seconds: float) -> int:
    """One of the contending processes: acquisitions it made in the window."""
    attempt = _prepared[variant]
    count = 0
    while time.monotonic() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.monotonic() < deadline:
        count += attempt()
    return count


def measure_contended(
    memcached: str,
    processes: int,
    seconds: float,
    rounds: int,
    where: str = "memcached",
) -> dict[str, float]:
    """Acquisitions a second of ``processes`` processes on one lock id, per
    variant: on memcached, or on the tests' CACHES alias ``where``."""
    context = multiprocessing.get_context("spawn")
    totals = {"floor": 0, "Lock": 0}
    with context.Pool(
        processes, initializer=_prepare, initargs=(memcached, where)
    ) as pool:
        # Every process up, its tries made: a process runs a task only once
        # its initializer is done, so each pid seen is a ready process.
        ready: set[int] = set()
        deadline = time.monotonic() + 120
        while len(ready) < processes and time.monotonic() < deadline:
            ready.update(pool.map(_ready_pid, range(processes * 4)))
        for _ in range(rounds):
            for variant in random.sample(list(totals), len(totals)):
                start_at = time.monotonic() + 1.0
                arguments = (variant, start_at, seconds)
                counts = pool.starmap(contend, [arguments] * processes)
                totals[variant] += sum(counts)
    return {variant: total / (seconds * rounds) for variant, total in totals.items()}


# -- 3. end to end -----------------------------------------------------------------


def start_workers(
    env: dict[str, str], count: int, concurrency: int
) -> list[subprocess.Popen[bytes]]:
    from benchmarks.celery_bench import app

    workers = [
        celery_worker("benchmarks.celery_bench", f"bench{n}", concurrency, env)
        for n in range(count)
    ]
    deadline = time.monotonic() + 60
    while len(app.control.ping(timeout=0.5)) < count:
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            raise SystemExit("benchmark workers did not start")
    return workers


def measure_storm(
    redis_url: str, tasks: int, distinct: int, rounds: int
) -> dict[str, float]:
    import redis

    from benchmarks import celery_bench

    counter = redis.Redis.from_url(redis_url)
    times: dict[str, list[float]] = {"without lock": [], "@single_instance": []}
    for _ in range(rounds):
        for variant in random.sample(list(times), len(times)):
            task = (
                celery_bench.plain if variant == "without lock" else celery_bench.locked
            )
            counter.delete(celery_bench.DONE)
            started = time.monotonic()
            for n in range(tasks):
                task.delay(n % distinct)
            while int(counter.get(celery_bench.DONE) or 0) < tasks:
                if time.monotonic() - started > 300:
                    raise SystemExit(f"{variant}: the queue did not drain in 300 s")
                time.sleep(0.002)
            times[variant].append(time.monotonic() - started)
    return {variant: statistics.median(values) for variant, values in times.items()}


def measure_scale(counts: tuple[int, ...]) -> list[str]:
    """What the store keeps per lock id: memcached's ``bytes`` and ``curr_items``
    while N distinct locks are held, after they are released, and after they are
    taken, their fence read and released again; each on a fresh server."""
    from django.conf import settings
    from django.test import override_settings

    from django_tasklock import Lock

    lines = [f"    {'store: distinct lock ids':<36} {'bytes/id':>9} {'items/id':>9}"]
    for count in counts:
        for phase in ("held", "released", "fenced, released"):
            server = Memcached().start()
            default = {**settings.CACHES["default"], "LOCATION": server.address}
            try:
                with override_settings(CACHES={**settings.CACHES, "default": default}):
                    before = server.stat("bytes"), server.stat("curr_items")
                    locks = [Lock(f"scale-{n}", expire=600) for n in range(count)]
                    for lock in locks:
                        assert lock.acquire()
                        if phase == "fenced, released":
                            assert lock.fence is not None
                    if phase != "held":
                        for lock in locks:
                            assert lock.release()
                    after = server.stat("bytes"), server.stat("curr_items")
                    for lock in locks:
                        lock.release_quietly()
            finally:
                server.stop()
            per_id = [(a - b) / count for a, b in zip(after, before, strict=True)]
            label = f"{count:,} ids, {phase}"
            lines.append(f"    {label:<36} {per_id[0]:>9.1f} {per_id[1]:>9.2f}")
    return lines


def _overlaps(runs: list[bytes]) -> int:
    """Pairs of runs of one argument that overlapped in time."""
    import json

    by_argument: dict[int, list[tuple[float, float]]] = {}
    for raw in runs:
        n, start, end = json.loads(raw)
        by_argument.setdefault(n, []).append((start, end))
    count = 0
    for holds in by_argument.values():
        holds.sort()
        for i, (_start, end) in enumerate(holds):
            count += sum(1 for later, _ in holds[i + 1 :] if later < end)
    return count


def _drain(counter: Any, name: str, expected: int, limit: float = 300.0) -> float:
    from benchmarks import celery_bench

    started = time.monotonic()
    while int(counter.get(celery_bench.DONE) or 0) < expected:
        if time.monotonic() - started > limit:
            raise SystemExit(f"{name}: the queue did not drain in {limit:.0f} s")
        time.sleep(0.002)
    return time.monotonic() - started


@dataclasses.dataclass
class Peers:
    """Drain-time ratios per spread and variant, overlaps per variant, and the
    runs of the retry probe (each call retries itself once: 2 runs per call)."""

    ratios: dict[int, dict[str, list[float]]]
    overlaps: dict[str, int]
    retry_runs: dict[str, tuple[int, int]]
    delay_cost: dict[str, float]
    #: Kill to the next run of the same call, and the peers' lock timeout.
    killed: dict[str, float | None]
    killed_timeout: int


def measure_peers(
    redis_url: str, tasks: int, spreads: tuple[int, ...], rounds: int
) -> Peers:
    """Drain time of ``tasks`` sends over each number of distinct arguments, for
    each variant, as ratios to no lock in the same round, rounds interleaved in
    random order. Variants that refuse a duplicate at ``.delay()`` publish fewer
    messages; the drain waits for those they did publish. Every run's start and
    end are recorded, and overlapping runs of one argument counted."""
    import redis
    from celery.result import EagerResult

    from benchmarks import celery_bench

    variants = {
        "without lock": celery_bench.plain,
        "@single_instance (memcached)": celery_bench.locked,
        "@single_instance (Redis)": celery_bench.locked_redis,
        "until_finished (memcached)": celery_bench.until_finished,
        "until_finished (Redis)": celery_bench.until_finished_redis,
        "celery_once QueueOnce": celery_bench.once,
        "celery-singleton Singleton": celery_bench.singleton,
    }
    counter = redis.Redis.from_url(redis_url)
    peers = redis.Redis.from_url(redis_url[:-2] + "/5")
    ratios: dict[int, dict[str, list[float]]] = {
        spread: {name: [] for name in variants} for spread in spreads
    }
    overlaps = dict.fromkeys(variants, 0)
    for _ in range(rounds):
        for spread in spreads:
            took: dict[str, float] = {}
            for name in random.sample(list(variants), len(variants)):
                peers.flushdb()
                counter.delete(celery_bench.DONE, celery_bench.RUNS)
                started = time.monotonic()
                # A storm: each argument's sends back to back, as a button
                # pressed again and again (runs of one argument can overlap).
                results = [
                    variants[name].delay(n * spread // tasks) for n in range(tasks)
                ]
                published = len(
                    {r.id for r in results if not isinstance(r, EagerResult)}
                )
                _drain(counter, name, published)
                took[name] = time.monotonic() - started
                overlaps[name] += _overlaps(counter.lrange(celery_bench.RUNS, 0, -1))
            for name in variants:
                ratios[spread][name].append(took[name] / took["without lock"])
    quick = tasks < 100
    return Peers(
        ratios,
        overlaps,
        measure_retries(counter, peers, limit=5 if quick else 20),
        measure_delay(rounds=2 if quick else 5, per_round=50 if quick else 200),
        measure_killed(redis_url, celery_bench.STUCK_TIMEOUT),
        celery_bench.STUCK_TIMEOUT,
    )


def measure_retries(
    counter: Any, peers: Any, calls: int = 10, limit: float = 20
) -> dict[str, tuple[int, int]]:
    """Runs of ``calls`` distinct calls of a task that retries itself once,
    against the runs expected (two per call), waiting at most ``limit`` s."""
    from benchmarks import celery_bench

    variants = {
        "without lock": celery_bench.plain_retry,
        "until_finished (memcached)": celery_bench.until_finished_retry,
        "celery_once QueueOnce": celery_bench.once_retry,
        "celery-singleton Singleton": celery_bench.singleton_retry,
    }
    found: dict[str, tuple[int, int]] = {}
    for name, task in variants.items():
        peers.flushdb()
        counter.delete(celery_bench.DONE, celery_bench.RUNS)
        for n in range(calls):
            task.delay(n)
        with contextlib.suppress(SystemExit):
            _drain(counter, name, calls, limit=limit)
        found[name] = (counter.llen(celery_bench.RUNS), 2 * calls)
    return found


def measure_killed(redis_url: str, timeout: int) -> dict[str, float | None]:
    """Per variant: a call whose pool process is SIGKILLed mid-run, then the same
    call sent again every 0.2 s until it runs; the seconds from the kill to that
    run's start (None: not within the peers' lock timeout + 30 s). Every lock
    lasts longer than the probe: this project's 600 s, the peers' ``timeout``."""
    import redis

    from benchmarks import celery_bench

    variants = {
        "until_finished (memcached)": celery_bench.until_finished_stuck,
        "celery_once QueueOnce": celery_bench.once_stuck,
        "celery-singleton Singleton": celery_bench.singleton_stuck,
    }
    counter = redis.Redis.from_url(redis_url)
    peers = redis.Redis.from_url(redis_url[:-2] + "/5")

    def runs(n: int) -> list[tuple[int, float]]:
        found = [json.loads(run) for run in counter.lrange(celery_bench.STUCK, 0, -1)]
        return [(pid, start) for number, pid, start in found if number == n]

    took: dict[str, float | None] = {}
    counter.delete(celery_bench.STUCK)
    for n, (name, task) in enumerate(variants.items()):
        peers.flushdb()
        task.delay(n)
        deadline = time.monotonic() + 60
        while not runs(n):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the call to kill never started")
            time.sleep(0.05)
        os.kill(runs(n)[0][0], signal.SIGKILL)
        killed = time.monotonic()
        while len(runs(n)) < 2 and time.monotonic() < killed + timeout + 30:
            task.delay(n)
            time.sleep(0.2)
        found = runs(n)
        took[name] = found[1][1] - killed if len(found) > 1 else None
        for pid, _ in found[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return took


def measure_delay(rounds: int, per_round: int = 200) -> dict[str, float]:
    """Microseconds per ``.delay()`` in this process (the workers consume
    meanwhile): a plain publish; an until_finished call that is published (its
    lock taken, then the publish); one that finds an identical call pending and
    joins it (no publish)."""
    from benchmarks import celery_bench

    samples: dict[str, list[float]] = {"plain": [], "published": [], "joined": []}
    base = 1_000_000
    for round_ in range(rounds):
        for kind in random.sample(list(samples), len(samples)):
            offset = base + round_ * per_round
            started = time.perf_counter()
            for i in range(per_round):
                if kind == "plain":
                    celery_bench.plain.delay(offset + i)
                elif kind == "published":
                    celery_bench.until_finished.delay(offset + i)
                else:
                    celery_bench.until_finished.delay(base - 1)
            samples[kind].append((time.perf_counter() - started) / per_round * 1e6)
    return {kind: statistics.median(values) for kind, values in samples.items()}


def render_peers(peers: Peers, tasks: int, command: str) -> str:
    ratios = peers.ratios
    spreads = list(ratios)
    header = "".join(f"{f'{s} distinct':>22}" for s in spreads)
    rounds = len(next(iter(ratios.values()))["without lock"])
    lines = [
        f"``{command}``: {tasks} sends, 5 ms bodies, two prefork workers (2 "
        "processes each) on a private Redis broker; drain time as a ratio to no "
        f"lock in the same round, median of {rounds} rounds [lowest-highest]; "
        "overlapping runs of one argument, counted over every round:",
        "",
        ".. code-block:: text",
        "",
        f"    {'variant':<30}{header}{'overlaps':>10}",
    ]
    for name in ratios[spreads[0]]:
        cells = ""
        for spread in spreads:
            values = ratios[spread][name]
            cell = f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"
            cells += f"{cell:>22}"
        lines.append(f"    {name:<30}{cells}{peers.overlaps[name]:>10}")
    lines += ["", f"    {'retry probe: a call that retries once':<44}{'runs':>12}"]
    for name, (ran, expected) in peers.retry_runs.items():
        verdict = "" if ran == expected else "  retries lost"
        lines.append(f"    {name:<44}{f'{ran} of {expected}':>12}{verdict}")
    cost = peers.delay_cost
    lines += [
        "",
        f"    {'one .delay() in the caller':<44}{'median':>12}",
        f"    {'plain (publish)':<44}{cost['plain']:>10.0f}us",
        f"    {'until_finished, published (lock + publish)':<44}"
        f"{cost['published']:>10.0f}us",
        f"    {'until_finished, joined (no publish)':<44}{cost['joined']:>10.0f}us",
        "",
        f"    {'pool process SIGKILLed mid-run: next run':<44}{'after kill':>12}",
    ]
    for name, took in peers.killed.items():
        shown = "never" if took is None else f"{took:.1f}s"
        lock = (
            "600 s lock"
            if name.startswith("until")
            else (f"timeout {peers.killed_timeout} s")
        )
        lines.append(f"    {name:<44}{shown:>12}  ({lock})")
    return "\n".join(lines) + "\n"


# -- report ------------------------------------------------------------------------


def versions(memcached: Memcached) -> str:
    import celery
    import django
    import pymemcache

    server = memcached.raw(b"version").decode().removeprefix("VERSION ")
    return (
        f"Python {platform.python_version()}, Django {django.__version__}, "
        f"pymemcache {pymemcache.__version__}, Celery {celery.__version__}, "
        f"memcached {server}, {os.cpu_count()} CPUs"
    )


def render(
    samples: dict[str, list[int]],
    wire: dict[str, list[int]],
    contended: dict[str, float],
    storm: dict[str, float] | None,
    about: str,
    command: str,
    stores: dict[str, dict[str, float]] | None = None,
) -> tuple[str, list[str]]:
    floor = statistics.median(samples["floor (raw add+delete)"])
    misses: list[str] = []
    lines = [
        f"``{command}`` ({about}):",
        "",
        ".. code-block:: text",
        "",
        f"    {'cycle: acquire + release':<36} {'median':>9} {'p99':>9} {'x floor':>8}  target",
    ]
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / floor
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            verdict = f"<= {target}x " + ("met" if ratio <= target else "MISSED")
            if ratio > target:
                misses.append(f"{name}: {ratio:.2f}x the floor (target {target}x)")
        lines.append(
            f"    {name:<36} {median / 1000:>7.1f}us {p99(values) / 1000:>7.1f}us "
            f"{ratio:>7.2f}x  {verdict}"
        )
    plain = statistics.median(next(iter(wire.values())))
    lines += [
        "",
        f"    {'on the wire: one round trip':<36} {'median':>9} {'p99':>9} {'change':>8}",
    ]
    for index, (name, values) in enumerate(wire.items()):
        median = statistics.median(values)
        change = f"{(median - plain) / 1000:>+6.1f}us" if index else ""
        lines.append(
            f"    {name:<36} {median / 1000:>7.1f}us {p99(values) / 1000:>7.1f}us {change:>8}"
        )
    ratio = contended["Lock"] / contended["floor"]
    if ratio < 0.9:
        misses.append(
            f"contended: {ratio:.2f}x the floor's acquisitions/s (target 0.9x)"
        )
    lines += [
        "",
        f"    {'contended: 8 processes, one lock id':<36} {'acq/s':>9} {'':>9} {'x floor':>8}",
        f"    {'floor (raw add+delete)':<36} {contended['floor']:>9.0f} {'':>9} {1:>7.2f}x",
        f"    {'Lock':<36} {contended['Lock']:>9.0f} {'':>9} {ratio:>7.2f}x  "
        f">= 0.9x {'met' if ratio >= 0.9 else 'MISSED'}",
    ]
    for where, measured in (stores or {}).items():
        title, floor_name, lock_name = STORE_ROWS[where]
        versus = measured["Lock"] / measured["floor"]
        lines += [
            "",
            f"    {title:<36} {'acq/s':>9} {'':>9} {'x floor':>8}",
            f"    {floor_name:<36} {measured['floor']:>9.0f} {'':>9} {1:>7.2f}x",
            f"    {lock_name:<36} {measured['Lock']:>9.0f} {'':>9} {versus:>7.2f}x",
        ]
    if storm is not None:
        slower = storm["@single_instance"] / storm["without lock"] - 1
        if slower > 0.10:
            misses.append(f"end to end: {slower:+.0%} time to drain (target +10%)")
        lines += [
            "",
            f"    {'end to end: duplicate storm':<36} {'drained':>9} {'':>9} {'change':>8}",
            f"    {'without lock':<36} {storm['without lock']:>8.2f}s",
            f"    {'@single_instance':<36} {storm['@single_instance']:>8.2f}s {'':>9} "
            f"{slower:>+7.0%}   <= +10% {'met' if slower <= 0.10 else 'MISSED'}",
        ]
    return "\n".join(lines) + "\n", misses


#: A store's contention rows: their title and the names of their two rows.
STORE_ROWS = {
    "cluster": (
        "contended on a Redis Cluster",
        "floor (valkey-py SET NX + Lua del)",
        "Lock (ClusterValkeyCache)",
    ),
    "postgres": (
        "contended on PostgreSQL",
        "floor (psycopg: take + release)",
        "Lock (PostgresCache)",
    ),
    "pgbouncer": (
        "contended through PgBouncer",
        "floor (psycopg: take + release)",
        "Lock (PostgresCache)",
    ),
}


def measure_postgres(
    memcached: str, seconds: float, rounds: int
) -> dict[str, dict[str, float]]:
    """Contention on a private PostgreSQL (its lock table made) and through
    a PgBouncer in transaction pooling mode in front of it."""
    from tests.services_pg import lock_servers

    with lock_servers():
        return {
            where: measure_contended(memcached, 8, seconds, rounds, where=where)
            for where in ("postgres", "pgbouncer")
        }


def write_docs(table: str) -> None:
    write_section(TABLE_START, TABLE_END, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="update docs/explanation/performance.rst",
    )
    parser.add_argument("--no-storm", action="store_true", help="skip the Celery storm")
    options = parser.parse_args(argv)
    quick = options.quick
    memcached = Memcached().start()
    redis_server = Redis().start() if not options.no_storm else None
    workers: list[subprocess.Popen[bytes]] = []
    try:
        setup_django(
            memcached.address, None if redis_server is None else redis_server.url
        )
        print(f"memcached on {memcached.address}; measuring cycles...", flush=True)
        samples = measure_cycles(
            memcached.port, rounds=3 if quick else 20, per_round=50 if quick else 250
        )
        wire = measure_fence_wire(
            memcached.port, rounds=3 if quick else 20, per_round=50 if quick else 250
        )
        print("contended...", flush=True)
        contended = measure_contended(
            memcached.address,
            processes=8,
            seconds=0.5 if quick else 3.0,
            rounds=1 if quick else 2,
        )
        print("contended on a cluster...", flush=True)
        cluster = RedisCluster().start()
        try:
            os.environ["TASKLOCK_TEST_CLUSTER"] = cluster.url
            on_cluster = measure_contended(
                memcached.address,
                processes=8,
                seconds=0.5 if quick else 3.0,
                rounds=1 if quick else 2,
                where="cluster",
            )
        finally:
            cluster.stop()
        print("contended on PostgreSQL, directly and through PgBouncer...", flush=True)
        on_postgres = measure_postgres(
            memcached.address, seconds=0.5 if quick else 3.0, rounds=1 if quick else 2
        )
        print("what the store keeps per lock id...", flush=True)
        scale = measure_scale((1_000,) if quick else (10_000, 100_000))
        storm = peers = None
        if redis_server is not None:
            print("end to end storm over celery workers...", flush=True)
            env = {
                **os.environ,
                "TASKLOCK_BENCH_BROKER": f"{redis_server.url[:-2]}/1",
                "TASKLOCK_TEST_REDIS": redis_server.url,
                "TASKLOCK_BENCH_STUCK_TIMEOUT": "10" if quick else "30",
            }
            os.environ.update(env)
            workers = start_workers(env, count=2, concurrency=2)
            storm = measure_storm(
                f"{redis_server.url[:-2]}/2",
                tasks=40 if quick else 400,
                distinct=10,
                rounds=1 if quick else 3,
            )
            print("end to end beside celery_once and celery-singleton...", flush=True)
            peers = measure_peers(
                f"{redis_server.url[:-2]}/2",
                tasks=40 if quick else 400,
                spreads=(10, 40 if quick else 400),
                rounds=1 if quick else 3,
            )
        command = "python -m benchmarks.bench" + (" --quick" if quick else "")
        table, misses = render(
            samples,
            wire,
            contended,
            storm,
            versions(memcached),
            command,
            {"cluster": on_cluster, **on_postgres},
        )
        table += "\n" + "\n".join(scale) + "\n"
        print()
        print(table)
        peer_table = ""
        if peers is not None:
            peer_table = render_peers(peers, 40 if quick else 400, command)
            print(peer_table)
        for miss in misses:
            print(f"target missed: {miss}")
        if options.write_docs:
            write_docs(table)
            if peer_table:
                write_section(PEERS_START, PEERS_END, peer_table)
            print("docs/explanation/performance.rst updated.")
    finally:
        for worker in workers:
            stop_process(worker)
        if redis_server is not None:
            redis_server.stop()
        memcached.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
