"""Many processes, one lock id: never two holders at once."""

from __future__ import annotations

import pytest

from tests.workers import Storms, hammer, overlaps, storm

PROCESSES = 16
WANTED = 500


@pytest.fixture(scope="module")
def storms():
    """The storms' processes, started once for every store's."""
    with Storms(PROCESSES) as pool:
        yield pool


def run_storm(storms, tasklock, mode="lock", processes=PROCESSES, wanted=WANTED):
    results = storm(
        hammer, processes, wanted, (tasklock, "storm-lock"), (mode,), storms=storms
    )
    holds = [hold for process_holds, _ in results for hold in process_holds]
    refused = sum(refused for _, refused in results)
    working = sum(1 for process_holds, _ in results if process_holds)
    return holds, refused, working


@pytest.mark.slow
def test_contention_no_overlapping_holds(store, storms):
    holds, refused, working = run_storm(storms, store.tasklock)
    assert overlaps(holds) == 0
    # The run means something only if the processes really fought for the lock.
    assert len(holds) >= WANTED, f"only {len(holds)} acquisitions"
    assert refused >= len(holds), "too little contention to prove anything"
    print(f"{len(holds)} holds, {refused} refused, {working} processes held it")
    assert working >= PROCESSES // 2, f"only {working} processes ever held it"


@pytest.mark.slow
def test_overlap_detector_sees_unlocked_overlaps(settings, storms):
    """The same harness without the lock finds overlaps, so zero above is real."""
    holds, _, _ = run_storm(
        storms, {"CACHE": "default"}, mode="none", processes=4, wanted=2000
    )
    assert overlaps(holds) > 100
