"""Blocking acquires on PostgreSQL wait in the lock's line
(``backends.postgres.line``): in the order they came, woken across
processes by the release's ``NOTIFY`` where the process can ``LISTEN``
(directly), polling in turn through PgBouncer, never left hanging by a
waiter that died, gave up or whose line was lost."""

from __future__ import annotations

import logging
import statistics
import time

import pytest

from django_tasklock import Lock, LockBackendError
from django_tasklock.backends import backend_for
from django_tasklock.backends.postgres import statements as sql
from django_tasklock.backends.postgres.line import TURN_POLL, Listener
from django_tasklock.locks.line import LONGEST, MARK
from tests.helpers import wait_until
from tests.locks.lines import (
    after_a_killed_waiter,
    after_a_lost_line,
    gives_up_and_leaves,
    handoff_across_processes,
    joins_the_end,
    shared_in_turn,
    taken_in_order,
)

LOCK_ID = "postgres-line-test"


@pytest.fixture(autouse=True)
def _on_postgres(settings):  # (tests/conftest.py stops the listeners after)
    settings.TASKLOCK = {"CACHE": "postgres", "LIVENESS": None}
    backend = backend_for("postgres")
    key = backend.keys_for(LOCK_ID)[0]
    backend._run(sql.DELETE_MANY, sql.array([key, key + sql.LINE]))


def _line(alias: str = "postgres", lock_id: str = LOCK_ID) -> str | None:
    """The line row of ``lock_id`` as stored (None: no live row)."""
    backend = backend_for(alias)
    key = backend.keys_for(lock_id)[0]
    peek = backend.peek(key + sql.LINE)
    return None if peek is None else str(peek.value)


def _in_line(alias: str = "postgres", lock_id: str = LOCK_ID) -> int:
    """How many waiters the line of ``lock_id`` lists whose marks are live."""
    now = time.time()
    entries = (_line(alias, lock_id) or "").split()
    return sum(1 for entry in entries if float(entry.split("/")[1]) > now)


