"""The README's first command runs the demo; it must keep working."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_lock_demo_reports_success():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lock_demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "overlapping holds (measured from each hold's start and end): 0" in out
    assert "ALSO GOT IN: two imports at once" in out  # the recipe's failure, shown
    assert out.count("the old holder's release left the new holder's lock") == 2
    assert "RESULT: OK" in out
    assert "Stopped the private memcached" in out
