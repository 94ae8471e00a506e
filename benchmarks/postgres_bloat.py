"""What 100,000 lock cycles leave in the PostgreSQL store's table.

    python -m benchmarks.postgres_bloat [--cycles N] [--processes N] [--ids N]
                                        [--compare] [--write-docs]

A private PostgreSQL (autovacuum at its defaults), the lock table made; then
``--processes`` processes take and release ``Lock``\\ s on ``--ids`` lock ids
(each cycle on an id drawn at random) until ``--cycles`` cycles are done in
all. While they run, and once more after they end, the table's size, its
index's, and its live and dead row versions (``pg_stat_user_tables``) are
read every second. The report gives the largest and the last of each, how
many updates were HOT (on the same page, no index entry written: pruned by
the page itself) and how often autovacuum ran. The exit status is 1 if the
table ends larger than ``BOUND`` pages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402

SECTION_START = ".. postgres-bloat-start"
SECTION_END = ".. postgres-bloat-end"
#: Pages (8 KiB) past which the table counts as bloated: a hundred lock ids
#: and their liveness records fit in a few.
BOUND = 64

_STATS = """
SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid), s.n_live_tup,
    s.n_dead_tup, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_ins, s.n_tup_del,
    s.autovacuum_count
FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.relname = %s
"""


#: The release this store does not use, for ``--release-by-delete``: the row
#: deleted, so each cycle leaves a dead row version and an index entry.
_DELETE_RELEASE = b"""
DELETE FROM django_tasklock_item AS t
WHERE key = $1 AND value = $2 AND NOT pickled AND t.expires > clock_timestamp()
RETURNING 1"""


def worker(cycles: int, ids: int, seed: int) -> None:
    """Take and release ``cycles`` locks on ids drawn from ``ids``."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django_tasklock import Lock

    if os.environ.get("BLOAT_RELEASE_BY_DELETE"):
        from django_tasklock.backends.postgres import statements

        statements.RELEASE = _DELETE_RELEASE
    draw = random.Random(seed)
    taken = 0
    for _ in range(cycles):
        lock = Lock(f"bloat-{draw.randrange(ids)}", cache="postgres")
        if lock.acquire():
            taken += 1
            lock.release()
    print(json.dumps({"taken": taken}))


def _stats(server: Any) -> dict[str, int]:
    from django_tasklock.backends.postgres.statements import TABLE

    names = ("table", "index", "live", "dead", "updates", "hot", "inserts")
    names += ("deletes", "autovacuums")
    row = server.execute(_STATS, (TABLE,))[0]
    return dict(zip(names, map(int, row), strict=True))


def measure(
    cycles: int, processes: int, ids: int, *, by_delete: bool = False
) -> dict[str, Any]:
    from django_tasklock.backends.postgres.statements import CREATE
    from tests.services_pg import Postgres

    server = Postgres().start()
    try:
        server.execute(CREATE)
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "TASKLOCK_TEST_POSTGRES": str(server.port),
            "BLOAT_RELEASE_BY_DELETE": "1" if by_delete else "",
        }
        share = cycles // processes
        started = time.monotonic()
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.postgres_bloat", "worker", *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for args in ([str(share), str(ids), str(seed)] for seed in range(processes))
        ]
        samples = []
        while any(w.poll() is None for w in workers):
            samples.append(_stats(server))
            time.sleep(1)
        seconds = time.monotonic() - started
        taken = 0
        for w in workers:
            out, _ = w.communicate()
            if w.returncode:
                raise SystemExit(f"a worker failed ({w.returncode})")
            taken += json.loads(out.strip().splitlines()[-1])["taken"]
        time.sleep(2)  # (the statistics collector's last flush)
        samples.append(_stats(server))
        return {
            "cycles": share * processes,
            "taken": taken,
            "seconds": seconds,
            "processes": processes,
            "ids": ids,
            "peak": {k: max(s[k] for s in samples) for k in samples[-1]},
            "last": samples[-1],
        }
    finally:
        server.remove()


def render(result: dict[str, Any], command: str, *, title: str = "") -> str:
    peak, last = result["peak"], result["last"]
    hot = last["hot"] / last["updates"] if last["updates"] else 0.0
    lines = [
        f"``{command}``{title}: {result['cycles']:,} lock cycles "
        f"({result['taken']:,} taken; the rest found their id held by another "
        f"process) in {result['seconds']:.0f} s, {result['processes']} processes "
        f"on {result['ids']} lock ids, autovacuum at its defaults:",
        "",
        ".. code-block:: text",
        "",
        f"    {'':<28} {'largest':>10} {'at the end':>12}",
        f"    {'table size (8 KiB pages)':<28} {peak['table'] // 8192:>10,} "
        f"{last['table'] // 8192:>12,}",
        f"    {'index size (8 KiB pages)':<28} {peak['index'] // 8192:>10,} "
        f"{last['index'] // 8192:>12,}",
        f"    {'live row versions':<28} {peak['live']:>10,} {last['live']:>12,}",
        f"    {'dead row versions':<28} {peak['dead']:>10,} {last['dead']:>12,}",
        "",
        f"    {last['updates']:,} updates, {hot:.1%} of them HOT; "
        f"{last['inserts']:,} inserts, {last['deletes']:,} deletes; "
        f"autovacuum ran {last['autovacuums']} times",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["worker"]:
        worker(*map(int, arguments[1:4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--ids", type=int, default=100)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="the same run again with releases that delete the row, beside it",
    )
    parser.add_argument("--write-docs", action="store_true")
    options = parser.parse_args(arguments)
    result = measure(options.cycles, options.processes, options.ids)
    text = render(result, "python -m benchmarks.postgres_bloat")
    if options.compare:
        deleting = measure(
            options.cycles, options.processes, options.ids, by_delete=True
        )
        text += "\n" + render(
            deleting,
            "python -m benchmarks.postgres_bloat",
            title=" with each release a DELETE (as this store does not)",
        )
    print(text)
    if options.write_docs:
        write_section(SECTION_START, SECTION_END, text)
    pages = result["last"]["table"] // 8192
    if pages > BOUND:
        print(f"BLOATED: the table ends at {pages} pages, over {BOUND}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
