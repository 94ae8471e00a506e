"""Client CPU per lock operation, in instructions counted by valgrind's callgrind.

    python -m benchmarks.cpu [--quick] [--write-docs]

Wall-clock ratios on a shared machine swing from run to run; instruction counts
do not. Each operation runs in a Python of its own under ``valgrind
--tool=callgrind`` (``PYTHONHASHSEED=0``; the ``--quick`` smoke run's two
share one), against private memcached and Redis servers: start-up, a warm-up,
then N measured iterations between two marks. A mark is a call of
``os.getppid()``, which callgrind is told to dump its counters before
(``--dump-before=getppid``), so the part between an operation's two marks
counts its iterations alone; divided by N, it is what one operation costs the
client, with nothing of start-up in it. Start-up runs uninstrumented
(``--instr-atstart=no``); the probe turns callgrind on after it
(``benchmarks/valgrind.py``). The heap is frozen (``gc.freeze()``)
before each operation's first mark. Ratios are to the raw floor of the same
store in the same run: pymemcache ``add`` + ``delete`` on memcached, redis-py
``SET NX PX`` + a Lua compare-and-delete on Redis, psycopg's ``execute`` of
the store's own take (``INSERT ... ON CONFLICT``) and owner-checked
``DELETE`` on PostgreSQL (a private server of the run's, as the others).

The probe (``python -m benchmarks.cpu probe N OPERATION...``) is what runs under
valgrind; it is not meant to be called by hand.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import psycopg_form, write_section  # noqa: E402
from benchmarks.valgrind import start_instrumentation  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable

TABLE_START = ".. cpu-table-start"
TABLE_END = ".. cpu-table-end"
WARM_UP = 50
#: Settings of a project with no fence fields: its blocks push no holder.
PROBE_SETTINGS = "benchmarks.probe_settings"
#: Rows measured as in a project whose models have fence fields.
FENCES_ON = ", fence fields on"
_PG_FLOOR = "floor: psycopg INSERT ON CONFLICT + DELETE"
#: Operation, its floor, and the target ratio to that floor (None: no target).
OPERATIONS: list[tuple[str, str, float | None]] = [
    ("floor: raw add + delete", "", None),
    ("cookbook recipe: cache.add + delete", "floor: raw add + delete", None),
    ("memcache_lock cycle", "floor: raw add + delete", 1.3),
    ("memcache_lock cycle, fence fields on", "floor: raw add + delete", None),
    ("Lock cycle", "floor: raw add + delete", 1.3),
    ("@single_instance call (one argument)", "floor: raw add + delete", 1.6),
    ("floor: raw add, refused", "", None),
    ("Lock acquire, refused", "floor: raw add, refused", 1.3),
    ("Semaphore(limit=3) cycle", "floor: raw add + delete", None),
    ("RateLimiter.admit(), smooth", "floor: raw add + delete", None),
    ("RateLimiter.admit(), window", "floor: raw add + delete", None),
    ("floor: redis-py SET NX PX + Lua delete", "", None),
    ("Lock cycle on Redis", "floor: redis-py SET NX PX + Lua delete", 1.3),
    ("RateLimiter.admit() on Redis", "floor: redis-py SET NX PX + Lua delete", None),
    ("floor: plain .delay() (memory broker)", "", None),
    (
        "until_finished .delay(), published",
        "floor: plain .delay() (memory broker)",
        None,
    ),
    ("until_finished .delay(), joined", "floor: plain .delay() (memory broker)", None),
    # Async: one event loop runs every iteration (the loop's own work, its
    # epoll waits among it, is counted on both sides of each ratio).
    ("async floor: aiomcache add + delete", "", None),
    ("async bare wire: ms + md, no lock", "async floor: aiomcache add + delete", None),
    ("async Lock cycle", "async floor: aiomcache add + delete", 1.1),
    ("async floor: redis.asyncio SET NX PX + Lua delete", "", None),
    (
        "async Lock cycle on Redis",
        "async floor: redis.asyncio SET NX PX + Lua delete",
        1.1,
    ),
    ("floor: psycopg INSERT ON CONFLICT + DELETE", "", None),
    ("libpq's C, the same two (no Python)", _PG_FLOOR, None),
    ("bare wire on PostgreSQL: the two, no lock", _PG_FLOOR, None),
    ("Lock cycle on PostgreSQL", _PG_FLOOR, 1.1),
    ("floor: valkey-py cluster SET NX PX + Lua delete", "", None),
    (
        "Lock cycle on a cluster",
        "floor: valkey-py cluster SET NX PX + Lua delete",
        1.05,
    ),
]


# -- the probe: runs under valgrind ------------------------------------------------


def _operations() -> dict[str, Callable[[], object]]:
    from django.core.cache import caches
    from pymemcache.client.base import Client

    from django_tasklock import Lock, Semaphore, memcache_lock, single_instance

    port = int(os.environ["TASKLOCK_TEST_MEMCACHED"].rsplit(":", 1)[1])
    raw = Client(("127.0.0.1", port), default_noreply=False)
    cache = caches["default"]
    import redis

    raw_redis = redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"])
    holder = Lock("cpu-held", expire=600)
    holder.acquire()
    raw.set("cpu-raw-held", b"1", 600)

    def floor() -> None:
        raw.add("cpu-floor", b"1", 60)
        raw.delete("cpu-floor")

    def recipe() -> None:
        if cache.add("cpu-recipe", "true", 60):
            cache.delete("cpu-recipe")

    def with_memcache_lock() -> None:
        with memcache_lock("cpu-memcache-lock", "oid") as acquired:
            assert acquired

    def lock_cycle() -> None:
        lock = Lock("cpu-lock")
        lock.acquire()
        lock.release()

    @single_instance(on_contention="raise")
    def decorated(feed_url: str) -> None:
        pass

    def refused_raw() -> None:
        raw.add("cpu-raw-held", b"1", 60)

    def refused() -> None:
        Lock("cpu-held").acquire()

    def semaphore_cycle() -> None:
        semaphore = Semaphore("cpu-semaphore", 3)
        semaphore.acquire()
        semaphore.release()

    redis_floor, redis_lock_cycle = _floor_and_cycle(raw_redis, "redis")

    # Rate limits that always admit: the smooth kind's state is one number;
    # the window kind's holds the admissions of its last period, here a
    # millisecond (one entry: its per-admission floor).
    from django_tasklock import RateLimiter

    smooth = RateLimiter("cpu-smooth", "1000000/s", kind="smooth")
    window = RateLimiter("cpu-window", "10/0.001s", kind="window")
    smooth_redis = RateLimiter("cpu-smooth", "1000000/s", kind="smooth", cache="redis")
    for limiter in (smooth, window, smooth_redis):
        limiter.reset()

    # .delay() on kombu's in-memory broker: the client's cost of a publish,
    # with the enqueue-time lock (new arguments every time) and without one
    # (the same arguments: every call after the first joins it).
    from benchmarks import celery_bench

    arguments = itertools.count()

    def plain_delay() -> None:
        celery_bench.plain.delay(next(arguments))

    def published_delay() -> None:
        celery_bench.until_finished.delay(next(arguments))

    def joined_delay() -> None:
        celery_bench.until_finished.delay(-1)

    cluster_floor, cluster_lock_cycle = _cluster_operations()
    postgres_floor, postgres_psycopg, postgres_wire, postgres_lock_cycle = (
        _postgres_operations()
    )
    functions = [
        floor,
        recipe,
        with_memcache_lock,
        with_memcache_lock,  # (fence fields on: the probe says so first)
        lock_cycle,
        lambda: decorated("https://feeds.example/a.xml"),
        refused_raw,
        refused,
        semaphore_cycle,
        smooth.admit,
        window.admit,
        redis_floor,
        redis_lock_cycle,
        smooth_redis.admit,
        plain_delay,
        published_delay,
        joined_delay,
        postgres_psycopg,
        postgres_floor,
        postgres_wire,
        postgres_lock_cycle,
        cluster_floor,
        cluster_lock_cycle,
    ]
    names = [name for name, _, _ in OPERATIONS if name not in ASYNC]
    return dict(zip(names, functions, strict=True))


def _cluster_operations() -> tuple[Callable[[], object], Callable[[], object]]:
    """The cluster floor (valkey-py's cluster client: SET NX PX, then a Lua
    compare-and-delete, on one key) and a Lock cycle on the ``cluster`` alias;
    both raise if no cluster was started (TASKLOCK_TEST_CLUSTER)."""
    url = os.environ.get("TASKLOCK_TEST_CLUSTER")
    if url is None:

        def missing() -> None:
            raise RuntimeError("no cluster: run it through benchmarks.cpu")

        return missing, missing
    from valkey.cluster import ValkeyCluster

    return _floor_and_cycle(ValkeyCluster.from_url(url), "cluster")


def _postgres_operations() -> tuple[
    Callable[[], object],
    Callable[[], object],
    Callable[[], object],
    Callable[[], object],
]:
    """PostgreSQL: the store's own two statements (the take, an ``INSERT ...
    ON CONFLICT ... DO UPDATE ... WHERE`` expired, and the owner-checked
    ``DELETE``) by hand through libpq's C (``psycopg.pq``'s ``PQexecParams``,
    blocking: what no Python client can undercut); the floor, the same two by
    hand through psycopg's ``Connection.execute`` (autocommit, no prepared
    statements, as through a pooler); the two through the store's own
    connection (``wire``); and a Lock cycle on the ``postgres`` alias."""
    import psycopg

    from django_tasklock import Lock
    from django_tasklock.backends.postgres import statements

    port = os.environ["TASKLOCK_TEST_POSTGRES"]
    dsn = f"host=127.0.0.1 port={port} user=tasklock dbname=tasklock"
    raw = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
    # (Its Connection kept: dropped, it would close the pgconn under us.)
    libpq_owner = psycopg.connect(dsn, autocommit=True)
    libpq = libpq_owner.pgconn
    take_args = [b"cpu-pg-floor", b"token", b"60.0"]

    def floor() -> None:
        taken = libpq.exec_params(statements.TAKE, take_args)
        released = libpq.exec_params(statements.RELEASE, take_args[:2])
        if taken.ntuples != 1 or released.ntuples != 1:
            raise RuntimeError(
                f"the floor's statements failed: {libpq.error_message!r}"
            )

    params = ("cpu-pg-psycopg", "token", 60.0)
    take, take_params = psycopg_form(statements.TAKE, params)
    release, release_params = psycopg_form(statements.RELEASE, params)

    def with_psycopg() -> None:
        raw.execute(take, take_params).fetchall()
        raw.execute(release, release_params).fetchall()

    from django_tasklock.backends.postgres.wire import Wire

    wire = Wire(dsn, 2.0, "bench")
    wire_args = ("cpu-pg-wire", "token", "60.0")

    def bare_wire() -> None:
        wire.query(statements.TAKE, wire_args)
        wire.query(statements.RELEASE, wire_args[:2])

    def lock_cycle() -> None:
        lock = Lock("cpu-postgres-lock", cache="postgres")
        lock.acquire()
        lock.release()

    return floor, with_psycopg, bare_wire, lock_cycle


def _floor_and_cycle(
    raw: Any, alias: str
) -> tuple[Callable[[], object], Callable[[], object]]:
    """A Redis-protocol floor on the client ``raw`` (SET NX PX, then a Lua
    compare-and-delete) and a Lock cycle on the CACHES alias ``alias``."""
    from django_tasklock import Lock

    delete_if = raw.register_script(
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) end return 0"
    )
    floor_key = f"cpu-{alias}-floor"

    def floor() -> None:
        raw.set(floor_key, b"token", nx=True, px=60_000)
        delete_if(keys=[floor_key], args=[b"token"])

    def lock_cycle() -> None:
        lock = Lock(f"cpu-{alias}-lock", cache=alias)
        lock.acquire()
        lock.release()

    return floor, lock_cycle


#: The async rows (``benchmarks.asyncio_locks``' variants), by their names there.
ASYNC = {
    "async floor: aiomcache add + delete": "memcached: floor (aiomcache add + delete)",
    "async bare wire: ms + md, no lock": "memcached: the bare wire (ms + md, no lock)",
    "async Lock cycle": "memcached: async Lock cycle",
    "async floor: redis.asyncio SET NX PX + Lua delete": (
        "Redis: floor (redis.asyncio SET NX PX + Lua delete)"
    ),
    "async Lock cycle on Redis": "Redis: async Lock cycle",
}


def probe(operations: list[str], iterations: int) -> None:
    """Start-up, then each of ``operations`` in turn: a warm-up, then
    ``iterations`` of it between two marks."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", PROBE_SETTINGS)
    import django

    django.setup()
    from django_tasklock.locks.fencing import FENCES_WANTED

    functions = _operations()
    # Counted from here (the valgrind run starts with --instr-atstart=no):
    # start-up under full instrumentation was most of a run's CPU, and none of
    # it reached a figure, which counts what lies between two marks.
    start_instrumentation()
    for operation in operations:
        if operation in ASYNC:
            import asyncio

            asyncio.run(_probe_async(ASYNC[operation], iterations))
        else:
            # As in a project with a model with a FenceField, or none.
            FENCES_WANTED[0] = operation.endswith(FENCES_ON)
            function = functions[operation]
            for _ in range(WARM_UP):
                function()
            _measured(function, iterations)


