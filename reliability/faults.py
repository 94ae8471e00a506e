"""Fault cases for django_tasklock, against real memcached, Redis and workers.

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

``tests/test_faults.py`` runs the quick sizes in the suite and asserts on every
row; the full sizes print the table docs/explanation/reliability.rst carries.
"""

from __future__ import annotations

import argparse
import os
import sys
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


def run(quick: bool) -> list[Row]:
    from reliability import (
        basics,
        calls,
        deployments,
        lifecycle,
        limits,
        pools,
        recovery,
        semaphores,
        unknown,
    )
    from tests.services import Redis

    main = Memcached().start()
    small = Memcached(args=["-m", "2"]).start()
    flaky = Memcached().start()
    redis_server = Redis().start()
    rows = []
    try:
        setup_django(main.address)
        rows += basics.run(main, small, flaky, redis_server, quick)
        rows += lifecycle.run(main, redis_server, quick)
        rows += unknown.run(main, redis_server, quick)
        rows += semaphores.run(main, quick)
        rows += pools.run(main, quick)
        rows += calls.run(redis_server, quick)
        rows += limits.run(quick)
        rows += recovery.run(quick)
        rows += deployments.run(quick)
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
    options = parser.parse_args(argv)
    rows = run(options.quick)
    table = render(
        rows, "python -m reliability.faults" + (" --quick" if options.quick else "")
    )
    print(table)
    if options.write_docs:
        write_section(TABLE_START, TABLE_END, table)
    return 1 if bad(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
