"""A short run of the highly available beat benchmark (``benchmarks/beat.py``),
in a module of its own so that it runs beside the other benchmarks' short runs."""

from __future__ import annotations

import re

import pytest

from tests.services import run_module

pytestmark = pytest.mark.long


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
