"""A short run of the benchmark script: that it runs and reports, not how fast."""

from __future__ import annotations

import re

import pytest

from tests.services import run_module

pytestmark = pytest.mark.long(seconds=75)


@pytest.mark.slow
def test_benchmark_quick_run_reports_every_variant():
    out = run_module("benchmarks.bench", "--quick", timeout=300, measured=False)
    for variant in (
        "floor (raw add+delete)",
        "cookbook recipe (cache.add+delete)",
        "memcache_lock",
        "Lock",
        "@single_instance",
        "without lock",
    ):
        assert re.search(rf"^\s+{re.escape(variant)}\s+\d", out, re.M), variant
    assert re.search(r"Python 3\.\d+\.\d+, Django \d", out)
    assert re.search(r"memcached 1\.\d+\.\d+", out)
    assert re.search(r"^\s+Lock\s+\d+\s+\d\.\d\dx", out, re.M), "contended row"
    # The contended rows of every store, each a count of acquisitions made.
    for title in ("on a Redis Cluster", "on PostgreSQL", "through PgBouncer"):
        rows = re.search(
            rf"^\s+contended {title}\s+acq/s\s+x floor\n\s+floor .*?(\d+)\s+1\.00x\n"
            rf"\s+Lock \(\w+\)\s+(\d+)\s+\d+\.\d\dx$",
            out,
            re.M,
        )
        assert rows and int(rows.group(1)) > 0 and int(rows.group(2)) > 0, title
    # A released lock whose fence was never read leaves nothing in the store.
    released = re.search(r"1,000 ids, released\s+(-?[\d.]+)\s+(-?[\d.]+)", out)
    held = re.search(r"1,000 ids, held\s+([\d.]+)\s+([\d.]+)", out)
    assert released and held, out
    assert float(released.group(2)) == 0 and float(held.group(2)) == 1
    for peer in (
        "@single_instance (memcached)",
        "@single_instance (Redis)",
        "celery_once QueueOnce",
        "celery-singleton Singleton",
    ):
        row = re.search(rf"^\s+{re.escape(peer)}\s+(\d+\.\d\d)x \[", out, re.M)
        assert row and float(row.group(1)) > 0, peer
    for variant in ("until_finished (memcached)", "until_finished (Redis)"):
        row = re.search(rf"^\s+{re.escape(variant)}\s+.*\]\s+(\d+)$", out, re.M)
        assert row and int(row.group(1)) == 0, f"{variant}: runs overlapped"
    unlocked = re.search(r"^\s+without lock\s+.*\]\s+(\d+)$", out, re.M)
    assert unlocked and int(unlocked.group(1)) > 0, "no overlap without a lock: blind"
    retried = re.search(
        r"^\s+until_finished \(memcached\)\s+(\d+) of (\d+)$", out, re.M
    )
    assert retried and retried.group(1) == retried.group(2), "a retry was lost"
    for kind in ("plain (publish)", "until_finished, joined (no publish)"):
        assert re.search(rf"^\s+{re.escape(kind)}\s+\d+us$", out, re.M), kind
    # A killed pool process: the same call ran again, here sooner than the peers
    # (their 10 s lock outlives the kill; this project's 600 s lock does not).
    killed = {
        name: re.search(rf"^\s+{re.escape(name)}\s+(\d+\.\d)s  \(", out, re.M)
        for name in (
            "until_finished (memcached)",
            "celery_once QueueOnce",
            "celery-singleton Singleton",
        )
    }
    assert all(killed.values()), out
    ours, *peers = (float(found.group(1)) for found in killed.values())  # type: ignore[union-attr]
    assert ours < min(peers), out
