"""Park and promote's line (``parking``) on every store, and what is refused
at decoration: processes racing on one line lose no call and run none twice,
each change being one compare-and-set of the line's item."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from django_tasklock import InvalidArgument, InvalidArgumentType, single_instance
from django_tasklock.parking import ParkLine, Registry, Verdict
from django_tasklock.status import park_status
from tests.helpers import SHARED_STORES
from tests.parking_process import park_then_start

#: The stores shared between processes (the line is one item there).
STORES = SHARED_STORES


@pytest.mark.parametrize("store", STORES, indirect=True, ids=lambda s: s.name)
def test_racing_processes_lose_no_parked_call_and_start_each_once(store):
    lock_id = f"park-race-{store.name}"
    processes, calls = 4, 15
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=spawn) as pool:
        futures = [
            pool.submit(park_then_start, store.tasklock, lock_id, me, calls, processes)
            for me in range(processes)
        ]
        results = [future.result(timeout=180) for future in futures]
    tickets = sorted(t for got, _ in results for t in got)
    ran = sorted(c for _, started in results for c in started)
    everyone = sorted(f"call-{p}-{n}" for p in range(processes) for n in range(calls))
    # Every park got a ticket of its own: none was written over by another.
    assert tickets == list(range(1, processes * calls + 1))
    # Every call started once, in one process; the copies were dropped.
    assert ran == everyone
    line = ParkLine(lock_id, None, 120).read()
    assert not line.waiting and sorted(line.running) == everyone


def test_the_line_keeps_arrival_order_and_full_lines_say_who_left(memcached_locks):
    line = ParkLine("park-unit", None, 60)
    assert line.park("a", 2, "refuse", False) == ("", 1)
    assert line.park("b", 2, "refuse", False) == ("", 2)
    assert line.park("c", 2, "refuse", False) == ("c", 0)  # refused itself
    assert line.park("c", 2, "drop_oldest", False) == ("a", 3)
    assert line.park("d", 2, "replace", False) == ("c", 4)
    assert line.read().ids() == ["b", "d"]
    assert line.promote(1) == ["b"]
    assert line.promote(1) == []  # b is on its way: one slot, one promotion
    # b found no slot: back at the head, ahead of d.
    assert line.park("b", 2, "refuse", True) == ("", 0)
    assert line.read().ids() == ["b", "d"]
    assert line.start("d", "t", lambda token: True) == Verdict.RUN
    assert line.start("d", "t2", lambda token: True) == Verdict.DROP  # a copy
    assert line.start("x", "t3", lambda token: True) == Verdict.PARK  # behind b
    # d was the line's; b still waits (parked), and x only asked.
    assert line.ended("d") == (True, True)
    assert line.ended("never-parked") == (False, True)
    assert line.start("d", "t4", lambda token: True) == Verdict.DROP  # it ended
    status = park_status("park-unit")
    assert [c for c, _ in status.parked] == ["b"] and status.running == []
    assert line.start("a", "t5", lambda token: True) == Verdict.DROP  # dropped


def test_a_started_call_whose_run_died_runs_again_when_delivered_again(
    memcached_locks,
):
    line = ParkLine("park-again", None, 60)
    line.park("a", 5, "refuse", False)
    assert line.start("a", "t1", lambda token: True) == Verdict.RUN
    # acks_late: the message comes back after its run's process died.
    assert line.start("a", "t2", lambda token: token != "t1") == Verdict.RUN
    assert line.read().running == {"a": "t2"}
    assert line.forget_dead_runs(lambda: []) == 1  # no slot holds t2
    assert line.start("a", "t3", lambda token: True) == Verdict.DROP


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"park": 5}, InvalidArgumentType, "add on_contention='park'"),
        ({"on_park_full": "drop_oldest"}, InvalidArgumentType, "on_contention='park'"),
        ({"on_contention": "park", "park": 0}, InvalidArgument, "park must be from 1"),
        ({"on_contention": "park", "park": True}, InvalidArgumentType, "park must be"),
        (
            {"on_contention": "park", "on_park_full": "oldest"},
            InvalidArgument,
            "on_park_full",
        ),
        (
            {"on_contention": "park", "mode": "until_finished"},
            InvalidArgumentType,
            "mode='while_running'",
        ),
    ],
)
def test_park_options_are_checked_at_decoration(options, error, says):
    with pytest.raises(error, match=says):
        single_instance(**options)


def test_an_async_function_cannot_park():
    with pytest.raises(InvalidArgumentType, match="on_contention='park'"):

        @single_instance(on_contention="park")
        async def fetch() -> None: ...


def _a_line_of_three(lock_id: str) -> ParkLine:
    """A line of three parked calls and one promoted, listed for the sweeps."""
    line = ParkLine(lock_id, None, 60)
    for call_id in ("call-a", "call-b", "call-c", "call-d"):
        line.park(call_id, 10, "refuse", False)
    assert line.promote(1) == ["call-a"]
    Registry(None).add(lock_id, 1, 60)
    return line


@pytest.mark.django_db
def test_the_console_and_status_show_the_line(memcached_locks, admin_client):
    from io import StringIO

    from django.core.management import CommandError, call_command

    from tests import tasks  # declares parking tasks (TASKLOCK["CACHE"]'s store)

    assert tasks.parked_one is not None
    lock_id = "park-shown"
    _a_line_of_three(lock_id)
    page = admin_client.get("/admin/django_tasklock/heldlock/").content.decode()
    assert 'id="tasklock-park-list"' in page
    row = page.split(f'data-lock-id="{lock_id}"', 1)[1].split("</tr>", 1)[0]
    assert '<td class="parked" title="call-b call-c call-d ">3</td>' in row
    assert '<td class="promoted">1</td>' in row
    out = StringIO()
    # The lock itself is free: exit status 1, as for any free lock.
    with pytest.raises(CommandError, match="is not held"):
        call_command("tasklock", "status", lock_id, stdout=out)
    shown = out.getvalue()
    assert "Parked:     3 calls, oldest first" in shown
    assert shown.index("call-b") < shown.index("call-c") < shown.index("call-d")
    assert "Promoted:   call-a" in shown
