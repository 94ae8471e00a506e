"""The lock console at scale: 100,000 held locks, then page views timed and
their round trips counted.

    python -m benchmarks.console [--quick] [--write-docs]

Four processes (``tests.many_holder``) take 25,000 locks each on a private
memcached (512 MB) and list them in their roster slots. Once the console lists
all of them, the holders are paused (SIGSTOP: no liveness beat may add a
request to the count) and the admin's held-lock page is fetched through
Django's test client, logged in as a superuser: the first page, a middle page,
a search for one lock id and a filter by task. Every request the page sends
to memcached goes through a counting proxy (tests/faultproxy.py); the page's
time is the median of five views. A second run adds 1,000,000 unrelated keys
to the cache: the count must not change.

``--write-docs`` replaces the table between the console markers in
docs/explanation/performance.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402
from tests.faultproxy import FaultProxy  # noqa: E402
from tests.services import Memcached  # noqa: E402

TABLE_START = ".. console-table-start"
TABLE_END = ".. console-table-end"
CONSOLE = "/admin/django_tasklock/heldlock/"
#: memcached's counters of items it dropped itself (``stats``).
DROPS = (
    "evictions",
    "slab_reassign_evictions_nomem",
    "slab_reassign_busy_deletes",
)
#: Counters printed beside a loss the drops above do not explain (how items
#: left: deletes that found nothing, reclaimed expired items, slab moves).
CLUES = (
    "delete_hits",
    "delete_misses",
    "reclaimed",
    "expired_unfetched",
    "crawler_reclaimed",
    "slabs_moved",
    "slab_reassign_rescues",
    "slab_reassign_busy_items",
    "curr_connections",
    "total_connections",
)
#: The holders' logs, emptied at each run.
LOGS = Path(tempfile.gettempdir()) / f"tasklock-console-bench-{os.getpid()}"


def start_holders(address: str, total: int, processes: int) -> list[Any]:
    """``processes`` holders of ``total`` locks in all, on memcached at
    ``address``; returns once each holds its share."""
    env = {
        **os.environ,
        "TASKLOCK_TEST_MEMCACHED": address,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
    }
    share = total // processes
    holders = []
    for i in range(processes):
        command = [sys.executable, "-m", "tests.many_holder", "default"]
        with holder_log(i) as log:  # the child keeps its own copy
            holders.append(
                subprocess.Popen(
                    [*command, str(share), f"scale{i}"],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
            )
    for holder in holders:
        line = holder.stdout.readline().strip()
        if line != f"held {share}":
            raise RuntimeError(f"a holder did not take its locks: {line!r}")
    return holders


def holder_log(number: int) -> Any:
    """Where holder ``number`` writes its stderr (read back by ``lost_at_release``)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    return (LOGS / f"holder-{number}.log").open("w")


def lost_at_release() -> list[str]:
    """The warnings of locks the holders found lost when they released them
    (each names its lock and why): none, unless something took or moved them."""
    return [
        f"{log.name}: {line}"
        for log in sorted(LOGS.glob("holder-*.log"))
        for line in log.read_text().splitlines()
        if "was no longer held by this owner at release" in line
    ]


def stop_holders(holders: list[Any]) -> None:
    for holder in holders:
        holder.send_signal(signal.SIGCONT)
        if holder.poll() is None:
            holder.stdin.write("\n")
            holder.stdin.flush()
    for holder in holders:
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdin.close()
        holder.stdout.close()


def logged_in_client() -> Any:
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client

    call_command("migrate", verbosity=0)
    user = User.objects.create_superuser("bench", "bench@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def view(
    client: Any, proxy: FaultProxy, query: dict[str, str]
) -> tuple[float, int, str]:
    """(seconds, round trips, page) of one view of the console."""
    before = proxy.requests
    started = time.perf_counter()
    response = client.get(CONSOLE, query)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"the console answered {response.status_code}")
    return elapsed, proxy.requests - before, response.content.decode()


