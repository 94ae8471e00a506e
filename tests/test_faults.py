"""The fault suite (reliability/faults.py) at its quick sizes, asserting on every row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_fault_suite_quick():
    result = subprocess.run(
        [sys.executable, "-m", "reliability.faults", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    rows = re.findall(r"^    (\d\. .+?)\s+(\d+)\s+(\d+)\s+(\d+)  (.*)$", out, re.M)
    cases = {row[0].split(" ", 1)[0] for row in rows}
    assert cases == {f"{n}." for n in range(1, 10)}, out
    for case, attempts, overlapping, lost, notes in rows:
        assert int(attempts) > 0, case
        assert int(overlapping) == 0, f"{case}: {notes}"
        assert int(lost) == 0, f"{case}: {notes}"
    assert re.search(r"contention, 16 processes.+?\s(\d+)\s", out)
    assert (
        int(re.search(r"contention, 16 processes, one id\s+(\d+)", out).group(1)) >= 300
    )
    assert "first holder reported the loss 1/1" in out
    freed = float(re.search(r"lock free (\d+\.\d)", out).group(1))
    assert freed <= 3 + 1.5, "a killed holder's lock outlived its expiry"
    assert "unclear errors: 0; resumed without restart 2/2" in out
    assert "without a clear error or check message: 0" in out
    assert "keys left behind: 0" in out
    assert "fencing counters kept: 1000" in out
    renewed = re.search(r"kept 3 expiries by renewal; lock free (\d+\.\d)", out)
    assert renewed and float(renewed.group(1)) <= 2 + 0.3, out
    assert "older fence every time" in out
