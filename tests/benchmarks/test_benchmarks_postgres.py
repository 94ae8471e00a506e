"""A short run of the PostgreSQL table benchmark: the table stays a few pages
whatever the cycles (the releases keep their rows, the takes update them in
place), and a releasing DELETE would not."""

from __future__ import annotations

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
