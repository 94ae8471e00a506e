"""A short run of the instruction-count benchmark (``benchmarks/cpu.py``), in a
module of its own so that it runs beside the other benchmarks' short runs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.services import ROOT, run_module

# After the other long modules (tests/conftest.py): valgrind's run is CPU
# bound, and under the load of the first ones it took over 600 s.
pytestmark = pytest.mark.long(first=False, seconds=40)


@pytest.mark.slow
def test_instruction_count_quick_run_reports_the_floor_and_a_lock():
    out = run_module("benchmarks.cpu", "--quick", timeout=600, measured=False)
    floor = re.search(r"floor: raw add \+ delete\s+([\d,]+)\s+1\.00x", out)
    lock = re.search(r"Lock cycle\s+([\d,]+)\s+(\d+\.\d\d)x", out)
    assert floor and lock, out
    # Counted, not made up: per operation (between the probe's marks), two commands'
    # worth each, and two different counts.
    floor_count = int(floor.group(1).replace(",", ""))
    lock_count = int(lock.group(1).replace(",", ""))
    assert 10_000 < floor_count < 500_000
    assert floor_count / 2 < lock_count < floor_count * 3
    assert lock_count != floor_count
    assert float(lock.group(2)) == pytest.approx(lock_count / floor_count, abs=0.01)


@pytest.mark.slow
def test_a_client_request_reaches_valgrind_and_is_nothing_natively():
    """The request the probe turns callgrind's instrumentation on with
    (benchmarks/valgrind.py): valgrind answers it; natively it answers 0."""
    code = "from benchmarks.valgrind import running_on_valgrind as r; print(r())"
    native = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    under = subprocess.run(
        ["valgrind", "--tool=none", "-q", sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert (native.stdout, under.stdout) == ("0\n", "1\n"), native.stderr + under.stderr
