"""Each module logs under its own name; a name an earlier build logged the
same messages under keeps working while a configuration names it."""

from __future__ import annotations

import logging

import pytest

from django_tasklock import Lock, single_instance


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@single_instance(key="name")
def skipped(name: str) -> str:
    return name


def _skip_once() -> None:
    held = Lock(skipped._tasklock_lock_id(skipped._tasklock_name, False, ("a",), {}))
    assert held.acquire()
    try:
        assert skipped("a") is None  # skipped: logged at INFO
    finally:
        held.release()


@pytest.fixture
def loggers():
    """Root at WARNING with a collecting handler; the old name left as found."""
    root, old = logging.getLogger(), logging.getLogger("django_tasklock.decorator")
    saved = (root.level, old.level, old.propagate, list(old.handlers))
    at_root = Collect()
    root.addHandler(at_root)
    root.setLevel(logging.WARNING)
    yield at_root, old
    root.removeHandler(at_root)
    root.setLevel(saved[0])
    old.setLevel(saved[1])
    old.propagate = saved[2]
    old.handlers[:] = saved[3]


def skip_messages(records: list[logging.LogRecord]) -> list[str]:
    return [r.name for r in records if r.getMessage().startswith("Skipped ")]


def test_a_module_logs_under_its_own_name(any_store, loggers):
    at_root, _old = loggers
    logging.getLogger("django_tasklock").setLevel(logging.INFO)
    try:
        _skip_once()
    finally:
        logging.getLogger("django_tasklock").setLevel(logging.NOTSET)
    assert skip_messages(at_root.records) == ["django_tasklock.policies.contention"]


def test_the_name_it_logged_under_before_keeps_working(any_store, loggers):
    # A configuration of the old name (INFO, a handler): the message reaches
    # it although the root is at WARNING, once, and propagates from there once.
    at_root, old = loggers
    at_old = Collect()
    old.addHandler(at_old)
    old.setLevel(logging.INFO)
    _skip_once()
    assert skip_messages(at_old.records) == ["django_tasklock.policies.contention"]
    assert skip_messages(at_root.records) == ["django_tasklock.policies.contention"]
    # Its propagate=False keeps it from the root, as before.
    old.propagate = False
    _skip_once()
    assert len(skip_messages(at_old.records)) == 2
    assert len(skip_messages(at_root.records)) == 1
    # Nothing set on the old name any more: the usual way, by the root's level.
    old.handlers[:] = []
    old.setLevel(logging.NOTSET)
    old.propagate = True
    _skip_once()
    assert len(skip_messages(at_root.records)) == 1  # INFO, under WARNING
