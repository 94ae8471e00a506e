"""How soon a released lock's next holder starts, and whether every waiter
gets its turn: processes waiting on one lock, each taking it again at once
after its release (as a worker does with the next queued call of one key).

    python -m benchmarks.handoff [--seconds S] [--write-docs]

Two loads, each run for ``--seconds`` on each way of waiting:

- 4 processes, 100 ms holds;
- 8 processes, 0.5 ms holds.

Each process loops ``acquire(blocking=True, timeout=10)``, the body, and
``release()``, and writes down each hold's start and end (the machine's
monotonic clock, one for all its processes) and each wait that timed out.
The ways of waiting: this package's line (``WAITING="line"``) and its
polling (``WAITING="poll"``), each on a private Redis, a private memcached
and a private PostgreSQL, and python-redis-lock beside, on the same Redis, in
the same run; and the control, no lock: the same loop with the bodies side by side,
the most holds a second the load allows. The report gives the handoff
(release to the next holder's start: median and p99), holds per process and
a second, waits timed out, holds that overlapped (always 0, or the lock is
broken) and requests sent to the store per hold (every write to a socket,
counted in each process; on PostgreSQL, whose libpq writes its socket
itself, every statement).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402

SECTION_START = ".. handoff-start"
SECTION_END = ".. handoff-end"
LOADS = ((4, 0.1), (8, 0.0005))
WAYS = (
    "no lock",
    "line-redis",
    "poll-redis",
    "python-redis-lock",
    "line-memcached",
    "poll-memcached",
    "line-postgres",
    "poll-postgres",
)
LOCK_ID = "handoff-bench"


def child(way: str, seconds: float, body: float) -> None:
    """One waiting process: says ``ready``, reads the start time on stdin,
    and writes its holds and timeouts as JSON on stdout."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.conf import settings

    alias = {"memcached": "default", "postgres": "postgres"}.get(
        way.rpartition("-")[2], "redis"
    )
    waiting = "line" if way.startswith("line-") else "poll"
    settings.TASKLOCK = {"CACHE": alias, "WAITING": waiting, "LIVENESS": None}
    take, let_go = _lock_of(way)
    holds: list[tuple[float, float]] = []
    timeouts = 0
    take(), let_go()  # connected, scripts loaded
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.monotonic() < start:
        time.sleep(0.001)
    end = start + seconds
    sent = _count_requests()
    while time.monotonic() < end:
        if not take():
            timeouts += 1
            continue
        began = time.monotonic()
        time.sleep(body)
        ended = time.monotonic()
        let_go()
        holds.append((began, ended))
    report = {"holds": holds, "timeouts": timeouts, "requests": sent[0]}
    print(json.dumps(report))


