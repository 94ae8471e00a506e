"""The fenced writes' tests again, with MariaDB data too: in a pytest session
of their own, with a MariaDB of their own (the DATABASES alias ``mysql``
exists only there; Django 6's system checks would ask its server for its
version in every test that runs them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.services_mariadb import MariaDB

pytestmark = [pytest.mark.slow, pytest.mark.long(seconds=120)]


def test_the_fenced_writes_tests_pass_on_mariadb():
    server = MariaDB().start()
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:randomly",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/fenced/test_fenced.py",
                "tests/fenced/test_robbed_holders.py",
                "-k",
                "mariadb or robbed",
            ],
            cwd=ROOT,
            env={**os.environ, "TASKLOCK_TEST_MARIADB": str(server.port)},
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        server.remove()
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    # Every test of test_fenced.py that takes a database, on MariaDB, and
    # the robbed holders' five with it among their databases.
    assert passed and int(passed.group(1)) >= 20, run.stdout[-3000:]
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