def _frozen() -> None:
    """What came before is kept out of the collector's reach: a collection of
    the whole heap costs millions of instructions, and when one comes depends
    on the liveness thread's allocations, which follow the clock."""
    gc.collect()
    gc.freeze()


def _measured(function: Callable[[], object], iterations: int) -> None:
    _frozen()
    os.getppid()  # a mark: callgrind dumps its counters here and below
    for _ in range(iterations):
        function()
    os.getppid()


async def _probe_async(variant: str, iterations: int) -> None:
    from benchmarks.asyncio_locks import _variants, close_variants

    function = (await _variants())[variant]
    try:
        for _ in range(WARM_UP):
            await function()
        _frozen()
        os.getppid()  # the marks, as in _measured()
        for _ in range(iterations):
            await function()
        os.getppid()
    finally:
        await close_variants()


# -- the driver --------------------------------------------------------------------


def instructions(
    operations: list[str], iterations: int, env: dict[str, str]
) -> dict[str, int]:
    """For each of ``operations``, the instructions the main thread of one run
    of the probe executed between that operation's two marks: ``iterations``
    operations. Callgrind writes part n of thread 1 as callgrind.out.n-01 at
    the n-th mark, the last part at exit: operation i (from 0) is part 2i+2."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                # The probe's own thread only: a background thread's work (the
                # liveness record, written every second) follows the clock,
                # which valgrind slows fifty-fold, not the operations.
                "--separate-threads=yes",
                # Start-up runs uninstrumented, several times faster; the
                # probe turns instrumentation on before its first warm-up.
                "--instr-atstart=no",
                "--dump-before=getppid",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "benchmarks.cpu",
                "probe",
                str(iterations),
                *operations,
            ],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        parts = list(Path(folder).glob("callgrind.out.*-01"))
        if len(parts) != 2 * len(operations) or not Path(f"{out}-01").exists():
            raise RuntimeError(
                f"callgrind wrote {len(parts) + 1} parts for the probe's main thread, "
                f"not {2 * len(operations) + 1}: something else called getppid() in it"
            )
        return {
            operation: _total(Path(f"{out}.{2 * i + 2}-01"))
            for i, operation in enumerate(operations)
        }


def _total(part: Path) -> int:
    match = re.search(
        r"^(?:summary|totals):\s+(\d+)", part.read_text(errors="replace"), re.M
    )
    if match is None:
        raise RuntimeError(f"callgrind wrote no instruction total in {part.name}")
    return int(match.group(1))


def measure(
    iterations: int, names: list[str] | None = None, *, together: bool = False
) -> dict[str, float]:
    from tests.services import Memcached, Redis, RedisCluster

    if shutil.which("valgrind") is None:
        raise SystemExit(
            "valgrind is not installed: run `make bench-cpu` (it installs it), or "
            "apt-get install -y valgrind"
        )
    from django_tasklock.backends.postgres.statements import CREATE
    from tests.services_pg import Postgres

    memcached, redis_server = Memcached().start(), Redis().start()
    postgres = Postgres().start()
    postgres.execute(CREATE)
    servers: list[Any] = [memcached, redis_server, postgres]
    # Every module the probe imports is compiled once, by the run outside
    # valgrind below, into a cache of this measurement's own (written even
    # under PYTHONDONTWRITEBYTECODE): compiling under valgrind is slow. It
    # would not count: the iterations come after start-up and a warm-up.
    bytecode = tempfile.TemporaryDirectory(prefix="tasklock-cpu-pyc-")
    env = {
        # Not under coverage, even when the suite's smoke run starts it: a
        # probe counts the client's own instructions.
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith("COVERAGE_") and k != "PYTHONDONTWRITEBYTECODE"
        },
        "PYTHONPYCACHEPREFIX": bytecode.name,
        "PYTHONHASHSEED": "0",
        "DJANGO_SETTINGS_MODULE": PROBE_SETTINGS,
        "TASKLOCK_TEST_MEMCACHED": memcached.address,
        "TASKLOCK_TEST_REDIS": redis_server.url,
        "TASKLOCK_TEST_POSTGRES": str(postgres.port),
    }
    if names is None:  # (the quick run's operations need no cluster)
        cluster = RedisCluster().start()
        servers.append(cluster)
        cluster_cache = {
            "BACKEND": "django_valkey.cluster_cache.cache.ClusterValkeyCache",
            "LOCATION": cluster.url,
        }
        env["TASKLOCK_TEST_CLUSTER"] = cluster.url
        env["TASKLOCK_TEST_EXTRA_CACHES"] = json.dumps({"cluster": cluster_cache})
    chosen = [name for name, _, _ in OPERATIONS if names is None or name in names]
    try:
        # Once outside valgrind first, which compiles the modules it imports.
        subprocess.run(
            [sys.executable, "-m", "benchmarks.cpu", "probe", "1", *chosen],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        # One Python per operation, so that none is measured in the state an
        # earlier one left (the cluster floor differed by 1 % that way); the
        # smoke run (``together``) measures its two in one, at half the cost.
        counts: dict[str, int] = {}
        for group in [chosen] if together else [[name] for name in chosen]:
            counts.update(instructions(group, iterations, env))
    finally:
        for server in servers:
            getattr(server, "remove", server.stop)()
        bytecode.cleanup()
    return {name: count / iterations for name, count in counts.items()}


def render(counts: dict[str, float], iterations: int, command: str) -> str:
    lines = [
        f"``{command}`` (client instructions per operation, {iterations} iterations, "
        f"Python {sys.version.split()[0]}, PYTHONHASHSEED=0):",
        "",
        ".. code-block:: text",
        "",
        f"    {'operation':<42} {'instructions':>12} {'x floor':>8}  target",
    ]
    for name, floor, target in OPERATIONS:
        if name not in counts:
            continue
        count = counts[name]
        ratio = count / counts[floor] if floor in counts else 1.0
        verdict = ""
        if target is not None:
            verdict = f"<= {target}x " + ("met" if ratio <= target else "MISSED")
        lines.append(f"    {name:<42} {count:>12,.0f} {ratio:>7.2f}x  {verdict}")
    wire, lock = (
        counts.get("async bare wire: ms + md, no lock"),
        counts.get("async Lock cycle"),
    )
    if wire and lock:
        lines += [
            "",
            f"The async Lock cycle on memcached is {lock / wire:.2f}x the bare wire "
            "beneath it (no target).",
        ]
    return "\n".join(lines) + "\n"


def chosen(only: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The operations ``--only`` names, each with its floor, in table order."""
    floors = {name: floor for name, floor, _ in OPERATIONS}
    unknown = [name for name in only if name not in floors]
    if unknown:
        parser.error(
            f"no operation {unknown[0]!r}; the operations: "
            + ", ".join(repr(name) for name in floors)
        )
    wanted = set(only) | {floors[name] for name in only if floors[name]}
    return [name for name in floors if name in wanted]


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["probe"]:
        probe(arguments[2:], int(arguments[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--only",
        action="append",
        metavar="OPERATION",
        help="measure this operation (and its floor) alone; may be repeated",
    )
    options = parser.parse_args(arguments)
    # Iterations cost little beside a start-up under valgrind (2,000 cycles
    # are about a twentieth of one). Only they are counted (between the
    # probe's marks); start-up is not subtracted, so its spread between two
    # runs (millions of instructions on a busy machine, which made the
    # earlier method's smoke run count a Lock cycle at 0.39 of the floor
    # once) no longer reaches the figures.
    iterations = 2_000
    names = ["floor: raw add + delete", "Lock cycle"] if options.quick else None
    if options.only:
        if options.write_docs:
            parser.error("--write-docs publishes the whole table: drop --only")
        names = chosen(options.only, parser)
    counts = measure(iterations, names, together=options.quick)
    table = render(
        counts,
        iterations,
        "python -m benchmarks.cpu" + (" --quick" if options.quick else ""),
    )
    print(table)
    if options.write_docs:
        write_section(TABLE_START, TABLE_END, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
