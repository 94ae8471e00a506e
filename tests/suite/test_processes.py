"""The processes the tests and the fault runs start (tests/processes.py): forked
from a server that imported the libraries, each in the environment it was
made in."""

from __future__ import annotations

import os
import sys

from tests.processes import process_context
from tests.services import COVERAGE_VARIABLES


def _report(queue) -> None:
    queue.put(
        (
            os.getppid(),
            os.environ.get("TASKLOCK_PROCESSES_PROBE"),
            "django.db.models" in sys.modules,
        )
    )


def _run_one(context) -> tuple[int, str | None, bool]:
    queue = context.Queue()
    process = context.Process(target=_report, args=(queue,))
    process.start()
    try:
        return queue.get(timeout=120)
    finally:
        process.join(60)


def test_a_process_runs_in_the_environment_it_was_made_in(monkeypatch):
    context = process_context()
    monkeypatch.setenv("TASKLOCK_PROCESSES_PROBE", "first")
    _, first, _ = _run_one(context)  # (the fork server starts here, if forked)
    monkeypatch.setenv("TASKLOCK_PROCESSES_PROBE", "second")
    parent, second, preloaded = _run_one(context)
    assert (first, second) == ("first", "second")
    if any(name in os.environ for name in COVERAGE_VARIABLES):
        assert parent == os.getpid()  # spawned, so that coverage measures it
    else:
        # Forked from the server (not a child of this process), which had
        # imported Django's models before: the process did not pay for them.
        assert parent != os.getpid()
        assert preloaded