def _count_requests() -> list[int]:
    """From now on, every request this process sends to a store (every
    write to a socket: a pipelined batch is one) counted in the list."""
    import socket

    sent = [0]
    for name in ("send", "sendall"):
        plain = getattr(socket.socket, name)

        def counted(self: Any, *args: Any, _plain: Any = plain) -> Any:
            sent[0] += 1
            return _plain(self, *args)

        setattr(socket.socket, name, counted)
    # libpq writes to its socket itself: on PostgreSQL each statement is one.
    from django_tasklock.backends.postgres.wire import Wire

    query = Wire.query

    def counted_query(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent[0] += 1
        return query(self, *args, **kwargs)

    Wire.query = counted_query  # type: ignore[method-assign]
    return sent


def _lock_of(way: str) -> tuple[Any, Any]:
    """The take (blocking, 10 s) and release of ``way``'s lock."""
    if way == "no lock":  # the control: the bodies alone, side by side
        return (lambda: True), (lambda: None)
    if way == "python-redis-lock":
        import redis
        import redis_lock
        from django.conf import settings

        client = redis.Redis.from_url(settings.CACHES["redis"]["LOCATION"])
        theirs = redis_lock.Lock(client, LOCK_ID, expire=60)
        return (lambda: theirs.acquire(blocking=True, timeout=10)), theirs.release
    from django_tasklock import Lock

    ours = Lock(LOCK_ID, expire=60)
    return (lambda: ours.acquire(blocking=True, timeout=10)), ours.release


def measure(way: str, processes: int, body: float, seconds: float) -> dict[str, Any]:
    """One way of waiting under one load: the figures of the report."""
    args = [way, repr(seconds), repr(body)]
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.handoff", "--child", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(processes)
    ]
    for c in children:
        assert c.stdout is not None
        assert c.stdout.readline() == "ready\n", f"{way}: a child failed to start"
    start = time.monotonic() + 0.2
    for c in children:
        assert c.stdin is not None
        c.stdin.write(f"{start!r}\n")
        c.stdin.close()
    results = []
    for c in children:
        assert c.stdout is not None
        with c.stdout:
            results.append(json.loads(c.stdout.read()))
        c.wait()
    holds = sorted(
        (began, ended, n) for n, r in enumerate(results) for began, ended in r["holds"]
    )
    handoffs = [b[0] - a[1] for a, b in itertools.pairwise(holds)]
    overlaps = sum(1 for gap in handoffs if gap < 0) if way != "no lock" else None
    per = [len(r["holds"]) for r in results]
    handoffs.sort()
    return {
        "holds": per,
        "timeouts": sum(r["timeouts"] for r in results),
        "overlaps": overlaps,
        "median_ms": 1000 * statistics.median(handoffs) if handoffs else None,
        "p99_ms": 1000 * handoffs[int(0.99 * (len(handoffs) - 1))]
        if handoffs
        else None,
        "requests": sum(r["requests"] for r in results) / max(sum(per), 1),
        "per_second": sum(per) / seconds,
    }


def _table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    head = (
        "Load", "Waiting", "Handoff median", "p99", "Holds per process",
        "Holds a second", "Timed out", "Overlaps", "Requests per hold",
    )  # fmt: skip
    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "",
        *(f"   {'*' if i == 0 else ' '} - {h}" for i, h in enumerate(head)),
    ]
    for load, way, got in rows:
        control = got["overlaps"] is None  # (no lock: bodies overlap)
        cells = (
            load,
            way,
            "-" if control else f"{got['median_ms']:.1f} ms",
            "-" if control else f"{got['p99_ms']:.1f} ms",
            "/".join(str(n) for n in sorted(got["holds"])),
            f"{got['per_second']:.0f}",
            str(got["timeouts"]),
            "-" if control else str(got["overlaps"]),
            f"{got['requests']:.1f}",
        )
        lines += [f"   {'*' if i == 0 else ' '} - {c}" for i, c in enumerate(cells)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--child", nargs=3)
    options = parser.parse_args(argv)
    if options.child:
        way, seconds, body = options.child
        child(way, float(seconds), float(body))
        return
    from django_tasklock.backends.postgres.statements import CREATE
    from tests.services import Memcached, Redis
    from tests.services_pg import Postgres

    redis_server, memcached = Redis().start(), Memcached().start()
    postgres = Postgres().start()
    postgres.execute(CREATE)
    os.environ["TASKLOCK_TEST_REDIS"] = redis_server.url
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached.address
    os.environ["TASKLOCK_TEST_POSTGRES"] = str(postgres.port)
    rows = []
    try:
        for processes, body in LOADS:
            load = f"{processes} processes, {body * 1000:g} ms holds"
            for way in options.ways.split(","):
                got = measure(way, processes, body, options.seconds)
                print(load, way, json.dumps(got), flush=True)
                rows.append((load, way, got))
    finally:
        redis_server.stop()
        memcached.stop()
        postgres.remove()
    table = _table(rows)
    print(table)
    if options.write_docs:
        write_section(SECTION_START, SECTION_END, table)


if __name__ == "__main__":
    main()
