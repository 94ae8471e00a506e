"""The fault suite's quick run, second group: calls, limits, unknown outcomes and a cluster (see
``tests/faults_checks.py``)."""

from __future__ import annotations

import pytest

from tests.faults_checks import GROUPS, run_group

pytestmark = pytest.mark.long(seconds=160)


@pytest.mark.slow
def test_fault_suite_quick_calls_limits_unknown_cluster():
    run_group(GROUPS[1])
