"""Rate limits measured over real Celery workers.

    python -m benchmarks.rates [--quick] [--write-docs]

Two ``celery worker`` processes (prefork, four pool processes each) on a private
Redis broker, one private memcached and Redis for the limits:

1. Exactness: all eight pool processes hammer one limit id (each refusal
   followed by a sleep of the time it names) until it has admitted 10,000
   calls; every admission's time is recorded and checked against the kind's
   guarantee (window: at most N in any period; smooth: GCRA's formula),
   on memcached and on Redis, and the share of the allowed rate admitted.
2. No lost calls: three periods' worth of calls sent at once to a
   ``@rate_limited`` task whose ``max_retries`` is 0; how many ran, how often.
3. Beside Celery: ``rate_limit="10/s"`` (per worker) and ``@rate_limited("10/s")``
   on the same two workers, the busiest second of each.
4. Long periods: a ``100/30d`` limit of each kind, in this process. On
   memcached, whose limits run on the client's clock, that clock is moved
   forward 90 days (1.8 hours a step, two admissions asked each step); Redis
   judges on its own clock, which cannot be moved: its first period only.

``--write-docs`` replaces the table between the rate-limit markers in
docs/explanation/performance.rst.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402
from tests.limits_helpers import (  # noqa: E402
    admitted_share,
    smooth_violations,
    window_violations,
)
from tests.services import Memcached, Redis, stop_process  # noqa: E402

TABLE_START = ".. rates-table-start"
TABLE_END = ".. rates-table-end"
STORES = {"memcached": "default", "Redis": "redis"}


def _wait_for(what: str, done: Any, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not done within {limit:.0f}s")
        time.sleep(0.1)


def exactness(counter: Any, kind: str, store: str, rate: str, wanted: int) -> str:
    """One row: eight pool processes hammer one limit until ``wanted``."""
    from benchmarks import celery_bench
    from django_tasklock import RateLimiter
    from django_tasklock.rates import parse_rate

    parsed = parse_rate(rate)
    burst = max(parsed.count // 10, 1)
    limit_id = f"bench-rate-{kind}-{store}-{time.time_ns()}"
    spec = [limit_id, rate, kind, burst, STORES[store]]
    RateLimiter(limit_id, rate, kind=kind, burst=burst, cache=STORES[store]).reset()
    start_at = time.time() + 1.0
    for _ in range(8):
        celery_bench.hammer_limit.delay(spec, start_at, wanted, 600.0)
    key = f"{celery_bench.ADMITTED}:{limit_id}"
    _wait_for(
        f"{kind} on {store}",
        lambda: int(counter.get(f"{key}:count") or 0) >= wanted,
        900,
    )
    time.sleep(1.0)  # the last admissions of the other processes land
    times = sorted(int(at) for at in counter.lrange(key, 0, -1))
    period = round(parsed.period * 1000)
    if kind == "window":
        bad = window_violations(times, parsed.count, period)
        guarantee = f"at most {parsed.count} in any {parsed.period:g}s"
    else:
        bad = smooth_violations(times, parsed.count, period, burst)
        guarantee = f"GCRA, burst {burst}"
    share = admitted_share(
        times, parsed.count, period, burst if kind == "smooth" else None
    )
    span = (times[-1] - times[0]) / 1000
    return (
        f"    {kind + ', ' + store:<20}{rate:>8}{len(times):>10,}{span:>9.1f}s{bad:>12}"
        f"{share * 100:>12.1f}%  {guarantee}"
    )


LONG_RATE, LONG_COUNT, LONG_PERIOD = "100/30d", 100, 30 * 86400 * 1000


def long_period(kind: str, store: str) -> str:
    """One row: a 30-day limit, on a clock moved forward where the client's
    clock is the one deciding (see the module's docstring)."""
    from unittest import mock

    from django_tasklock import RateLimiter
    from django_tasklock.limits import store as limit_store

    burst = 10
    limiter = RateLimiter(
        f"bench-long-{kind}-{store}-{time.time_ns()}",
        LONG_RATE,
        kind=kind,
        burst=burst,
        cache=STORES[store],
    )
    limiter.reset()
    times: list[int] = []

    def ask(tries: int) -> None:
        for _ in range(tries):
            admission = limiter.admit()
            if admission:
                times.append(round(admission.at * 1000))

    if store == "Redis":
        ask(3 * LONG_COUNT)
        clock = "Redis's, one period"
    else:
        now = [limit_store.now_ms()]
        with mock.patch.object(limit_store, "now_ms", side_effect=lambda: now[0]):
            for _ in range(1200):
                ask(2)
                now[0] += LONG_PERIOD // 400
        clock = "moved 90 days"
    limiter.reset()
    if kind == "window":
        bad = window_violations(times, LONG_COUNT, LONG_PERIOD)
    else:
        bad = smooth_violations(times, LONG_COUNT, LONG_PERIOD, burst)
    share = admitted_share(
        times, LONG_COUNT, LONG_PERIOD, burst if kind == "smooth" else None
    )
    return (
        f"    {kind + ', ' + store:<20}{LONG_RATE:>8}{len(times):>10,}{bad:>12}"
        f"{share * 100:>12.1f}%  {clock}"
    )


def _runs(counter: Any, kind: str) -> list[tuple[int, float]]:
    from benchmarks import celery_bench

    key = f"{celery_bench.RATE_RUNS}:{kind}"
    return [tuple(json.loads(item)) for item in counter.lrange(key, 0, -1)]  # type: ignore[misc]


def busiest_second(times: list[float]) -> int:
    """The most runs that started within any one second."""
    times = sorted(times)
    best = start = 0
    for end, at in enumerate(times):
        while at - times[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best


def sent_calls(
    counter: Any, task: Any, kind: str, calls: int
) -> tuple[list[tuple[int, float]], int]:
    """The runs of ``calls`` calls sent at once, and how many deliveries
    they took."""
    from benchmarks import celery_bench

    counter.delete(f"{celery_bench.DELIVERIES}:{kind}")
    for n in range(calls):
        task.delay(n)
    _wait_for(
        f"{calls} calls of {kind}", lambda: len(_runs(counter, kind)) >= calls, 120
    )
    time.sleep(1.0)  # a call that ran twice would show by now
    delivered = int(counter.get(f"{celery_bench.DELIVERIES}:{kind}") or 0)
    return _runs(counter, kind), delivered


def measure(quick: bool) -> str:
    import redis

    from benchmarks import celery_bench

    counter = redis.Redis.from_url(os.environ["TASKLOCK_TEST_REDIS"][:-2] + "/2")
    for key in counter.scan_iter(f"{celery_bench.RATE_RUNS}:*"):
        counter.delete(key)
    rate, wanted = ("200/s", 1_000) if quick else ("500/s", 10_000)
    lines = [
        f"    {'kind, store':<20}{'rate':>8}{'admitted':>10}{'over':>10}{'violations':>12}"
        f"{'of allowed':>13}  guarantee"
    ]
    for store in STORES:
        for kind in ("window", "smooth"):
            print(f"exactness: {kind} on {store}...", flush=True)
            lines.append(exactness(counter, kind, store, rate, wanted))
    lines += [
        "",
        f"    {'60 calls at once, 20/s, max_retries=0':<40}{'ran':>7}{'twice':>7}"
        f"{'deliveries per call':>21}",
    ]
    for kind, task in (
        ("window", celery_bench.calls_window),
        ("smooth", celery_bench.calls_smooth),
    ):
        print(f"calls: {kind}...", flush=True)
        runs, delivered = sent_calls(counter, task, kind, 60)
        ran = {n for n, _ in runs}
        lines.append(
            f"    {'@rate_limited, ' + kind:<40}{len(ran):>4}/60{len(runs) - len(ran):>7}"
            f"{delivered / 60:>21.2f}"
        )
    lines += ["", f"    {'60 calls, 10/s, two workers':<40}{'busiest second':>16}"]
    for kind, label, task in (
        ("celery", 'Celery rate_limit="10/s"', celery_bench.celery_rate_limited),
        ("limiter", '@rate_limited("10/s")', celery_bench.limiter_beside_celery),
    ):
        print(f"beside Celery: {label}...", flush=True)
        runs, _ = sent_calls(counter, task, kind, 60)
        lines.append(f"    {label:<40}{busiest_second([at for _, at in runs]):>16}")
    lines += [
        "",
        f"    {'long periods':<20}{'rate':>8}{'admitted':>10}{'violations':>12}"
        f"{'of allowed':>13}  clock",
    ]
    for store in STORES:
        for kind in ("window", "smooth"):
            print(f"long period: {kind} on {store}...", flush=True)
            lines.append(long_period(kind, store))
    return "\n".join(lines) + "\n"


def render(body: str, command: str) -> str:
    return (
        f"``{command}`` (two prefork workers of four processes, private memcached "
        "and Redis; violations of the kind's guarantee counted over every "
        'admission\'s time; "admitted": admissions recorded, the run stopping '
        'at its target; "of allowed": the share of the rate admitted (see '
        "above); deliveries per call: every delivery "
        "of the calls, refused ones included; the busiest second counted on "
        "body starts for both):\n\n.. code-block:: text\n\n" + body
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--write-docs", action="store_true")
    options = parser.parse_args(argv)
    from benchmarks.bench import setup_django, start_workers

    memcached, redis_server = Memcached().start(), Redis().start()
    workers: list[Any] = []
    try:
        env = {
            **os.environ,
            "TASKLOCK_BENCH_BROKER": f"{redis_server.url[:-2]}/1",
            "TASKLOCK_TEST_REDIS": redis_server.url,
            "TASKLOCK_TEST_MEMCACHED": memcached.address,
        }
        os.environ.update(env)
        setup_django(memcached.address, redis_server.url)
        workers = start_workers(env, count=2, concurrency=4)
        command = "python -m benchmarks.rates" + (" --quick" if options.quick else "")
        table = render(measure(options.quick), command)
        print()
        print(table)
        if options.write_docs:
            write_section(TABLE_START, TABLE_END, table)
            print("docs/explanation/performance.rst updated.")
    finally:
        for worker in workers:
            stop_process(worker)
        memcached.stop()
        redis_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
