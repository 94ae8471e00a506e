"""Fault cases for django_tasklock, against real memcached, Redis, PostgreSQL
and workers.

    python -m reliability.faults [--quick] [--write-docs]

Every case returns one row. Its cells are all measured, none is filled in:

- ``attempts``: how many times the case was carried out (each counted as it ran);
- ``overlaps``: holds that began while another holder still believed it held
  the lock, from their start and end times (``-`` where the case has no
  second holder to overlap with). Most cases must show 0. The cases
  marked ``by design`` build one on purpose (a holder that outlives its lock, is
  paused, or whose key the store loses): no lock can prevent that overlap, and
  their ``wrong`` column counts what must still hold (the holder told, its fence
  older, the newer holder's lock untouched);
- ``wrong``: outcomes the case exists to catch, each counted where it happened
  (a newer holder's lock removed, a task skipped silently, a lock left with no
  owner, a holder never told, a stale fence, an unclear error...);
- ``figures``: times and counts measured on the way.

``tests/test_faults*.py`` run the quick sizes in the suite, in three groups of
parts that run side by side (``--part``), and assert on every row; the full
sizes print the table docs/explanation/reliability.rst carries.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402
from tests.services import Memcached  # noqa: E402

TABLE_START = ".. fault-table-start"
TABLE_END = ".. fault-table-end"


@dataclass
class Row:
    """One case's measurements; ``by_design``: the case builds an overlap.
    ``overlaps`` is None where no second holder can exist to overlap with (a
    call that never ran, a lock never taken): the table shows ``-``."""

    case: str
    attempts: int
    overlaps: int | None
    wrong: int
    by_design: bool = False
    figures: list[str] = field(default_factory=list)


def setup_django(memcached: str) -> None:
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


def use_cache(location: str, backend: str = "memcached", **options: Any) -> Any:
    """A context in which the 'default' cache (the locks) is at ``location``."""
    from django.conf import settings
    from django.test import override_settings

    classes = {
        "memcached": "django.core.cache.backends.memcached.PyMemcacheCache",
        "redis": "django.core.cache.backends.redis.RedisCache",
    }
    default = {"BACKEND": classes[backend], "LOCATION": location}
    if options:
        default["OPTIONS"] = options
    return override_settings(
        CACHES={**settings.CACHES, "default": default},
        TASKLOCK={"CACHE": "default", "LOCK_EXPIRE": 60},
    )


def render(rows: list[Row], command: str) -> str:
    lines = [
        f"``{command}``:",
        "",
        ".. code-block:: text",
        "",
        f"    {'case':<46} {'attempts':>8} {'overlaps':>10} {'wrong':>5}  figures",
    ]
    for row in rows:
        overlaps = ("-" if row.overlaps is None else f"{row.overlaps}") + (
            " (b)" if row.by_design else ""
        )
        figures = "; ".join(row.figures) or "-"
        lines.append(
            f"    {row.case:<46} {row.attempts:>8} {overlaps:>10} {row.wrong:>5}  "
            f"{figures}"
        )
    lines += [
        "",
        "(b): by design, the case makes a holder outlive its lock; see above.",
    ]
    return "\n".join(lines) + "\n"


#: The suite's parts, in the order they run (each a module of ``reliability``),
#: with the numbers of the rows each gives (rows 28 and 29 need the calls'
#: Celery workers, so the calls part runs them).
PARTS: dict[str, tuple[int, ...]] = {
    "basics": tuple(range(1, 8)),
    "lifecycle": tuple(range(8, 12)),
    "unknown": tuple(range(12, 15)),
    "semaphores": (15, 16),
    "pools": (17,),
    "calls": (*range(18, 27), 28, 29),
    "limits": (27,),
    "recovery": tuple(range(30, 34)),
    "deployments": tuple(range(34, 44)),
    "cluster": tuple(range(44, 49)),
    "postgres": tuple(range(49, 54)),
    "fenced": (54,),
    "waiting": (55, 56),
    "parking": (57,),
}


def run(quick: bool, parts: tuple[str, ...] = tuple(PARTS)) -> list[Row]:
    import importlib

    from tests.services import Redis

    main = Memcached().start()
    small = Memcached(args=["-m", "2"]).start()
    flaky = Memcached().start()
    redis_server = Redis().start()
    arguments: dict[str, tuple[object, ...]] = {
        "basics": (main, small, flaky, redis_server),
        "lifecycle": (main, redis_server),
        "unknown": (main, redis_server),
        "semaphores": (main,),
        "pools": (main,),
        "calls": (redis_server,),
        "cluster": (redis_server,),
        "parking": (redis_server,),
    }
    rows = []
    try:
        setup_django(main.address)
        for part in [part for part in PARTS if part in parts]:  # in their order
            module = importlib.import_module(f"reliability.{part}")
            started = time.monotonic()
            rows += module.run(*arguments.get(part, ()), quick)
            took = time.monotonic() - started
            print(f"part {part}: {took:.1f} s", file=sys.stderr, flush=True)
    finally:
        from django.core.cache import close_caches

        from django_tasklock.backends import close_thread_connections

        close_caches()
        close_thread_connections()
        for server in (small, flaky, redis_server, main):
            server.stop()
    return sorted(rows, key=lambda row: int(row.case.split(".", 1)[0]))


def bad(rows: list[Row]) -> list[Row]:
    """Rows whose measurements break a promise."""
    return [
        row
        for row in rows
        if row.wrong
        or row.attempts == 0
        or (row.overlaps != row.attempts if row.by_design else bool(row.overlaps))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--part",
        action="append",
        choices=list(PARTS),
        help="run only this part (repeatable; the suite splits the quick run)",
    )
    options = parser.parse_args(argv)
    if options.write_docs and options.part:
        parser.error("--write-docs writes the whole table: leave out --part")
    rows = run(options.quick, tuple(options.part or PARTS))
    table = render(
        rows, "python -m reliability.faults" + (" --quick" if options.quick else "")
    )
    print(table)
    if options.write_docs:
        write_section(TABLE_START, TABLE_END, table)
    return 1 if bad(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
