"""A short run of the benchmark script: that it runs and reports, not how fast."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_benchmark_quick_run_reports_every_variant():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
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