def test_a_release_in_another_process_wakes_the_waiter_by_notify(monkeypatch):
    from django_tasklock.backends.postgres.line import PostgresLines
    from django_tasklock.locks import line

    # The listener proven first: a wait begun before it hears polls in turn.
    wait_until(lambda: Listener.of(backend_for("postgres")).hears)

    # What each of the waiter's waits returned: True when woken (the release
    # is another process's: only its NOTIFY can), False when its time ran
    # out. Judged by that, not by time against a poll's pause (a control that
    # a loaded run's lucky polls once beat). Each wait lasts up to 20 s here,
    # not its 0.5 s, so the release, a second in, lands inside one (with the
    # 0.5 s, a loaded run's second wait ended as the release came).
    def waits_long(hint: float, deadline: float | None, now: float) -> float | None:
        return None if deadline is not None and now >= deadline else 20.0

    monkeypatch.setattr(line, "turn_wait", waits_long)
    woken: list[bool] = []
    wait_turn = PostgresLines.wait_turn

    def told(self, key: str, waiter: str, timeout: float) -> bool:
        got = wait_turn(self, key, waiter, timeout)
        woken.append(got)
        return got

    monkeypatch.setattr(PostgresLines, "wait_turn", told)
    gaps = []
    for _ in range(3):
        woken.clear()
        gaps.append(handoff_across_processes(LOCK_ID, "postgres", "line"))
        assert woken and woken[-1] is True, woken
    print(f"line: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    assert statistics.median(gaps) < 0.25


def test_through_pgbouncer_the_waiter_polls_in_turn_and_says_why(settings, caplog):
    settings.TASKLOCK = {"CACHE": "pgbouncer", "LIVENESS": None}
    with caplog.at_level(logging.WARNING, logger="django_tasklock"):
        listener = Listener.of(backend_for("pgbouncer"))
        assert listener is not None
        wait_until(lambda: "did not reach" in caplog.text)
    assert not listener.hears
    assert "OPTIONS['LISTEN']" in caplog.text
    gaps = [handoff_across_processes(LOCK_ID, "pgbouncer", "line") for _ in range(3)]
    print(f"line through PgBouncer: handoffs {[round(g * 1000, 1) for g in gaps]} ms")
    assert statistics.median(gaps) < TURN_POLL + 0.09  # polled, not the 0.5 s


def test_listen_set_to_a_direct_alias_wakes_waiters_behind_pgbouncer(settings):
    settings.CACHES = {
        **settings.CACHES,
        "pgbouncer": {**settings.CACHES["pgbouncer"], "OPTIONS": {"LISTEN": "pg"}},
    }
    settings.TASKLOCK = {"CACHE": "pgbouncer", "LIVENESS": None}
    listener = Listener.of(backend_for("pgbouncer"))
    assert listener is not None
    wait_until(lambda: listener.hears)


def test_listen_none_polls_and_a_bad_listen_is_refused(settings):
    from django_tasklock.checks import check_settings

    settings.CACHES = {
        **settings.CACHES,
        "postgres": {**settings.CACHES["postgres"], "OPTIONS": {"LISTEN": None}},
    }
    assert Listener.of(backend_for("postgres")) is None
    settings.CACHES = {
        **settings.CACHES,
        "postgres": {**settings.CACHES["postgres"], "OPTIONS": {"LISTEN": "nowhere"}},
    }
    errors = [e for e in check_settings(None) if "OPTIONS['LISTEN']" in e.msg]
    assert errors and "directly" in errors[0].msg, errors


def test_an_uncontended_blocking_acquire_leaves_no_line():
    lock = Lock(LOCK_ID, expire=30)
    assert lock.acquire(blocking=True, timeout=5)
    assert lock.release()
    assert _line() is None


def test_waiters_take_the_lock_in_the_order_they_came():
    assert taken_in_order(LOCK_ID, _in_line) == [0, 1, 2, 3, 4]
    assert _in_line() == 0


def test_a_holder_taking_it_again_at_once_joins_the_end():
    joins_the_end(LOCK_ID, _in_line)


def test_a_waiter_that_gives_up_leaves_the_line():
    # Had it stayed, the next waiter would wait for its mark to expire.
    assert gives_up_and_leaves(LOCK_ID, _in_line) < MARK


@pytest.mark.slow
def test_a_waiter_killed_in_line_holds_it_up_no_longer_than_its_mark():
    waited = after_a_killed_waiter(LOCK_ID, "postgres", _in_line)
    assert waited <= MARK + LONGEST + 1.0


def test_a_lost_line_costs_order_never_a_hang():
    backend = backend_for("postgres")

    def lose() -> None:
        backend._run(sql.DELETE, backend.keys_for(LOCK_ID)[0] + sql.LINE)

    # Nobody in line to wake: the waiter's own try finds the lock free.
    assert after_a_lost_line(LOCK_ID, _in_line, lose) <= LONGEST + 0.5


@pytest.mark.slow
def test_processes_taking_the_lock_again_and_again_share_it_in_turn():
    shared_in_turn("postgres", 0.6)


def test_a_store_down_while_waiting_raises_the_lock_error(settings):
    from django_tasklock.backends.postgres.statements import CREATE
    from tests.locks.lines import stopped_while_waiting
    from tests.services_pg import Postgres

    server = Postgres().start()
    try:
        server.execute(CREATE)
        settings.DATABASES["pg_own"]["PORT"] = str(server.port)
        errors = stopped_while_waiting(
            settings,
            "django_tasklock.backends.postgres.cache.PostgresCache",
            "pg_own",
            server,
            lambda: _in_line("own", "stopped-line") == 1,
        )
    finally:
        server.remove()
    assert errors and isinstance(errors[0], LockBackendError), errors
