"""The pytest plugin and the TestCase mixin (``django_tasklock.testing``), used
as a project would: a sample test module run in a pytest process of its own,
twice in one run, in random order, on the session's real memcached and Redis."""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SAMPLES = ROOT / "tests" / "plugin_sample"
#: The sample's run: its own conftest and settings, no xdist, random order.
PYTEST = [
    *(sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider"),
    *shlex.split("-p no:xdist --ds tests.settings -p randomly --keep-duplicates -q"),
]


def run_sample(module: str, cache: str, *extra: str, **env: str) -> str:
    """Run a sample module in a pytest process of its own (no conftest of
    this suite: nothing flushes the stores between its tests); its output,
    after asserting it exited as the caller expects (``extra``)."""
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
        "PYTHONPATH": str(ROOT),
        "SAMPLE_CACHE": cache,
        **env,
    }
    for name in ("TASKLOCK_TEST_BROKER", "TASKLOCK_TEST_RESULTS"):
        environment.pop(name, None)  # the memory broker: calls stay pending
    path = str(SAMPLES / module)
    seed = random.randrange(2**32)  # a new order each time: printed if it fails
    result = subprocess.run(
        [
            *PYTEST,
            "--rootdir",
            str(SAMPLES),
            f"--randomly-seed={seed}",
            *extra,
            path,
            path,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=SAMPLES,
    )
    return f"exit {result.returncode}\n(seed {seed})\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    "cache",
    ["default", "redis", "postgres"],
    ids=["memcached", "redis", "postgres"],
)
def test_a_projects_tests_run_twice_in_random_order_and_leak_nothing(cache):
    """Every test leaves state that would break another, or its own second
    run: a held lock, a used-up 1/h limit, a full semaphore, a pending call.
    Isolated, all pass in any order, twice."""
    out = run_sample("sample_isolation.py", cache)
    assert out.startswith("exit 0"), out
    assert "14 passed" in out, out


def test_without_isolation_the_same_tests_fail():
    """The control: the same module with a fixture that does not isolate."""
    out = run_sample("sample_isolation.py", "default", SAMPLE_CONTROL="1")
    assert out.startswith("exit 1"), out
    failed = re.search(r"(\d+) failed", out)
    assert failed and int(failed.group(1)) >= 2, out  # the limit's second run too


def test_a_test_that_leaves_a_lock_held_fails():
    out = run_sample("sample_leak.py", "default")
    assert out.startswith("exit 1"), out
    # Both runs fail at their end, for the lock left held (pytest counts a
    # failure in a fixture's tear-down as an error).
    assert "2 errors" in out and "failed" not in out, out
    assert "The test left 1 lock(s) held: 'sample-forgotten'" in out, out


def test_a_lock_left_held_is_released_when_the_test_ends(settings):
    from django_tasklock import Lock
    from django_tasklock.backends import backend_for
    from django_tasklock.testing import Isolation

    isolation = Isolation()
    isolation.start()
    lock = Lock("left-behind")
    assert lock.acquire()
    key = lock.acquisition.key  # under the test's own prefix
    backend = backend_for("default")
    assert backend.locked(key)
    with pytest.raises(AssertionError, match="left 1 lock\\(s\\) held: 'left-behind'"):
        isolation.stop()
    assert not backend_for("default").locked(key)
    # Allowed: released as well, and the test passes.
    isolation = Isolation()
    isolation.start()
    lock = Lock("left-on-purpose")
    assert lock.acquire()
    key = lock.acquisition.key
    isolation.allow_held("left-on-purpose")
    isolation.stop()
    assert not backend_for("default").locked(key)


def test_the_isolation_covers_an_alias_a_decorator_names(settings, monkeypatch):
    """``@single_instance(cache="pair")`` locks in an alias TASKLOCK does not
    name: the isolation gives it the test's key prefix too, so a lock on the
    same id held outside the test is not seen inside it."""
    from django_tasklock import Lock, declared, lock_id_for
    from django_tasklock.testing import Isolation
    from tests.helpers import close_connections

    # The alias the module's decorator names is this test's only: the checks
    # other tests of this process run (the docs' examples) must not see it.
    monkeypatch.setattr(declared, "_aliases", declared.named_aliases())
    from tests.named_alias import counted

    declared.name_alias("pair", f"{counted.__module__}.{counted.__qualname__}")

    settings.TASKLOCK = {"CACHE": "default"}
    outside = Lock(lock_id_for(counted, "x"), cache="pair")
    assert outside.acquire()
    assert outside.acquisition is not None
    backend = outside.acquisition.backend  # (closed at the end: it outlives
    try:  # the CACHES generations the isolation makes)
        assert counted("x") is None  # not isolated: the lock outside is seen
        isolation = Isolation()
        isolation.start()
        try:
            assert counted("x") == "ran x"
        finally:
            close_connections()
            isolation.stop()
    finally:
        outside.release()
        backend.close()
        close_connections()