def measure(
    total: int, processes: int, views: int = 5, unrelated: int = 1_000_000
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from django.conf import settings
    from django.core.cache import caches

    from django_tasklock.console import take_inventory

    memcached = Memcached(args=["-m", "1024"]).start()
    proxy = FaultProxy(memcached.port)
    holders: list[Any] = []
    rows = []
    fill: dict[str, Any] = {}
    try:
        settings.CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                "LOCATION": proxy.address,
            }
        }
        settings.TASKLOCK = {"CACHE": "default"}
        client = logged_in_client()
        holders = start_holders(memcached.address, total, processes)
        deadline = time.monotonic() + 120
        while len(take_inventory().entries) < total:
            if time.monotonic() > deadline:
                raise RuntimeError("the console never listed every held lock")
            time.sleep(0.5)
        for holder in holders:
            holder.send_signal(signal.SIGSTOP)
        queries = {
            "first page": {},
            f"page {total // 100}": {"p": str(total // 100)},
            "search": {"q": f"scale2-lock-{total // processes - 1}"},
            "filter by task": {"task": "scale.import_feed", "p": "2"},
        }
        for others in (0, unrelated):
            if others:
                cache = caches["default"]
                for start in range(0, others, 10_000):
                    cache.set_many(
                        {f"unrelated-{n}": n for n in range(start, start + 10_000)}
                    )
                # What the store kept of it, and of the locks (read, not
                # assumed from what was written).
                fill = {
                    "written": others,
                    "stored": memcached.stat("curr_items"),
                    "evicted": memcached.stat("evictions"),
                    "listed": len(take_inventory().entries),
                    "held": sum(
                        one.status().held for one in take_inventory().listed()[:200]
                    ),
                }
            for name, query in queries.items():
                times, trips = [], set()
                for _ in range(views):
                    elapsed, count, page = view(client, proxy, query)
                    times.append(elapsed)
                    trips.add(count)
                shown = page.count('class="tasklock-row"')
                rows.append(
                    {
                        "view": name,
                        "unrelated": others,
                        "rows": shown,
                        "median": statistics.median(times),
                        "worst": max(times),
                        "trips": sorted(trips),
                    }
                )
    finally:
        stop_holders(holders)
        proxy.close()
        # Items memcached dropped itself by the end, the holders' releases
        # included: evicted; in a page its slab mover took with no room to
        # move them to; or busy (being sent to a client, as the holders' reads
        # of every held key each beat are) too long while their page moved,
        # which memcached deletes. A lock so dropped is lost, its holder told.
        with contextlib.suppress(OSError, KeyError, ValueError):
            stats = memcached.stats()
            fill["dropped"] = sum(int(stats[name]) for name in DROPS)
            fill["drops"] = ", ".join(f"{name} {stats[name]}" for name in DROPS)
            fill["clues"] = ", ".join(
                f"{name} {stats[name]}" for name in CLUES if name in stats
            )
        memcached.stop()
    return rows, fill


def render(
    rows: list[dict[str, Any]], fill: dict[str, Any], total: int, command: str
) -> str:
    lines = [
        f"{'view':<16}{'other keys':>11}{'rows':>6}{'median':>9}{'worst':>9}"
        f"{'round trips':>13}"
    ]
    for row in rows:
        trips = "/".join(str(n) for n in row["trips"])
        lines.append(
            f"{row['view']:<16}{row['unrelated']:>11,}{row['rows']:>6}"
            f"{row['median']:>8.2f}s{row['worst']:>8.2f}s{trips:>13}"
        )
    lines += [
        "",
        f"after writing {fill['written']:,} other keys: {fill['stored']:,} items "
        f"stored, {fill['evicted']:,} evicted; {fill['listed']:,} of {total:,} "
        f"locks listed; {fill['held']} of the first 200 listed still held",
    ]
    body = "\n".join("    " + line for line in lines)
    return (
        f"Measured by ``{command}`` ({total:,} held locks in four processes; a "
        "page view through Django's test client, its requests to memcached "
        "counted by a proxy):\n\n.. code-block:: text\n\n" + body + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--locks", type=int, default=100_000)
    parser.add_argument("--unrelated", type=int, default=1_000_000)
    parser.add_argument("--views", type=int, default=5)
    options = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()
    total = 4_000 if options.quick else options.locks
    unrelated = 10_000 if options.quick else options.unrelated
    views = 2 if options.quick else options.views
    rows, fill = measure(total, 4, views=views, unrelated=unrelated)
    command = "python -m benchmarks.console" + (" --quick" if options.quick else "")
    table = render(rows, fill, total, command)
    print(table)
    lost = lost_at_release()
    shutil.rmtree(LOGS, ignore_errors=True)
    print(f"Locks the holders found lost when they released them: {len(lost)}")
    print(
        f"Items memcached dropped itself (evictions, slab moves with no room, "
        f"busy items deleted in a slab move): {fill.get('dropped', 'unknown')} "
        f"({fill.get('drops', 'stats unread')})"
    )
    for line in lost[:5]:  # which lock, and what the holder was told
        print(f"  {line}")
    if lost:
        print(f"memcached's other counters: {fill.get('clues', 'stats unread')}")
    if options.write_docs:
        write_section(TABLE_START, TABLE_END, table)
        print("docs/explanation/performance.rst updated.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
