"""What the fence costs a write: the same update with and without the
condition, on PostgreSQL and SQLite, in one run.

    python -m benchmarks.fenced_writes [--updates N] [--rounds N] [--write-docs]

A private PostgreSQL (on a free loopback port) and a SQLite file each get the
fenced-write tests' table (``tests.fenced.models.Register``) with 100 rows.
Each round times ``--updates`` single-row updates of each kind, the kinds in
turn so that the machine's drift falls on all of them:

- ``UPDATE`` by hand (``cursor.execute``), without and with the fence
  condition in its ``WHERE``: the statement's own cost of the condition;
- ``QuerySet.update()`` beside ``fenced_update(raise_stale=False)`` (the same
  one statement, built by the ORM) and ``fenced_update()`` (a second query
  when nothing was refused: the look for a newer row, to name it).

The report gives each kind's median microseconds per update over the rounds,
and its ratio to the plain one of its pair. Every round also sends one write
with an older fence per database, which must be refused: the report counts
them, so a condition that stopped refusing shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import write_section  # noqa: E402

SECTION_START = ".. fenced-writes-start"
SECTION_END = ".. fenced-writes-end"
DATABASES = ("bench_pg", "bench_sqlite")
ROWS = 100
KINDS = ("sql", "sql fenced", "orm", "orm fenced", "orm fenced, checked")


def _setup(port: int, sqlite: str) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    databases = {
        "bench_pg": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "tasklock",
            "USER": "tasklock",
            "HOST": "127.0.0.1",
            "PORT": str(port),
        },
        "bench_sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": sqlite},
    }
    os.environ["TASKLOCK_TEST_EXTRA_DATABASES"] = json.dumps(databases)
    import django

    django.setup()
    from django.db import connections

    from tests.fenced.models import Register

    for alias in DATABASES:
        with connections[alias].schema_editor() as editor:
            editor.create_model(Register)
        Register.objects.using(alias).bulk_create(
            Register(name=f"r{n}", fence=0) for n in range(ROWS)
        )


def _round(alias: str, updates: int, fence: int) -> tuple[dict[str, float], int]:
    """Microseconds per update of each kind; the fences go up from ``fence``.
    Also whether the stale write sent after them was refused (1 or 0)."""
    from django.db import connections

    from django_tasklock import StaleFence
    from tests.fenced.models import Register

    rows = Register.objects.using(alias)
    connection = connections[alias]
    quote = connection.ops.quote_name
    table = quote(Register._meta.db_table)
    plain = f"UPDATE {table} SET value = %s, fence = %s WHERE name = %s"
    fenced = plain + " AND (fence IS NULL OR fence <= %s)"
    timings: dict[str, float] = {}
    for kind in KINDS:
        started = time.perf_counter()
        with connection.cursor() as cursor:
            for n in range(updates):
                fence += 1
                name = f"r{n % ROWS}"
                if kind == "sql":
                    cursor.execute(plain, (n, fence, name))
                elif kind == "sql fenced":
                    cursor.execute(fenced, (n, fence, name, fence))
                elif kind == "orm":
                    rows.filter(name=name).update(value=n, fence=fence)
                elif kind == "orm fenced":
                    rows.filter(name=name).fenced_update(
                        value=n, fence=fence, raise_stale=False
                    )
                else:
                    rows.filter(name=name).fenced_update(value=n, fence=fence)
        timings[kind] = (time.perf_counter() - started) / updates * 1e6
    try:
        rows.filter(name="r0").fenced_update(value=-1, fence=fence - updates)
    except StaleFence:
        return timings, 1
    return timings, 0


def measure(updates: int, rounds: int) -> dict[str, Any]:
    from tests.services_pg import Postgres

    server = Postgres().start()
    try:
        with tempfile.TemporaryDirectory() as directory:
            _setup(server.port, str(Path(directory) / "bench.sqlite3"))
            samples: dict[str, dict[str, list[float]]] = {
                alias: {kind: [] for kind in KINDS} for alias in DATABASES
            }
            refused = dict.fromkeys(DATABASES, 0)
            fence = 0
            for _ in range(rounds):
                for alias in DATABASES:
                    timings, stale = _round(alias, updates, fence)
                    fence += updates * len(KINDS)
                    refused[alias] += stale
                    for kind, micros in timings.items():
                        samples[alias][kind].append(micros)
            from django.db import connections

            connections.close_all()
    finally:
        server.remove()
    medians = {
        alias: {kind: statistics.median(values) for kind, values in kinds.items()}
        for alias, kinds in samples.items()
    }
    return {
        "updates": updates,
        "rounds": rounds,
        "medians": medians,
        "refused": refused,
    }


def render(result: dict[str, Any]) -> str:
    names = {"bench_pg": "PostgreSQL", "bench_sqlite": "SQLite"}
    lines = [
        f"``python -m benchmarks.fenced_writes``: {result['updates']:,} single-row "
        f"updates of each kind per round, {result['rounds']} rounds, the kinds in "
        "turn; median microseconds per update, and the ratio to the plain one "
        "of its pair:",
        "",
        ".. code-block:: text",
        "",
        f"    {'':<34} {'PostgreSQL':>16} {'SQLite':>16}",
    ]
    base = {"sql": "sql", "sql fenced": "sql", "orm": "orm"}
    labels = {
        "sql": "UPDATE by hand",
        "sql fenced": "  with the fence condition",
        "orm": "QuerySet.update()",
        "orm fenced": "  fenced_update(raise_stale=False)",
        "orm fenced, checked": "  fenced_update()",
    }
    for kind in KINDS:
        cells = []
        for alias in DATABASES:
            medians = result["medians"][alias]
            ratio = medians[kind] / medians[base.get(kind, "orm")]
            cells.append(f"{medians[kind]:>7.1f} ({ratio:.2f}x)")
        lines.append(f"    {labels[kind]:<34} {cells[0]:>16} {cells[1]:>16}")
    refused = ", ".join(
        f"{names[alias]} {n} of {result['rounds']}"
        for alias, n in result["refused"].items()
    )
    lines += ["", f"    stale writes refused: {refused}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write-docs", action="store_true")
    options = parser.parse_args(argv)
    result = measure(options.updates, options.rounds)
    text = render(result)
    print(text)
    if options.write_docs:
        write_section(SECTION_START, SECTION_END, text)
    missed = [a for a, n in result["refused"].items() if n != options.rounds]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
