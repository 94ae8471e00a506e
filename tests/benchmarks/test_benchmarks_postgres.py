"""A short run of the PostgreSQL table benchmark: the table stays a few pages
whatever the cycles (the releases keep their rows, the takes update them in
place), and a releasing DELETE would not."""

from __future__ import annotations

import os

import pytest

from benchmarks import postgres_bloat

pytestmark = pytest.mark.long(seconds=20)


@pytest.mark.slow
def test_lock_cycles_leave_the_table_a_few_pages():
    kept = postgres_bloat.measure(6000, 2, 20)
    assert kept["taken"] > 3000
    last = kept["last"]
    assert last["table"] // 8192 <= postgres_bloat.BOUND
    assert last["hot"] >= 0.9 * last["updates"] > 0
    # The design it avoids, measured the same way, grows with the cycles.
    deleting = postgres_bloat.measure(6000, 2, 20, by_delete=True)
    assert deleting["last"]["table"] > 4 * last["table"]


@pytest.mark.slow
def test_the_fenced_write_benchmark_measures_every_kind_and_refuses_stale_writes():
    """Its own process (the databases it makes are set before Django starts)."""
    import subprocess
    import sys

    from benchmarks import fenced_writes

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.fenced_writes",
            "--updates",
            "100",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=fenced_writes.ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "stale writes refused: PostgreSQL 2 of 2, SQLite 2 of 2" in run.stdout
    rows = [line for line in run.stdout.splitlines() if line.endswith("x)")]
    assert len(rows) == len(fenced_writes.KINDS), run.stdout
