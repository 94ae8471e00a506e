"""A short run of the benchmark script: that it runs and reports, not how fast."""

from __future__ import annotations

import re

import pytest

from tests.services import run_module


@pytest.mark.slow
def test_benchmark_quick_run_reports_every_variant():
    out = run_module("benchmarks.bench", "--quick", timeout=300)
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


@pytest.mark.slow
def test_rate_limit_quick_run_counts_no_violation_and_no_lost_call():
    out = run_module("benchmarks.rates", "--quick", timeout=900)
    rows = re.findall(
        r"^\s+(window|smooth), (memcached|Redis)\s+200/s\s+([\d,]+)\s+[\d.]+s"
        r"\s+(\d+)\s+([\d.]+)%",
        out,
        re.M,
    )
    assert len(rows) == 4, out
    for kind, store, admitted, violations, share in rows:
        assert int(admitted.replace(",", "")) >= 1000, (kind, store)
        assert int(violations) == 0, (kind, store)
        # Callers that come back when told get most of the rate (the docs
        # table, from a full run alone on the machine, shows how much).
        assert float(share) > 50, (kind, store)
    calls = re.findall(
        r"^\s+@rate_limited, (window|smooth)\s+(\d+)/60\s+(\d+)\s+([\d.]+)$",
        out,
        re.M,
    )
    assert [call[:3] for call in calls] == [
        ("window", "60", "0"),
        ("smooth", "60", "0"),
    ], out
    # A backlog is sent again once per call, for its own turn (the storm
    # allows no fewer than 1 + 40/60 here), not once per refusal.
    assert all(float(call[3]) <= 2.0 for call in calls), out
    long = re.findall(
        r"^\s+(window|smooth), (memcached|Redis)\s+100/30d\s+([\d,]+)\s+(\d+)\s",
        out,
        re.M,
    )
    assert len(long) == 4, out
    assert all(int(row[3]) == 0 for row in long), out
    # 90 days of a 30-day window: three periods' worth, and no more (a state
    # that expired at once, as memcached reads a long ttl, would admit 2,400).
    assert ("window", "memcached", "300", "0") in long, out
    celery = re.search(r'Celery rate_limit="10/s"\s+(\d+)$', out, re.M)
    ours = re.search(r'@rate_limited\("10/s"\)\s+(\d+)$', out, re.M)
    assert celery and ours, out
    # Per worker: two workers let twice the rate through; the limiter, its
    # rate (counted on body starts, which lag their admission by a few ms
    # each, more on a busy machine, so one second of them may hold one or
    # two more; the exactness rows check the admissions themselves).
    assert int(ours.group(1)) <= 12 < int(celery.group(1))


@pytest.mark.slow
def test_beat_benchmark_quick_run_counts_no_double_and_no_lost_run():
    """Three beats for a minute, the leader killed at 30 s and paused at 45 s:
    every publish counted, none doubled, none lost beyond the catch-up."""
    out = run_module("benchmarks.beat", "--quick", timeout=300)
    fields = dict(re.findall(r"^\s+([a-z -]+): (\S+)$", out, re.M))
    assert int(fields["sends"]) > 100, out  # five entries a second, mostly sent
    assert int(fields["faults"]) >= 2, out
    assert fields["doubles"] == "0" and fields["lost beyond catch-up"] == "0", out
    assert fields["takeover median"] != "None", out
