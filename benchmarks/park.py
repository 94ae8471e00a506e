"""Park and promote under load: 200 calls of one key, at most 2 running and
50 parked, over real prefork workers, a pool process SIGKILLed mid-run.

    python -m benchmarks.park [--calls N] [--write-docs]

Two ``celery worker`` processes of four pool processes each (the tests'
app, a private Redis as broker and result backend, locks on a private
memcached) get ``tests.tasks.parked_bench`` (``limit=2, park=50``, refuse
when full; a 50 ms body) ``--calls`` times at once. Once 20 runs started,
the pool process of a running call is SIGKILLed. Every call's outcome is
read from its ``AsyncResult``; every run wrote down its start and end, and
every step of the line its ``call_parked`` signal (tickets give the order of
parking). The report: calls that ran, were refused (each told ``ParkFull``),
died with the killed process (Celery's ``WorkerLostError``), lost (no
outcome at all: must be 0), run twice (must be 0), the most running at
once (at most 2), and the parked calls that started out of their parking
order (pairs of a later ticket starting before an earlier one, and the
most places one started away from its turn: with two slots, two calls
promoted together may start either way round).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402

SECTION_START = ".. park-bench-start"
SECTION_END = ".. park-bench-end"
KEY = "park-bench"


def _outcomes(results: list[Any], timeout: float) -> dict[str, list[str]]:
    """The calls by outcome: ran, refused, killed, lost."""
    from celery.exceptions import TimeoutError as CeleryTimeout
    from celery.exceptions import WorkerLostError

    from django_tasklock import ParkFull

    sorted_out: dict[str, list[str]] = {
        "ran": [],
        "refused": [],
        "killed": [],
        "lost": [],
    }
    deadline = time.monotonic() + timeout
    for result in results:
        try:
            result.get(timeout=max(deadline - time.monotonic(), 0.1))
            sorted_out["ran"].append(result.id)
        except ParkFull:
            sorted_out["refused"].append(result.id)
        except WorkerLostError:
            sorted_out["killed"].append(result.id)
        except CeleryTimeout:
            sorted_out["lost"].append(result.id)
    return sorted_out


def _inversions(started: list[str], tickets: dict[str, int]) -> tuple[int, int]:
    """Pairs of parked calls that started in the other order than they
    parked, and the most places one call started away from its turn."""
    order = [tickets[c] for c in started if c in tickets]
    pairs = sum(1 for i, a in enumerate(order) for b in order[i + 1 :] if b < a)
    ranks = {ticket: rank for rank, ticket in enumerate(sorted(order))}
    farthest = max((abs(ranks[t] - i) for i, t in enumerate(order)), default=0)
    return pairs, farthest


def measure(calls: int) -> dict[str, Any]:
    from django_tasklock import lock_id_for
    from django_tasklock.tokens import process_alive
    from tests import tasks
    from tests.celery_app import app
    from tests.helpers import use_redis_broker, wait_until
    from tests.services import Memcached, Redis
    from tests.workers import most_at_once, start_workers, stop_workers

    redis_server, memcached = Redis().start(), Memcached().start()
    os.environ["TASKLOCK_TEST_REDIS"] = redis_server.url
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached.address
    from django.conf import settings

    settings.CACHES["default"]["LOCATION"] = memcached.address
    env = use_redis_broker(app, redis_server.url)
    workers = start_workers(env, ["bench-park-1", "bench-park-2"], concurrency=4)
    try:
        began = time.monotonic()
        results = [tasks.parked_bench.delay(KEY, n) for n in range(calls)]
        sent = time.monotonic() - began
        starts = lambda: [r for r in tasks.runs(KEY) if r.get("phase") == "start"]  # noqa: E731
        wait_until(lambda: len(starts()) >= 20, 60)
        ended = {r["task_id"] for r in tasks.runs(KEY) if r.get("phase") != "start"}
        victim = next(r for r in reversed(starts()) if r["task_id"] not in ended)
        os.kill(int(victim["pid"]), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: not process_alive(int(victim["pid"])), 10)
        outcomes = _outcomes(results, 300)
        took = time.monotonic() - began
    finally:
        stop_workers(workers)
    runs = tasks.runs(KEY)
    started = [r for r in runs if r.get("phase") == "start"]
    finished = {r["task_id"]: r for r in runs if r.get("phase") != "start"}
    holds = [
        (
            r["start"],
            finished[r["task_id"]]["end"] if r["task_id"] in finished else killed_at,
        )
        for r in started
    ]
    starts_by_id: dict[str, int] = {}
    for r in started:
        starts_by_id[str(r["task_id"])] = starts_by_id.get(str(r["task_id"]), 0) + 1
    lock_id = lock_id_for(tasks.parked_bench, key=KEY, n=0)
    steps = tasks.park_steps(lock_id)
    tickets = {s[1]: int(s[3]) for s in steps if s[0] == "parked"}
    in_order = [str(r["task_id"]) for r in sorted(started, key=lambda r: r["start"])]
    pairs, farthest = _inversions(in_order, tickets)
    redis_server.stop()
    memcached.stop()
    return {
        "calls": calls,
        "sent in": round(sent, 2),
        "ran": len(outcomes["ran"]),
        "parked": len(tickets),
        "refused (told ParkFull)": len(outcomes["refused"]),
        "refused said": sum(1 for s in steps if s[0] == "refused"),
        "killed (WorkerLostError)": len(outcomes["killed"]),
        "lost": len(outcomes["lost"]),
        "run twice": sum(1 for n in starts_by_id.values() if n > 1),
        "most at once": most_at_once(holds),
        "parked pairs started out of order": pairs,
        "farthest start from its turn": farthest,
        "seconds": round(took, 1),
    }


def table(got: dict[str, Any]) -> str:
    width = max(len(k) for k in got)
    rule = f"{'=' * width} {'=' * 8}"
    rows = [rule, f"{'Measure':<{width}} Value", rule]
    rows += [f"{name:<{width}} {value}" for name, value in got.items()]
    return "\n".join([*rows, rule, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--write-docs", action="store_true")
    options = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    got = measure(options.calls)
    text = table(got)
    print(text)
    problems = [
        name
        for name, bad in (
            ("lost", got["lost"]),
            ("run twice", got["run twice"]),
            ("most at once", got["most at once"] > 2),
            ("refused not told", got["refused (told ParkFull)"] != got["refused said"]),
        )
        if bad
    ]
    if problems:
        raise SystemExit(f"park and promote broke: {', '.join(problems)}")
    if options.write_docs:
        write_section(SECTION_START, SECTION_END, text)


if __name__ == "__main__":
    main()
