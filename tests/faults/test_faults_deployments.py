"""The fault suite's quick run, third group: deployments and the lock lifecycle (see
``tests/faults_checks.py``)."""

from __future__ import annotations

import pytest

from tests.faults_checks import GROUPS, run_group

pytestmark = pytest.mark.long(seconds=140)


@pytest.mark.slow
def test_fault_suite_quick_deployments_lifecycle():
    run_group(GROUPS[2])
