"""Async locks against their floors, and a storm of coroutines and processes.

    python -m benchmarks.asyncio_locks [--quick]

Everything runs against one private memcached and one private Redis, in one
run, so the ratios compare like with like on a shared, noisy machine:

1. Cycles, in one event loop, per store: the raw async floor (the asyncio
   memcached client's add + delete, ``aiomcache``, as pymemcache's are the
   sync floor; ``redis.asyncio`` ``SET NX PX`` + a Lua compare-and-delete),
   the bare wire under the memcached lock (``ms`` + ``md`` written on this
   package's own connection: no key, no token, no lock), an async ``Lock``
   cycle (``aacquire`` + ``arelease``) and the cookbook recipe through
   ``asgiref``'s ``sync_to_async`` (``cache.add`` + ``cache.delete``, which
   is what Django's own async cache methods do), in rounds that interleave them (each
   round in a new random order). Median per cycle and its ratio to the floor.
2. Storm: 1,000 coroutines over 10 lock ids, waiting with
   ``aacquire(blocking=True)``, in this process and in 4 processes beside it:
   overlapping holds of one id (measured), holds, and each loop's largest lag
   (how much later than asked a probe's 5 ms sleep woke).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.services import Memcached, Redis  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

#: The target ratio of an async Lock cycle to its store's raw async floor.
TARGET = 1.1
#: What ``_variants`` opened beside the package's own connections (closed by
#: ``close_variants``).
_opened: list[Callable[[], Awaitable[object]]] = []
#: The longest a callback may hold the event loop (a coroutine step, CPU time).
BLOCK_TARGET = 0.010


def setup_django(memcached: str, redis_url: str) -> None:
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached
    os.environ["TASKLOCK_TEST_REDIS"] = redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


async def _variants() -> dict[str, Callable[[], Awaitable[object]]]:
    """Per store: its floor, an async Lock cycle, the recipe via sync_to_async."""
    import aiomcache
    import redis.asyncio
    from asgiref.sync import sync_to_async
    from django.core.cache import caches

    from django_tasklock import Lock
    from django_tasklock.aio import async_backend_for

    store: Any = async_backend_for("default", "meta")
    server = store._server("bench-async-wire")
    conn = await server.connection("default", "meta")

    async def memcached_wire() -> None:
        await conn.send(b"ms bench-async-wire 5 T60 ME\r\ntoken\r\n")
        await conn.send(b"md bench-async-wire\r\n")

    host, port = os.environ["TASKLOCK_TEST_MEMCACHED"].rsplit(":", 1)
    client = aiomcache.Client(host, int(port))
    _opened.append(client.close)

    async def memcached_floor() -> None:
        await client.add(b"bench-async-floor", b"token", exptime=60)
        await client.delete(b"bench-async-floor")

    async def memcached_lock() -> None:
        lock = Lock("bench-async-lock")
        await lock.aacquire()
        await lock.arelease()

    raw = redis.asyncio.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"])
    _opened.append(getattr(raw, "aclose", None) or raw.close)
    delete_if = raw.register_script(
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) end return 0"
    )

    async def redis_floor() -> None:
        await raw.set("bench-async-floor", b"token", nx=True, px=60_000)
        await delete_if(keys=["bench-async-floor"], args=[b"token"])

    async def redis_lock() -> None:
        lock = Lock("bench-async-lock", cache="redis")
        await lock.aacquire()
        await lock.arelease()

    def recipe_on(alias: str) -> Callable[[], Awaitable[object]]:
        cache = caches[alias]
        add, delete = sync_to_async(cache.add), sync_to_async(cache.delete)

        async def recipe() -> None:
            if await add("bench-async-recipe", "true", 60):
                await delete("bench-async-recipe")

        return recipe

    return {
        "memcached: floor (aiomcache add + delete)": memcached_floor,
        "memcached: the bare wire (ms + md, no lock)": memcached_wire,
        "memcached: async Lock cycle": memcached_lock,
        "memcached: sync_to_async(cache.add + delete)": recipe_on("default"),
        "Redis: floor (redis.asyncio SET NX PX + Lua delete)": redis_floor,
        "Redis: async Lock cycle": redis_lock,
        "Redis: sync_to_async(cache.add + delete)": recipe_on("redis"),
    }


async def close_variants() -> None:
    """Close what ``_variants`` opened, and the loop's connections."""
    from django_tasklock.aio import close_loop_connections

    while _opened:
        await _opened.pop()()
    await close_loop_connections()


async def measure_cycles(rounds: int, per_round: int) -> dict[str, list[int]]:
    """Nanoseconds per cycle of each variant, every cycle."""

    variants = await _variants()
    samples: dict[str, list[int]] = {name: [] for name in variants}
    try:
        for function in variants.values():  # warm: connections, scripts
            for _ in range(20):
                await function()
        for _ in range(rounds):
            order = list(variants.items())
            random.shuffle(order)
            for name, function in order:
                for _ in range(per_round):
                    started = time.perf_counter_ns()
                    await function()
                    samples[name].append(time.perf_counter_ns() - started)
    finally:
        await close_variants()
    return samples


def _storm_in_process(
    env: dict[str, str],
    tasklock: dict[str, object],
    coroutines: int,
    wanted: int,
    start_at: float,
    freeze: bool,
) -> dict[str, Any]:
    os.environ.update(env)
    from tests.async_storm import in_process

    return in_process(tasklock, 10, coroutines, wanted, 120.0, start_at, freeze=freeze)


def measure_storm(
    alias: str, coroutines: int, wanted: int, processes: int = 4, freeze: bool = False
) -> dict[str, Any]:
    """The storm on ``alias``: overlaps, holds, lags, holds per second."""
    from tests.workers import overlaps

    tasklock = {"CACHE": alias, "LOCK_EXPIRE": 30}
    env = {
        name: os.environ[name]
        for name in ("TASKLOCK_TEST_MEMCACHED", "TASKLOCK_TEST_REDIS")
    }
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        pool.map(time.sleep, [0.05] * processes * 2)  # all started
        start_at = time.monotonic() + 3.0
        arguments = (env, tasklock, coroutines, wanted, start_at, freeze)
        others = pool.starmap_async(_storm_in_process, [arguments] * processes)
        here = _storm_in_process(*arguments)
        results = [here, *others.get(timeout=600)]
    holds = [hold for result in results for hold in result["holds"]]
    by_id: dict[int, list[tuple[float, float]]] = {}
    for lock_id, entered, exited in holds:
        by_id.setdefault(lock_id, []).append((entered, exited))
    span = max(e for _, _, e in holds) - min(s for _, s, _ in holds)
    return {
        "overlaps": sum(overlaps(times) for times in by_id.values()),
        "holds": len(holds),
        "per_second": len(holds) / span if span > 0 else 0.0,
        "lags": [result["lag"] for result in results],
        "steps": [result["step"] for result in results],
        "what": max(results, key=lambda result: result["step"])["what"],
        "gcs": [result["gc"] for result in results],
        "waited": sum(result["waited"] for result in results),
    }


def render(
    samples: dict[str, list[int]],
    storms: dict[str, dict[str, Any]],
    frozen: bool = False,
) -> str:
    lines = ["Cycles (one loop; median and ratio to the store's async floor):"]
    floors = {
        name.split(":")[0]: statistics.median(values)
        for name, values in samples.items()
        if "floor" in name
    }
    misses = []
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / floors[name.split(":")[0]]
        lines.append(f"  {name:<52} {median / 1000:8.1f} us  {ratio:5.2f}x")
        if "async Lock cycle" in name and ratio > TARGET:
            misses.append(f"{name}: {ratio:.2f}x (target {TARGET}x)")
    wire = samples.get("memcached: the bare wire (ms + md, no lock)")
    lock = samples.get("memcached: async Lock cycle")
    if wire and lock:
        over = statistics.median(lock) / statistics.median(wire)
        lines.append(
            f"  (memcached: the async Lock cycle is {over:.2f}x the bare wire)"
        )
    lines.append(
        "Storm (1,000 coroutines over 10 ids, in 5 processes"
        + ("; each process's start-up heap frozen, gc.freeze()" if frozen else "")
        + "):"
    )
    for alias, storm in storms.items():
        lags = ", ".join(f"{lag * 1000:.0f}" for lag in storm["lags"])
        steps = ", ".join(f"{step * 1000:.1f}" for step in storm["steps"])
        gcs = ", ".join(f"{pause * 1000:.0f}" for pause in storm["gcs"])
        lines.append(
            f"  {alias:<10} {storm['holds']:6d} holds ({storm['per_second']:.0f}/s), "
            f"{storm['waited']} after waiting, overlaps {storm['overlaps']};\n"
            f"  {'':<10} longest callback per process, CPU ms (the loop blocked, "
            f"less GC): {steps} (the longest: {storm['what']});\n"
            f"  {'':<10} longest garbage collection per process, CPU ms: {gcs};\n"
            f"  {'':<10} largest probe lag per process, ms (1,000 ready coroutines "
            f"ahead of it): {lags}"
        )
        if max(storm["steps"]) > BLOCK_TARGET:
            misses.append(
                f"{alias}: a callback held the loop "
                f"{max(storm['steps']) * 1000:.1f} ms (target {BLOCK_TARGET * 1000:.0f} ms)"
            )
    if misses:
        lines.append("over target: " + "; ".join(misses))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in each storm process once Django is set up, as a "
        "server does after its start-up: the collector then walks only what "
        "the storm made",
    )
    options = parser.parse_args(argv)
    quick = options.quick
    memcached, redis_server = Memcached().start(), Redis().start()
    try:
        setup_django(memcached.address, redis_server.url)
        print("cycles...", flush=True)
        samples = asyncio.run(
            measure_cycles(rounds=3 if quick else 20, per_round=50 if quick else 200)
        )
        storms = {}
        for alias in ("default", "redis"):
            print(f"storm on {alias}...", flush=True)
            storms[alias] = measure_storm(
                alias,
                coroutines=1000,
                wanted=200 if quick else 2000,
                freeze=options.gc_freeze,
            )
        print(render(samples, storms, frozen=options.gc_freeze))
        return 1 if any(storm["overlaps"] for storm in storms.values()) else 0
    finally:
        from django_tasklock.locks.liveness import forget_records

        forget_records(delete=True)  # while the servers still run
        memcached.stop()
        redis_server.stop()


if __name__ == "__main__":
    sys.exit(main())
